"""Lesson 15's engine with lesson 16's runner: the same Engine, one part swapped.

What changes against lesson 15 (`step15_flash_attention.engine.build_engine`):
  - the runner is a GraphRunner (runner.py): decode-only steps padded to a bucket and replayed;
  - the pool has one block more than the block manager hands out: the scratch block, where
    padded rows write their K/V, so no pad ever touches a live sequence's K/V;
  - on a CPU the linears stay unpacked when the step is compiled: inductor cannot take
    oneDNN's packed weights as graph inputs. Lesson 16's fast path routes them through a custom op.
"""
from __future__ import annotations

from torch import nn

from step06_sampler.sampler import Sampler
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step14_batched_forward.packed_linear import pack_linears
from step15_flash_attention.backends import choose_backend
from step15_flash_attention.engine import (Engine, ModelRunner, create_kv_pool, create_scheduler, fit_block_size,
                                          scheduler_parts)
from step16_cuda_graph.runner import GraphRunner, compile_works


def build_engine(model: nn.Module, config: PagedSchedulerConfig | None = None, attention_backend: str = "auto",
                 use_graph: bool = True, record_now: bool = True, max_bucket: int | None = None,
                 pack_weights: bool = True, sampler: Sampler | None = None, engine_class: type[Engine] = Engine,
                 **parts) -> Engine:
    """use_graph=False: lesson 15's engine. max_bucket: the largest batch recorded (default
    max_num_seqs; vLLM's max_cudagraph_capture_size). record_now=False: buckets are recorded
    when first used. engine_class, parts: as lesson 15's build_engine."""
    config = config or PagedSchedulerConfig()
    device = model.model.embed_tokens.weight.device
    attention = choose_backend(attention_backend, device)
    config = fit_block_size(config, attention)
    compiled_on_cpu = use_graph and device.type == "cpu" and attention.name == "cpu" and compile_works()
    if pack_weights and not compiled_on_cpu:
        model = pack_linears(model)
    pool = create_kv_pool(model, config, attention, extra_blocks=1 if use_graph else 0)
    scheduler = create_scheduler(config, pool.num_blocks - (1 if use_graph else 0), *scheduler_parts(parts))
    runner = ModelRunner(model)
    if use_graph:
        scratch = pool.num_blocks - 1                     # never handed to a sequence
        runner = GraphRunner(model, pool, attention, max_bucket or config.max_num_seqs, scratch)
        if record_now:
            runner.record_seconds = runner.record_all()
    return engine_class(model, scheduler, pool, attention, runner, sampler, **parts)
