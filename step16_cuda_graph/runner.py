"""The decode runner: one batch-size bucket, static buffers, and a step that is recorded once.

A decode step of B sequences is the same program every time: B token ids in, B rows of
hidden state out, the same kernels in the same order. Only the numbers in a few small tensors
change. So the runner records that program once per bucket and replays it:

    batch of 5 decodes --pad--> bucket 8     static buffers (sized for the largest bucket)
                                             input_ids   [t0 t1 t2 t3 t4 0 0 0]
                                             positions   [p0 p1 p2 p3 p4 0 0 0]
                                             rows        where each token's K/V go; pads -> the
                                                         scratch block, never a live one
                                             cu_seqlens  [0 1 2 3 4 5 6 7 8]
                                             seq_lens    [l0 l1 l2 l3 l4 1 1 1]
                                             block_tables[5 tables ...  scratch rows]
                                 replay the bucket-8 program, read rows 0..4 of its output

    CUDA   the program is a CUDA graph: every kernel launch of the step, recorded with its
           addresses. Replaying costs one launch, so the buffers must stay at the same
           addresses (hence "static"), shapes cannot change (hence buckets), and nothing in it
           may wait for the CPU (no .item(), no checks: they run before, on the host).
    CPU    there is no launch cost to save, but there is per-op dispatch in Python and one pass
           over memory per element-wise op. The program is each layer's body compiled by
           torch.compile (inductor writes C++ for the fused element-wise chains), with static
           shapes per bucket; the attention kernel and packed linears stay our own code,
           called through custom ops (ops.py). All layers share one compiled body, and after
           the first call the runner calls what inductor built directly, without Dynamo's
           checks in front of it (`DirectCall`): the CPU's version of a replay.

Prefill steps, mixed steps and batches above the largest bucket run eagerly, as before.
"""
from __future__ import annotations

import itertools
import time
import types
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from step09_continuous_batching.scheduler import ScheduledBatch
from step14_batched_forward.kv_pool import HeadMajorKVPool
from step15_flash_attention.backends import AttentionBackend
from step15_flash_attention.flash_cpu import check_inputs

# Inductor keeps the C++ it compiled on disk, keyed by the graph: a second start skips the
# compiler. The folder (TORCHINDUCTOR_CACHE_DIR) is set when minivllm_support is imported
# (cpu.set_inductor_cache): it must be set before anything asks inductor for it.


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 (nano-vllm's choice), ending at max_num_seqs."""
    base = [1, 2, 4, 8] + list(range(16, max_num_seqs, 16))
    return [b for b in base if b < max_num_seqs] + [max_num_seqs]


# emulate_precision_casts: round bf16 intermediates where eager PyTorch rounds them, so compiled
# bf16 runs stay close to eager ones (fp32: equal tokens, as the tests check).
# guard_filter_fn: before each call, Dynamo checks that what the compiled code assumed still
# holds ("guards"). Most guards are on the layer modules' Python attributes, which no one
# changes after the engine is built (the weights are inputs, checked as tensors). Dropping
# those roughly halves the check, ~25 us a call, 28 calls a step. Used by the prompt-step
# body (mixed.py); the decode buckets skip Dynamo altogether after their first call.
COMPILE_OPTIONS = {"emulate_precision_casts": True,
                   "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}


def module_tensors(module: nn.Module) -> dict[str, Tensor]:
    """Every tensor a module holds (parameters, buffers, plain attributes such as a packed
    weight), by dotted name."""
    found = {}
    for prefix, m in module.named_modules():
        for key, value in itertools.chain(m._parameters.items(), m._buffers.items(), vars(m).items()):
            if isinstance(value, Tensor):
                found[f"{prefix}.{key}"] = value
    return found


class KeepWhatInductorBuilt:
    """A torch.compile backend: inductor with emulate_precision_casts (as COMPILE_OPTIONS),
    keeping the last callable it built and the inputs it was built on (for `DirectCall`).
    Its own object, not a method of the runner: Dynamo keeps every backend it was given in a
    global table, and a bound method there would keep the runner, and its KV pool, alive."""

    def __init__(self):
        self.built: tuple[Callable, list[Tensor], int] | None = None

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Tensor]) -> Callable:
        from torch._inductor.compile_fx import compile_fx
        fn = compile_fx(gm, example_inputs, config_patches={"emulate_precision_casts": True})
        self.built = (fn, list(example_inputs), len(gm.graph.output_node().args[0]))
        return fn


