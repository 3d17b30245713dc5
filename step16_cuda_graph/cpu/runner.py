"""Lesson 16's runner with the CPU fast path: every decode step and every prompt step compiled,
our kernels as library ops, the compiled code called without Dynamo, a packed LM head.

What changes against lesson 16's GraphRunner (CPU):
  - attention and the packed linears are ops of our own library (ops.py), registered below
    torch.library's `custom_op` wrapper: one opaque node each for the compiler, and a packed
    model compiles (lesson 16 had to leave its linears unpacked);
  - after the first call of a bucket, the runner calls what inductor built directly
    (`DirectCall`), without Dynamo's checks in front of it: ~100 us a layer of guards and
    wrappers, 30 layers a step. The CPU's version of a CUDA graph replay;
  - steps with prompt tokens run through one more compiled body with a dynamic token count
    (mixed.py): the element-wise chains fused there too;
  - the tied LM head gets its own oneDNN-packed copy of the embedding matrix, and the logits
    go into a float32 buffer kept from step to step (a fresh 64 x 151,936 buffer is 39 MB,
    above glibc's mmap threshold: new zeroed pages every step).
"""
from __future__ import annotations

import itertools
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from step09_continuous_batching.scheduler import ScheduledBatch
from step14_batched_forward.packed_linear import PackedLinear, can_pack
from step15_flash_attention.backends import AttentionBackend
from step16_cuda_graph.runner import GraphRunner
from step16_cuda_graph.cpu import decode_step
from step16_cuda_graph.cpu.mixed import MixedStepRunner
from step16_cuda_graph.cpu.ops import gemm_f32, gemm_f32_rows, gemv, gemv_rows, on_huge_pages, pack_f32


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


class OpAttention:
    """One layer's step attention inside a compiled decode step: our library's op, which writes
    the step's K/V into this layer's pool and runs lesson 15's kernel (ops.py)."""

    def __init__(self, runner: GraphRunner, layer: int, b: int):
        s, hkv = runner.static, runner.pool.num_kv_heads
        self.k_cache, self.v_cache = runner.pool.k[layer], runner.pool.v[layer]
        self.rows, self.cu, self.lens, self.tables = s.rows[:b * hkv], s.cu_seqlens_q[:b + 1], s.seq_lens[:b], s.block_tables[:b]

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return torch.ops.minivllm.paged_attention(q, k, v, self.k_cache, self.v_cache, self.rows,
                                                  self.cu, self.lens, self.tables)


def _layer_body(layer: nn.Module, x: Tensor, cos: Tensor, sin: Tensor, attn: OpAttention) -> Tensor:
    return layer(x, cos, sin, attn)


def packed_lm_head(model) -> PackedLinear | None:
    """A packed copy of the (tied or own) LM head weight, or None where packing does not apply
    (an own head that lesson 14's pack_linears packed already, or lesson 17's parallel head)."""
    if model.lm_head is not None and type(model.lm_head) is not nn.Linear:
        return None
    weight = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    if not can_pack(weight.dtype) or weight.device.type != "cpu":
        return None
    head = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    head.weight = weight                 # shared, not copied: only the packed layout is new
    packed = PackedLinear(head)
    packed.weight_plain = weight.detach()    # the plain weight too (shared), for gemv_bf16
    return packed


