"""Record the decode step once per batch-size bucket, replay it every step.

A decode step of B sequences is the same program every time: B token ids in, B rows of hidden
state out, the same kernels in the same order. Only the numbers in a few small tensors change.
So the runner records that program once per bucket and replays it:

    batch of 5 decodes --pad--> bucket 8     static buffers (sized for the largest bucket)
                                             input_ids   [t0 t1 t2 t3 t4 0 0 0]
                                             positions   [p0 p1 p2 p3 p4 0 0 0]
                                             slot_mapping where each token's K/V go; pads go
                                                         to the scratch block, never a live one
                                             cu_seqlens  [0 1 2 3 4 5 6 7 8]
                                             seq_lens    [l0 l1 l2 l3 l4 1 1 1]
                                             block_tables[5 tables ...  scratch rows]
                                 replay the bucket-8 program, read rows 0..4 of its output

    CUDA   the program is a CUDA graph: every kernel launch of the step, recorded with its
           addresses. A replay is one launch, so the buffers must stay where they are ("static"),
           shapes cannot change (hence buckets), and nothing inside may wait for the CPU (no
           .item(), no checks: `prepare` runs them on the host, before the replay).
    CPU    no launch cost to save; what costs is Python running op by op and one pass over
           memory per element-wise op. The program is the layer body compiled by torch.compile
           with this bucket's static shapes (inductor fuses the element-wise chains into C++
           loops); attention, a ctypes kernel the compiler cannot trace, is a custom op.

Steps with prompt tokens, and batches above the largest bucket, run eagerly (ModelRunner).
"""
from __future__ import annotations

import time
import types
import warnings

import torch
from torch import Tensor

from step09_continuous_batching.scheduler import ScheduledBatch
from step14_batched_forward.kv_pool import HeadMajorKVPool
from step15_flash_attention.backends import AttentionBackend
from step15_flash_attention.engine import ModelRunner
from step15_flash_attention.flash_cpu import flash_attention_cpu


def batch_buckets(max_num_seqs: int, step: int = 16) -> list[int]:
    """1, 2, 4, 8, then every `step` from 16 (16: nano-vllm's choice; 8: vLLM's capture sizes),
    ending at max_num_seqs."""
    if step not in (8, 16):
        raise ValueError(f"bucket step must be 8 or 16, got {step}")
    base = [1, 2, 4, 8] + list(range(16, max_num_seqs, step))
    return [b for b in base if b < max_num_seqs] + [max_num_seqs]


@torch.library.custom_op("lesson16::paged_attention", mutates_args=("k_cache", "v_cache"))
def paged_attention(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, rows: Tensor,
                    cu_seqlens_q: Tensor, seq_lens: Tensor, block_tables: Tensor) -> Tensor:
    """Write this step's K/V into a head-major pool, then lesson 15's CPU kernel. One opaque node
    for the compiler; `mutates_args` tells it the pool is written in place."""
    D = k.shape[-1]
    k_cache.view(-1, D).index_copy_(0, rows, k.reshape(-1, D))
    v_cache.view(-1, D).index_copy_(0, rows, v.reshape(-1, D))
    return flash_attention_cpu(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, check=False)


@paged_attention.register_fake
def _(q, *args):
    return torch.empty_like(q)           # what the compiler needs to know: the output's shape


class StaticInputs:
    """The decode step's inputs, sized for the largest bucket; bucket b uses the first b rows."""

    def __init__(self, max_batch: int, num_kv_heads: int, max_blocks: int, device):
        z = lambda *shape: torch.zeros(shape, dtype=torch.long, device=device)
        self.input_ids, self.positions, self.slot_mapping, self.seq_lens = (z(max_batch) for _ in range(4))
        self.rows = z(max_batch * num_kv_heads)        # (token, head) rows of a head-major pool
        self.cu_seqlens_q = torch.arange(max_batch + 1, device=device)    # one query per sequence
        self.block_tables = z(max_batch, max_blocks)


