"""Prompt and mixed steps through one compiled layer body whose token count is dynamic.

The bucket runner (runner.py) records decode-only steps: B tokens, one per sequence, a shape
known in advance. A step with a prompt chunk has any number of tokens (up to the step budget),
so it cannot be recorded per shape. On a CPU it does not need to be: what the compiler buys
here is fusion, not launch savings, and one compiled body with a *symbolic* token count T
serves every such step:

    eager, per layer (T = 512)                       compiled, per layer
    RMSNorm: to fp32, pow, mean, rsqrt, mul, mul,    one loop: read x once, write the
             to bf16          ~7 passes over T x H     normalised bf16 rows
    RoPE:    neg, cat, mul, mul, add on q and k       one loop over q, one over k
    SwiGLU:  silu, mul          2 passes over T x I   one loop
    residual adds               2 passes              fused into the next norm's loop

On this CPU a prompt step spent more of its time in those element-wise passes than in the
matmuls (the profile is in the README). The linears and the attention kernel stay our own
code, called through this lesson's library ops (ops.py), exactly as in the decode buckets.

The compiler sees T as a symbol: a first call compiles the body for its token count, the
first call with another count recompiles it once with T symbolic ("automatic dynamic"), and
every later step reuses that code. `warm_up` makes those two calls before serving (fake
steps that write only into the scratch block), so no request waits for the compiler. Steps of one token per sequence go to a
bucket they fill (or one of up to 4 rows); other decode steps, and steps past the largest
bucket, come here too, at their own size rather than padded.
"""
from __future__ import annotations

import itertools
import time
import types
from types import SimpleNamespace

import torch
from torch import Tensor, nn

from step15_flash_attention.attention import FlashPagedAttention
from step15_flash_attention.flash_cpu import check_inputs


# emulate_precision_casts: round bf16 intermediates where eager PyTorch rounds them, so compiled
# bf16 runs stay close to eager ones (fp32: equal tokens, as the tests check).
# guard_filter_fn: before each call, Dynamo checks that what the compiled code assumed still
# holds ("guards"). Most guards are on the layer modules' Python attributes, which no one
# changes after the engine is built (the weights are inputs, checked as tensors). Dropping
# those roughly halves the check, ~25 us a call, 28 calls a step. Used by the prompt-step
# body (mixed.py); the decode buckets skip Dynamo altogether after their first call.
COMPILE_OPTIONS = {"emulate_precision_casts": True,
                   "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}


class StepAttention:
    """One layer's attention inside a compiled mixed step: this step's metadata, this layer's pool."""

    def __init__(self, k_cache: Tensor, v_cache: Tensor, meta: FlashPagedAttention):
        self.k_cache, self.v_cache = k_cache, v_cache
        self.rows, self.cu, self.lens, self.tables = meta.rows, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return torch.ops.minivllm.paged_attention(q, k, v, self.k_cache, self.v_cache, self.rows,
                                                  self.cu, self.lens, self.tables)


def _mixed_layer_body(layer: nn.Module, x: Tensor, cos: Tensor, sin: Tensor, attention: StepAttention) -> Tensor:
    # Its own function (not runner.py's): dynamo keeps compiled code per function, and the
    # buckets' static programs should not count against this one's recompile limit.
    return layer(x, cos, sin, attention)


class MixedStepRunner:
    """Runs steps with prompt tokens through the compiled body (head-major pool, CPU kernel)."""

    def __init__(self, model, pool):
        self.model, self.pool = model, pool
        # A copy of the body's code per runner, as runner.py does for the buckets: Dynamo keeps
        # compiled code per code object, and its guards skip nn modules (COMPILE_OPTIONS), so
        # another engine's entry (say, an unfused model) would be checked against this model's
        # layers and fail on a missing submodule instead of missing the cache.
        body = types.FunctionType(_mixed_layer_body.__code__.replace(), _mixed_layer_body.__globals__, "mixed_layer_body")
        self.body = torch.compile(body, dynamic=None, fullgraph=True,
                                  options=COMPILE_OPTIONS, recompile_limit=16)
        self.steps = 0

    def warm_up(self, scratch_block: int) -> float:
        """Compile before serving, as the buckets are recorded: two fake steps whose tokens all
        write into the scratch block, of two shapes, so that the second compiles the body with
        the token count (and batch size, table width) symbolic. Returns the seconds it took."""
        t0 = time.perf_counter()
        bs = self.pool.block_size
        for lens in ((3, 4), (2, 5, 6)):          # 2 then 3 sequences: 7 then 13 tokens
            nb = len(lens)                         # tables nb blocks wide (all the scratch block)
            T = sum(lens)
            offsets = torch.cat([torch.arange(n) for n in lens])
            meta = SimpleNamespace(rows=self.pool.head_rows(scratch_block * bs + offsets % bs),
                                   cu_seqlens_q=torch.tensor([0, *itertools.accumulate(lens)]),
                                   seq_lens=torch.tensor(lens), block_tables=torch.full((nb, nb), scratch_block))
            self.forward(torch.zeros(T, dtype=torch.long), offsets, meta)
        self.steps = 0
        return time.perf_counter() - t0

    def forward(self, input_ids: Tensor, positions: Tensor, meta: FlashPagedAttention) -> Tensor:
        """[T] ids -> [T, hidden], K/V written into the pool, as lesson 15's forward does."""
        m, pool = self.model, self.pool
        q_shape = (input_ids.shape[0], m.config.num_heads, m.config.head_dim)
        # The kernel's checks, once a step (inside the compiled body they would run every layer).
        check_inputs(torch.empty(q_shape, dtype=pool.k[0].dtype), pool.k[0], pool.v[0], meta.cu_seqlens_q,
                     meta.seq_lens, meta.block_tables, {pool.k[0].dtype})
        with torch.inference_mode():
            cos, sin = m.rotary(positions)              # checks the positions (eager, once)
            x = m.model.embed_tokens(input_ids)
            for i, layer in enumerate(m.model.layers):
                x = self.body(layer, x, cos, sin, StepAttention(pool.k[i], pool.v[i], meta))
            self.steps += 1
            return m.model.norm(x)
