"""Lesson 15's engine with a graph runner for decode steps and a packed LM head.

What changes against lesson 15:
  - decode-only steps of up to max_num_seqs sequences go through GraphRunner (runner.py):
    padded to a bucket, run by a CUDA graph (GPU) or by the compiled layer body (CPU);
  - one KV block is taken from the block manager for good: the scratch block padded rows
    write to, so no padding ever touches a live sequence's K/V;
  - on a CPU, steps with prompt tokens go through one more compiled layer body whose token
    count is dynamic (mixed.py): the element-wise work around the matmuls fused;
  - where lesson 14 packed the linears (bf16, CPU), q/k/v and gate/up become one packed
    matmul each (fused.py): 4 oneDNN calls a layer instead of 7, the same numbers;
  - the tied LM head gets its own oneDNN-packed copy of the embedding matrix (bf16), like
    the other linears since lesson 14: one more copy of vocab x hidden weights in memory,
    one read of them per step instead of a reorder and a read;
  - the step's logits are written into a float32 buffer kept from step to step: a fresh
    64 x 151,936 float32 tensor is 39 MB, above glibc's largest mmap threshold (32 MiB), so
    each step got new pages from the kernel, zeroed, one page fault each;
  - the sampler's greedy pick is one C pass over those logits (`ops.row_argmax`).
`use_graph=False` is lesson 15's engine, with the packed head; `compile_mixed=False` keeps
the buckets and runs prompt steps eagerly; `direct_calls=False` sends every call of a
bucket's compiled body through Dynamo (runner.py).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from step05_naive.generate import check_prompt
from step06_sampler.params import SamplingParams
from step06_sampler.sampler import Sampler
from step09_continuous_batching.scheduler import ScheduledBatch
from step14_batched_forward.packed_linear import PackedLinear, can_pack
from step15_flash_attention.engine import FlashEngine
from step16_cuda_graph.fused import fuse_projections
from step16_cuda_graph.mixed import MixedStepRunner
from step16_cuda_graph.ops import route_packed_linears, row_argmax
from step16_cuda_graph.runner import GraphRunner, compile_works


class KernelSampler(Sampler):
    """Lesson 06's sampler with the greedy pick as one C pass over the float32 logits."""
    argmax = staticmethod(row_argmax)


def packed_lm_head(model) -> PackedLinear | None:
    """A packed copy of the (tied or own) LM head weight, or None where packing does not apply
    (an own head that lesson 14's pack_linears packed already, or lesson 18's parallel head)."""
    if model.lm_head is not None and type(model.lm_head) is not nn.Linear:
        return None
    weight = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    if not can_pack(weight.dtype) or weight.device.type != "cpu":
        return None
    head = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    head.weight = weight                 # shared, not copied: only the packed layout is new
    return PackedLinear(head)


class GraphEngine(FlashEngine):
    def __init__(self, model, scheduler=None, *args, use_graph: bool = True, record_now: bool = True,
                 max_bucket: int | None = None, compile_mixed: bool = True, direct_calls: bool = True, **kwargs):
        """max_bucket: the largest batch recorded (default max_num_seqs; vLLM's max_cudagraph_capture_size)."""
        super().__init__(model, scheduler, *args, **kwargs)
        self.lm_head = packed_lm_head(model)
        if type(self.sampler) is Sampler:
            self.sampler = KernelSampler()
        self._logits: Tensor | None = None       # float32 [rows, vocab], reused by every step
        self.runner: GraphRunner | None = None
        self.mixed: MixedStepRunner | None = None
        self.record_seconds = 0.0
        self.num_fused = 0
        on_cuda = self.kv_pool.k[0].device.type == "cuda"
        if use_graph and (on_cuda or (self.attention.name == "cpu" and compile_works())):
            self.num_fused = fuse_projections(model, kernels=True)   # q|k|v and gate|up: one matmul each (fused.py)
            route_packed_linears(model)           # packed linears through the custom op
            # Never handed to a sequence: padded rows of a bucket write their K/V here.
            scratch = self.scheduler.block_manager._take_free_block()
            self.runner = GraphRunner(model, self.kv_pool, self.attention,
                                      max_bucket or self.scheduler.config.max_num_seqs, scratch, direct_calls)
            if record_now:
                self.record_seconds = self.runner.record_all()
            if compile_mixed and self.runner.mode == "compile":
                self.mixed = MixedStepRunner(model, self.kv_pool)
                if record_now:
                    self.record_seconds += self.mixed.warm_up(scratch)

    def add_request(self, prompt_ids, params: SamplingParams | None = None):
        """Lesson 09's checks, plus one the scheduler cannot make: the scratch block is the
        runner's, so a request must fit in the pool without it (else it would preempt itself
        forever)."""
        if self.runner is not None:
            sp, cfg = params or SamplingParams(), self.model.config
            check_prompt(prompt_ids, cfg.vocab_size, cfg.max_position_embeddings, sp.max_tokens)
            bm = self.scheduler.block_manager
            need = bm.blocks_for(len(prompt_ids) + sp.max_tokens - 1)
            if need > bm.num_blocks - 1:
                raise ValueError(f"request needs up to {need} KV blocks (prompt {len(prompt_ids)} + max_tokens "
                                 f"{sp.max_tokens} - 1 tokens) but the pool has {bm.num_blocks - 1} for requests "
                                 f"(of {bm.num_blocks}, one is the graph runner's scratch block): it could never finish")
        return super().add_request(prompt_ids, params)

    def run_model(self, batch: ScheduledBatch, input_ids: Tensor, positions: Tensor) -> Tensor:
        bucket = self.runner.bucket_for(batch) if self.runner else None
        if bucket is None:
            if self.mixed is not None:
                return self.mixed.forward(input_ids, positions, self.make_attention(batch))
            return super().run_model(batch, input_ids, positions)
        return self.runner.run(batch, bucket)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        if self.lm_head is None:
            return super().compute_logits(hidden)
        logits = self.lm_head(hidden)
        n, vocab = logits.shape
        if self._logits is None or self._logits.shape[0] < n:
            self._logits = torch.empty(max(n, self.scheduler.config.max_num_seqs), vocab)
        # A view into the buffer: valid until the next compute_logits (callers use it in the step).
        return self._logits[:n].copy_(logits)