class StaticAttention:
    """One layer's step attention inside a recorded step: it reads only static buffers."""

    def __init__(self, runner: "GraphRunner", layer: int, b: int):
        s, pool, hkv = runner.static, runner.pool, runner.pool.num_kv_heads
        self.k_cache, self.v_cache, self.kernel, self.pool = pool.k[layer], pool.v[layer], runner.kernel, pool
        self.layer, self.compiled = layer, runner.mode == "compile"
        self.slot_mapping, self.rows = s.slot_mapping[:b], s.rows[:b * hkv]
        self.cu, self.lens, self.tables = s.cu_seqlens_q[:b + 1], s.seq_lens[:b], s.block_tables[:b]

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if self.compiled:
            return paged_attention(q, k, v, self.k_cache, self.v_cache, self.rows, self.cu, self.lens, self.tables)
        if isinstance(self.pool, HeadMajorKVPool):
            self.pool.write(self.layer, self.slot_mapping, k, v, self.rows)
        else:
            self.pool.write(self.layer, self.slot_mapping, k, v)
        return self.kernel(q, self.k_cache, self.v_cache, self.cu, self.lens, self.tables, check=False)


def _layer_body(layer, x: Tensor, cos: Tensor, sin: Tensor, attn: StaticAttention) -> Tensor:
    return layer(x, cos, sin, attn)


