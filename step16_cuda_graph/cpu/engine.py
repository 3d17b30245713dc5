"""Lesson 16's engine with the CPU fast path: the same Engine, given other parts.

What changes against lesson 16 (`step16_cuda_graph.engine.build_engine`), on a CPU:
  - model transforms, applied here before the engine is made (each returns a new model):
    lesson 14's packing, then q|k|v and gate|up fused into one packed matmul each (fused.py),
    then the packed linears routed through our library op (ops.py) so that a packed model
    compiles, each bf16 one also kept in its plain layout for steps of one to four rows, which
    our GEMV reads faster than oneDNN's call at that size (elementwise.cpp's gemv_bf16), each
    float32 one packed in panels for our float32 matmul (gemm_f32.h: on a CPU whose widest unit
    is AVX2 it beats oneDNN's at every step size);
  - the runner is CpuGraphRunner (runner.py): decode buckets called without Dynamo, prompt
    steps through a dynamic compiled body, a packed LM head;
  - the sampler's greedy pick is one C pass over the float32 logits (`ops.row_argmax`);
  - the KV pool's memory on 2 MB pages where the OS grants them (huge_pages.py).
Where the step cannot be compiled here (a GPU, no C++ compiler, another attention backend)
this is lesson 16's engine.
"""
from __future__ import annotations

from torch import nn

from step06_sampler.sampler import Sampler
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step14_batched_forward.packed_linear import pack_linears
from step15_flash_attention.backends import choose_backend
from step15_flash_attention.engine import Engine, create_kv_pool, create_scheduler, fit_block_size, scheduler_parts
from step16_cuda_graph import engine as lesson16
from step16_cuda_graph.runner import compile_works
from step16_cuda_graph.cpu.fused import fuse_projections
from step16_cuda_graph.cpu.huge_pages import HugePageKVPool
from step16_cuda_graph.cpu.ops import route_packed_linears, row_argmax
from step16_cuda_graph.cpu.runner import CpuGraphRunner


class KernelSampler(Sampler):
    """Lesson 06's sampler with the greedy pick as one C pass over the float32 logits."""
    argmax = staticmethod(row_argmax)


def cpu_fast_path(model: nn.Module, small_rows: bool = True) -> nn.Module:
    """The model transforms of this lesson, in order; `model` is not changed. small_rows: our own
    matmuls on a copy of each weight where they apply (ops.OpPackedLinear): gemv_bf16 for bf16
    steps of one to four rows, gemm_f32 for float32 steps."""
    return route_packed_linears(fuse_projections(pack_linears(model), kernels=True), small_rows)


def build_engine(model: nn.Module, config: PagedSchedulerConfig | None = None, attention_backend: str = "auto",
                 use_graph: bool = True, record_now: bool = True, max_bucket: int | None = None,
                 compile_mixed: bool = True, direct_calls: bool = True, sampler: Sampler | None = None,
                 engine_class: type[Engine] = Engine, small_rows: bool = True, one_call: bool = True,
                 **parts) -> Engine:
    """direct_calls=False: every compiled call goes through Dynamo; compile_mixed=False: prompt
    steps run eagerly; use_graph=False: lesson 15's engine with this lesson's model and sampler;
    small_rows=False: no plain weight copies, every linear through oneDNN (cpu_fast_path);
    one_call=False: decode steps of one to four rows compiled like the others, not one C call
    each (decode_step.py).
    engine_class, parts: as lesson 15's build_engine."""
    config = config or PagedSchedulerConfig()
    device = model.model.embed_tokens.weight.device
    attention = choose_backend(attention_backend, device)
    sampler = sampler or KernelSampler()
    if device.type != "cpu" or attention.name != "cpu" or not (use_graph and compile_works()):
        if not use_graph:
            return lesson16.build_engine(cpu_fast_path(model, small_rows), config, attention_backend, use_graph=False,
                                         pack_weights=False, sampler=sampler, engine_class=engine_class, **parts)
        return lesson16.build_engine(model, config, attention_backend, True, record_now, max_bucket, sampler=sampler,
                                     engine_class=engine_class, **parts)
    model = cpu_fast_path(model, small_rows)
    config = fit_block_size(config, attention)
    pool_class = HugePageKVPool if issubclass(HugePageKVPool, attention.pool_class) else None
    pool = create_kv_pool(model, config, attention, extra_blocks=1, pool_class=pool_class)
    scheduler = create_scheduler(config, pool.num_blocks - 1, *scheduler_parts(parts))
    runner = CpuGraphRunner(model, pool, attention, max_bucket or config.max_num_seqs, pool.num_blocks - 1,
                            direct_calls, compile_mixed, small_rows, one_call)
    if record_now:
        runner.record_seconds = runner.warm_up()
    return engine_class(model, scheduler, pool, attention, runner, sampler, **parts)