class CpuGraphRunner(GraphRunner):
    """Decode buckets through our ops and direct calls, prompt steps through a dynamic compiled
    body, logits through a packed head (CPU, head-major pool, lesson 15's "cpu" backend)."""

    # A bucket every 8 sequences above 16 (vLLM's capture sizes). On a GPU a step of 40 rows and
    # one of 48 take about the same time, so a step pads up to its bucket. On two CPU cores a
    # decode step of more than a few rows is busy with arithmetic and a pad row costs about what
    # a real row does, while the dynamic body (mixed.py) runs a step at its own size for little
    # more than a replay: so only a step that fills its bucket replays it, and steps of up to
    # `pad_up_to` rows, whose bucket is one C call over weights read from memory either way.
    bucket_step = 8
    pad_up_to = 4

    def __init__(self, model, pool, attention: AttentionBackend, max_batch: int, scratch_block: int,
                 direct_calls: bool = True, compile_mixed: bool = True, small_rows: bool = True,
                 one_call: bool = True):
        """direct_calls=False: every call of a compiled body goes through Dynamo (for comparison).
        compile_mixed=False: prompt steps run eagerly, as in lesson 16. small_rows: logits by
        our own kernels on a copy of the head's weight (the embedding when tied), as
        ops.OpPackedLinear does for the layers' linears. one_call: buckets of
        up to decode_step.max_rows() rows run every layer in one C call (decode_step.py) where
        the model fits it; False: they are compiled like the others."""
        super().__init__(model, pool, attention, max_batch, scratch_block)
        self.mode = "compile"
        self.layer_attention = {b: [OpAttention(self, i, b) for i in range(model.config.num_layers)]
                                for b in self.buckets}
        self.direct: dict[int, DirectCall] = {}     # bucket -> its compiled body, called without Dynamo
        self.direct_calls = direct_calls
        self.one_call = one_call and small_rows and decode_step.fits(model)
        self.one_call_rows = decode_step.max_rows(model.model.embed_tokens.weight.dtype) if self.one_call else 0
        self.one_call_steps: dict[int, decode_step.DecodeStep] = {}    # bucket -> its plan, for b <= 4
        self.compiler = KeepWhatInductorBuilt()
        body = types.FunctionType(_layer_body.__code__.replace(), _layer_body.__globals__, "layer_body")
        self.layer_body = torch.compile(body, dynamic=False, fullgraph=True, backend=self.compiler,
                                        recompile_limit=64)    # one compiled body per bucket
        self.mixed = MixedStepRunner(model, pool) if compile_mixed else None
        self.lm_head = packed_lm_head(model)
        self._logits: Tensor | None = None       # float32 [rows, vocab], reused by every step
        # Our own kernels for the head (small_rows), as ops.OpPackedLinear has for the layers'
        # linears: float32 logits by gemm_f32 on a packed copy (steps of up to gemm_f32_rows()
        # rows; the rest by the packed oneDNN head); bf16 steps of up to
        # gemv_rows() rows by gemv_bf16 on the plain weight. The copies are on 2 MB pages where
        # the OS grants them: a small step streams the whole head (vocab x hidden, a quarter of
        # Qwen3-0.6B's bytes), faster without a TLB miss every 4 KB.
        self.head_plain = self.head_panels = None
        weight = self.lm_head.weight_plain if small_rows and self.lm_head is not None else None
        if weight is not None and weight.dtype == torch.float32 and gemm_f32_rows() > 0:
            self.head_panels = on_huge_pages(pack_f32(weight))
        elif weight is not None and gemv_rows(weight.dtype) and weight.shape[1] % 32 == 0:
            self.head_plain = on_huge_pages(weight)

    def warm_up(self) -> float:
        """Record every bucket and compile the prompt-step body before serving; seconds."""
        seconds = self.record_all()
        return seconds + (self.mixed.warm_up(self.scratch_block) if self.mixed else 0.0)

    def bucket_for(self, batch: ScheduledBatch) -> int | None:
        b = super().bucket_for(batch)
        if b is None or self.mixed is None or b == len(batch.seqs) or b <= self.pad_up_to:
            return b
        return None                                 # the dynamic body, no pad rows

    def forward(self, batch: ScheduledBatch, input_ids: Tensor, positions: Tensor, attn) -> Tensor:
        if self.bucket_for(batch) is None and self.mixed is not None:
            return self.mixed.forward(input_ids, positions, attn)
        return super().forward(batch, input_ids, positions, attn)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        if self.lm_head is None:
            return super().compute_logits(hidden)
        n, vocab = hidden.shape[0], self.lm_head.out_features
        if self._logits is None or self._logits.shape[0] < n:
            self._logits = torch.empty(max(n, self.buckets[-1]), vocab)
        # Valid until the next compute_logits (callers use the logits within the step).
        if self.head_panels is not None and n <= gemm_f32_rows():
            return gemm_f32(hidden, self.head_panels, vocab, out=self._logits[:n])
        if self.head_plain is not None and n <= gemv_rows(hidden.dtype):
            # Our GEMV on the plain weight, streamed in order, straight into the float32 buffer.
            return gemv(hidden, self.head_plain, out=self._logits[:n])
        logits = self.lm_head(hidden)
        # float32 (oneDNN's head): its own output is the float32 logits; copying it into the
        # buffer would only add a pass over them (39 MB at 64 rows of Qwen3's vocabulary).
        return logits if logits.dtype == torch.float32 else self._logits[:n].copy_(logits)

    def decode(self, b: int) -> Tensor:
        step = self.one_call_steps.get(b)
        if step is not None:
            return self.model.model.norm(step(*self.step_inputs(b)))
        direct = self.direct.get(b)
        if direct is None:
            return super().decode(b)
        x, cos, sin = self.step_inputs(b)
        for i in range(len(self.model.model.layers)):
            x = direct(i, x, cos, sin)
        return self.model.model.norm(x)

    @torch.inference_mode()
    def record(self, b: int) -> None:
        """Compile bucket b (the first call goes through Dynamo), then keep what inductor built
        and call it directly from now on: a bucket's shapes never change."""
        self.pad_step(b)
        if b <= self.one_call_rows:                     # nothing to compile: a plan of pointers
            self.one_call_steps[b] = decode_step.DecodeStep(self.model, self.layer_attention[b], b,
                                                            self.pool.block_size)
            self.decode(b)
            self.ready.add(b)
            return
        x, cos, sin = self.step_inputs(b)
        self.compiler.built = None
        self.layer_body(self.model.model.layers[0], x, cos, sin, self.layer_attention[b][0])
        built, self.compiler.built = self.compiler.built, None   # the compiler outlives the runner
        if built is not None and self.direct_calls:
            direct = self._direct_call(b, built, (x, cos, sin))
            if direct is not None:
                self.direct[b] = direct
        self.decode(b)
        self.ready.add(b)

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
            per_layer.append([None if kind == "step" else own[kind][key] for kind, key in paths])
        return DirectCall(fn, per_layer, slots)