class GraphRunner(ModelRunner):
    """Lesson 15's runner, with decode-only steps of up to max_batch sequences replayed."""

    bucket_step = 16       # buckets 1, 2, 4, 8, 16, 32, 48, ... (batch_buckets)

    def __init__(self, model, pool, attention: AttentionBackend, max_batch: int, scratch_block: int):
        super().__init__(model)
        self.pool, self.kernel, self.scratch_block = pool, attention.kernel, scratch_block
        self.device = next(model.parameters()).device
        cfg = model.config
        self.mode = ("cuda-graph" if self.device.type == "cuda" else
                     "compile" if attention.name == "cpu" and compile_works() else "eager")
        self.buckets = batch_buckets(max_batch, self.bucket_step)
        self.static = StaticInputs(self.buckets[-1], pool.num_kv_heads, -(-cfg.max_position_embeddings // pool.block_size),
                                   self.device)
        self.layer_attention = {b: [StaticAttention(self, i, b) for i in range(cfg.num_layers)] for b in self.buckets}
        self.layer_body = _layer_body
        if self.mode == "compile":
            # All layers share one compiled body (their weights are its inputs), one per bucket.
            # Dynamo keeps compiled code on the function's code object: a copy of it per runner
            # keeps engines built one after another from sharing (and filling) one cache.
            body = types.FunctionType(_layer_body.__code__.replace(), _layer_body.__globals__, "layer_body")
            self.layer_body = torch.compile(body, dynamic=False, fullgraph=True)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self.graph_memory = None
        self.ready: set[int] = set()
        self.replays = {b: 0 for b in self.buckets}       # steps run per bucket

    def forward(self, batch: ScheduledBatch, input_ids: Tensor, positions: Tensor, attn) -> Tensor:
        b = self.bucket_for(batch)
        if b is None:
            return super().forward(batch, input_ids, positions, attn)
        with torch.inference_mode():                 # the mode it was recorded in
            if b not in self.ready:
                self.record(b)
            self.prepare(batch, b)
            self.replays[b] += 1
            if self.mode == "cuda-graph":
                graph, out = self.graphs[b]
                graph.replay()
                return out[:len(batch.seqs)]
            return self.decode(b)[:len(batch.seqs)]

    def replays_step(self, batch: ScheduledBatch) -> bool:
        """A decode step of a bucket: prepare() fills the static buffers, no step attention needed."""
        return self.bucket_for(batch) is not None

    def bucket_for(self, batch: ScheduledBatch) -> int | None:
        """The bucket of a decode-only step, or None: it runs eagerly."""
        B = len(batch.seqs)
        if B == 0 or B > self.buckets[-1] or any(n != 1 for n in batch.num_tokens):
            return None
        return next(b for b in self.buckets if b >= B)

    def prepare(self, batch: ScheduledBatch, b: int) -> None:
        """Fill the static buffers for this step (and check them: the recorded step cannot)."""
        s, bs, pad = self.static, self.pool.block_size, b - len(batch.seqs)
        pos = [seq.num_computed_tokens for seq in batch.seqs]
        if max(pos) >= self.model.config.max_position_embeddings:
            raise ValueError(f"position {max(pos)} exceeds max_position_embeddings")
        host = lambda xs: torch.tensor(xs, dtype=torch.long)
        s.input_ids[:b].copy_(host([seq.token_ids[p] for seq, p in zip(batch.seqs, pos)] + [0] * pad))
        s.positions[:b].copy_(host(pos + [0] * pad))
        s.seq_lens[:b].copy_(host([p + 1 for p in pos] + [1] * pad))
        slots = [seq.block_table[p // bs] * bs + p % bs for seq, p in zip(batch.seqs, pos)]
        self.set_slots(host(slots + [self.scratch_block * bs] * pad), b)
        tables = [seq.block_table[:p // bs + 1] for seq, p in zip(batch.seqs, pos)]
        # What the kernel trusts and the recorded step cannot check: every block it reads is in
        # the pool (the rest of the metadata is built right here, one query per sequence).
        num_blocks = self.pool.k[0].shape[0]
        if any(not 0 <= block < num_blocks for t in tables for block in t):
            raise ValueError(f"a block table names a block outside the pool's {num_blocks}")
        width = max(map(len, tables))            # columns past a sequence's length are never read
        s.block_tables[:len(tables), :width].copy_(host([t + [0] * (width - len(t)) for t in tables]))
        s.block_tables[len(tables):b, 0] = self.scratch_block

    def set_slots(self, slot_mapping: Tensor, b: int) -> None:
        self.static.slot_mapping[:b].copy_(slot_mapping)
        if isinstance(self.pool, HeadMajorKVPool):
            self.static.rows[:b * self.pool.num_kv_heads].copy_(self.pool.head_rows(slot_mapping.to(self.device)))

    def step_inputs(self, b: int) -> tuple[Tensor, Tensor, Tensor]:
        """What every layer gets besides its weights and pool: x [b, hidden], cos, sin."""
        m, s = self.model, self.static
        pos = s.positions[:b]                    # in range: checked in prepare (no host sync in here)
        return m.model.embed_tokens(s.input_ids[:b]), m.rotary.cos[pos][:, None, :], m.rotary.sin[pos][:, None, :]

    def decode(self, b: int) -> Tensor:
        """The decode step of bucket b on the static buffers: [b] ids -> [b, hidden]."""
        x, cos, sin = self.step_inputs(b)
        for layer, attn in zip(self.model.model.layers, self.layer_attention[b]):
            x = self.layer_body(layer, x, cos, sin, attn)
        return self.model.model.norm(x)

    def pad_step(self, b: int) -> None:
        """Static buffers of a harmless step: every row a pad, writing into the scratch block."""
        self.static.seq_lens[:b] = 1
        self.static.block_tables[:b, 0] = self.scratch_block
        self.set_slots(torch.full((b,), self.scratch_block * self.pool.block_size), b)

    @torch.inference_mode()
    def record(self, b: int) -> None:
        """Compile (CPU) or capture (CUDA) bucket b, on a step whose rows are all pads."""
        self.pad_step(b)
        self.decode(b)                           # compiles (CPU); lazy inits, autotuning (CUDA)
        if self.mode == "cuda-graph":
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.graph_memory):    # one memory region (torch: "pool") for all buckets
                out = self.decode(b)
            self.graph_memory = graph.pool()
            self.graphs[b] = (graph, out)
        self.ready.add(b)

    def record_all(self) -> float:
        """Record every bucket, largest first (its memory pool then fits the smaller ones); seconds."""
        t0 = time.perf_counter()
        for b in sorted(self.buckets, reverse=True):
            if b not in self.ready:
                self.record(b)
        return time.perf_counter() - t0


def compile_works() -> bool:
    """Whether torch.compile can build C++ here (a compiler on PATH); else CPU steps run eagerly."""
    try:
        fn = torch.compile(lambda x: torch.nn.functional.silu(x) * 2, dynamic=False)
        return bool(torch.allclose(fn(torch.ones(4)), torch.nn.functional.silu(torch.ones(4)) * 2))
    except Exception as e:  # noqa: BLE001 - any failure means: run eagerly
        warnings.warn(f"torch.compile does not work here, decode steps run eagerly: {e}")
        return False