@dataclass
class DirectCall:
    """A bucket's compiled layer body, called without Dynamo: `fn` is what inductor built for
    layer 0, `inputs[i]` the flat input list for layer i, with None where the step's x, cos and
    sin go (at `slots`)."""
    fn: Callable
    inputs: list[list[Tensor | None]]
    slots: tuple[int, int, int]

    def __call__(self, i: int, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        args = list(self.inputs[i])
        args[self.slots[0]], args[self.slots[1]], args[self.slots[2]] = x, cos, sin
        return self.fn(*args)[0]


@dataclass
class StaticInputs:
    """The decode step's inputs, sized for the largest bucket; a bucket uses the first rows."""
    input_ids: Tensor     # [Bmax]
    positions: Tensor     # [Bmax]
    slot_mapping: Tensor  # [Bmax] token slots (for token-major pools)
    rows: Tensor          # [Bmax * Hkv] (token, head) rows of a head-major pool
    cu_seqlens_q: Tensor  # [Bmax + 1] = 0, 1, 2, ...: one query per sequence
    seq_lens: Tensor      # [Bmax]
    block_tables: Tensor  # [Bmax, max_blocks_per_seq]

    @classmethod
    def allocate(cls, max_batch: int, num_kv_heads: int, max_blocks: int, device) -> "StaticInputs":
        z = lambda *shape: torch.zeros(shape, dtype=torch.long, device=device)
        return cls(z(max_batch), z(max_batch), z(max_batch), z(max_batch * num_kv_heads),
                   torch.arange(max_batch + 1, device=device), z(max_batch), z(max_batch, max_blocks))


class StaticAttention:
    """The attention backend of one layer inside a recorded step: reads only static buffers.

    It ignores the layer index it is called with (it holds its own layer's pool tensors), so
    the compiler sees every layer as the same program and compiles the body once.
    """

    def __init__(self, k_cache: Tensor, v_cache: Tensor, s: StaticInputs, b: int, hkv: int,
                 head_major: bool, kernel=None):
        self.k_cache, self.v_cache, self.kernel, self.head_major = k_cache, v_cache, kernel, head_major
        self.slot_mapping, self.rows = s.slot_mapping[:b], s.rows[:b * hkv]
        self.cu, self.lens, self.tables = s.cu_seqlens_q[:b + 1], s.seq_lens[:b], s.block_tables[:b]

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if self.kernel is None:      # CPU: one custom op, opaque to the compiler (ops.py)
            return torch.ops.minivllm.paged_attention(q, k, v, self.k_cache, self.v_cache, self.rows,
                                                      self.cu, self.lens, self.tables)
        # CUDA: plain kernel launches, recorded into the graph like every other op.
        if self.head_major:
            D = k.shape[-1]
            self.k_cache.view(-1, D).index_copy_(0, self.rows, k.reshape(-1, D))
            self.v_cache.view(-1, D).index_copy_(0, self.rows, v.reshape(-1, D))
        else:                        # token-major pool (flash-attn)
            self.k_cache.view(-1, *k.shape[1:]).index_copy_(0, self.slot_mapping, k)
            self.v_cache.view(-1, *v.shape[1:]).index_copy_(0, self.slot_mapping, v)
        return self.kernel(q, self.k_cache, self.v_cache, self.cu, self.lens, self.tables, check=False)


def _layer_body(layer: nn.Module, x: Tensor, cos: Tensor, sin: Tensor, attention: StaticAttention) -> Tensor:
    return layer(x, cos, sin, attention)


class GraphRunner:
    """Runs decode-only steps of up to max_batch sequences through recorded per-bucket programs."""

    def __init__(self, model, pool, backend: AttentionBackend, max_batch: int, scratch_block: int,
                 direct_calls: bool = True):
        """direct_calls=False: every call of a compiled body goes through Dynamo (for comparison)."""
        self.model, self.pool, self.backend = model, pool, backend
        self.device = next(model.parameters()).device
        self.mode = "cuda-graph" if self.device.type == "cuda" else "compile"
        cfg = model.config
        self.buckets = batch_buckets(max_batch)
        self.scratch_block = scratch_block
        self.head_major = isinstance(pool, HeadMajorKVPool)
        max_blocks = -(-cfg.max_position_embeddings // pool.block_size)
        self.static = StaticInputs.allocate(self.buckets[-1], cfg.num_kv_heads, max_blocks, self.device)
        kernel = backend.kernel if self.mode == "cuda-graph" else None
        self.layer_attention = {b: [StaticAttention(pool.k[i], pool.v[i], self.static, b, cfg.num_kv_heads,
                                                    self.head_major, kernel)
                                    for i in range(cfg.num_layers)] for b in self.buckets}
        self.layer_body = _layer_body
        self.direct: dict[int, DirectCall] = {}     # bucket -> its compiled body, called without Dynamo
        self.direct_calls = direct_calls
        self.backend = KeepWhatInductorBuilt()
        if self.mode == "compile":
            # Dynamo keeps what it compiled on the function's code object; a copy of the code for
            # this runner alone keeps engines built one after another from piling up their buckets
            # on one (and from reaching its recompile limit, past which it runs the body eagerly).
            body = types.FunctionType(_layer_body.__code__.replace(), _layer_body.__globals__, "layer_body")
            self.layer_body = torch.compile(body, dynamic=False, fullgraph=True, backend=self.backend,
                                            recompile_limit=64)    # one compiled body per bucket
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self.graph_pool = None
        self.ready: set[int] = set()
        self.replays: Counter[int] = Counter()   # steps run per bucket

    # ---- which steps ------------------------------------------------------------------------
    def bucket_for(self, batch: ScheduledBatch) -> int | None:
        """The bucket of a decode-only step, or None if it runs eagerly."""
        B = len(batch.seqs)
        if B == 0 or B > self.buckets[-1] or any(n != 1 for n in batch.num_tokens):
            return None
        return next(b for b in self.buckets if b >= B)

    # ---- filling the static buffers ----------------------------------------------------------
    def prepare(self, batch: ScheduledBatch, b: int) -> None:
        s, bs, B = self.static, self.pool.block_size, len(batch.seqs)
        pos = [seq.num_computed_tokens for seq in batch.seqs]
        if max(pos) >= self.model.config.max_position_embeddings:
            raise ValueError(f"position {max(pos)} exceeds max_position_embeddings")
        slots = [seq.kv[p // bs] * bs + p % bs for seq, p in zip(batch.seqs, pos)]
        pad = b - B                                   # pads: token 0 at position 0 of the scratch block
        host = lambda xs: torch.tensor(xs, dtype=torch.long)
        s.input_ids[:b].copy_(host([seq.token_ids[p] for seq, p in zip(batch.seqs, pos)] + [0] * pad))
        s.positions[:b].copy_(host(pos + [0] * pad))
        s.seq_lens[:b].copy_(host([p + 1 for p in pos] + [1] * pad))
        slot_mapping = host(slots + [self.scratch_block * bs] * pad)
        s.slot_mapping[:b].copy_(slot_mapping)
        if self.head_major:
            s.rows[:b * self.pool.num_kv_heads].copy_(self.pool.head_rows(slot_mapping))
        # One copy for the whole table (one per row cost ~10 us each); columns past a sequence's
        # length are never read, so short rows are padded with block 0.
        tables = [seq.kv[:-(-(p + 1) // bs)] for seq, p in zip(batch.seqs, pos)]
        width = max(map(len, tables))
        s.block_tables[:B, :width].copy_(host([t + [0] * (width - len(t)) for t in tables]))
        s.block_tables[B:b, 0] = self.scratch_block
        if self.head_major:   # the checks lesson 15's kernel makes, once a step, before any replay
            cfg = self.model.config
            q = torch.empty(b, cfg.num_heads, cfg.head_dim, dtype=self.pool.k[0].dtype, device=self.device)
            check_inputs(q, self.pool.k[0], self.pool.v[0], s.cu_seqlens_q[:b + 1], s.seq_lens[:b],
                         s.block_tables[:b], {q.dtype})

    # ---- the recorded step -----------------------------------------------------------------
    def step_inputs(self, b: int) -> tuple[Tensor, Tensor, Tensor]:
        """What every layer body gets besides its own weights and pool: x [b, hidden], cos, sin."""
        m, s = self.model, self.static
        pos = s.positions[:b]           # in range: checked in prepare (no host sync in here)
        return m.model.embed_tokens(s.input_ids[:b]), m.rotary.cos[pos][:, None, :], m.rotary.sin[pos][:, None, :]

    def forward(self, b: int) -> Tensor:
        """The decode step of bucket b on the static buffers: [b] ids -> [b, hidden]."""
        x, cos, sin = self.step_inputs(b)
        direct = self.direct.get(b)
        for i, (layer, attention) in enumerate(zip(self.model.model.layers, self.layer_attention[b])):
            x = direct(i, x, cos, sin) if direct else self.layer_body(layer, x, cos, sin, attention)
        return self.model.model.norm(x)

    def _direct_call(self, b: int, built: tuple[Callable, list[Tensor], int],
                     step_inputs: tuple[Tensor, Tensor, Tensor]) -> DirectCall | None:
        """Dynamo turned layer 0's body into a graph whose inputs are tensors: x, cos, sin, the
        layer's weights, the attention's pool and step buffers. Find each by identity among
        layer 0's tensors, then take the same ones from every other layer. None (Dynamo keeps
        the calls) if an input is not found or the body returns more than x."""
        fn, inputs, num_outputs = built
        layers, attention = self.model.model.layers, self.layer_attention[b]
        where = {id(t): ("layer", name) for name, t in module_tensors(layers[0]).items()}
        where.update({id(t): ("attention", k) for k, t in vars(attention[0]).items() if isinstance(t, Tensor)})
        where.update({id(t): ("step", k) for k, t in enumerate(step_inputs)})
        paths = [where.get(id(t)) for t in inputs]
        slots = tuple(i for k in range(3) for i, p in enumerate(paths) if p == ("step", k))
        if num_outputs != 1 or None in paths or len(slots) != 3:
            return None
        per_layer = []
        for layer, att in zip(layers, attention):
            own = {"layer": module_tensors(layer), "attention": vars(att)}
            per_layer.append([None if where == "step" else own[where][key] for where, key in paths])
        return DirectCall(fn, per_layer, slots)

    @torch.inference_mode()
    def record(self, b: int) -> None:
        """Compile (CPU) or capture (CUDA) bucket b, on a step of pads only."""
        s = self.static
        s.seq_lens[:b] = 1                        # a harmless step: every row a pad
        s.block_tables[:b, 0] = self.scratch_block
        s.slot_mapping[:b] = self.scratch_block * self.pool.block_size
        if self.head_major:
            s.rows[:b * self.pool.num_kv_heads].copy_(self.pool.head_rows(s.slot_mapping[:b]))
        if self.mode == "cuda-graph":
            self.forward(b)                       # warm-up: lazy inits and autotuning happen outside
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.graph_pool):   # one memory pool for all buckets
                out = self.forward(b)
            self.graph_pool = graph.pool()
            self.graphs[b] = (graph, out)
        else:
            # The first call compiles, through Dynamo (which also checks, before every later call,
            # that nothing it assumed changed: ~100 us a layer with the wrappers around it). A
            # bucket's shapes never change, so the runner calls what inductor built directly,
            # as a CUDA graph is replayed without looking at the code that made it.
            x, cos, sin = self.step_inputs(b)
            self.backend.built = None
            self.layer_body(self.model.model.layers[0], x, cos, sin, self.layer_attention[b][0])
            built, self.backend.built = self.backend.built, None   # the backend outlives the runner
            if built is not None and self.direct_calls:
                direct = self._direct_call(b, built, (x, cos, sin))
                if direct is not None:
                    self.direct[b] = direct
            self.forward(b)
        self.ready.add(b)

    def record_all(self) -> float:
        """Record every bucket, largest first (its memory pool then fits the smaller ones); seconds."""
        t0 = time.perf_counter()
        for b in sorted(self.buckets, reverse=True):
            if b not in self.ready:
                self.record(b)
        return time.perf_counter() - t0

    def run(self, batch: ScheduledBatch, b: int) -> Tensor:
        """Hidden states [B, hidden] of a decode-only batch that fits bucket b."""
        with torch.inference_mode():              # the mode it was recorded in (a guard of the compiled code)
            if b not in self.ready:
                self.record(b)
            self.prepare(batch, b)
            self.replays[b] += 1
            B = len(batch.seqs)
            if self.mode == "cuda-graph":
                graph, out = self.graphs[b]
                graph.replay()
                return out[:B]
            return self.forward(b)[:B]


def compile_works() -> bool:
    """Whether torch.compile can build C++ here (a compiler on PATH); else the runner is not used."""
    try:
        fn = torch.compile(lambda x: torch.nn.functional.silu(x) * 2, dynamic=False)
        return bool(torch.allclose(fn(torch.ones(4)), torch.nn.functional.silu(torch.ones(4)) * 2))
    except Exception as e:  # noqa: BLE001 - any failure means: run eagerly
        warnings.warn(f"torch.compile does not work here, decode steps run eagerly: {e}")
        return False
