"""Advanced lesson 01: weight-only quantization (W8A16, W4A16, the GGUF file's own Q4_1 blocks).

    python advanced/adv01_quantization/run.py                # the embedded SmolLM2 (or --model FOLDER)
    python advanced/adv01_quantization/run.py --skip-speed   # only parts 1-3

1. what the embedded GGUF file stores, and its Q4_1 blocks served as int4, checked bit for bit;
2. quality: perplexity, top-1 agreement and KL against the unquantized model, and weight bytes;
3. lesson 19's LLM on the Q4_1 blocks, beside the float copy;
4. speed on the Qwen3-0.6B shape: bytes per decode step, where each kernel wins as rows grow,
   and one decode step of lesson 16's engine (eager) at batch 1 and 64.
"""
from __future__ import annotations

import torch

from advanced.adv01_quantization.bench import (build_variants, linear_slots, random_model, rows_sweep,
                                               time_decode, with_dequant_rows)
from advanced.adv01_quantization.engine import q4_1_llm
from advanced.adv01_quantization.gguf_q4_1 import embedded_gguf, gguf_dequantized, load_q4_1, read_q4_1
from advanced.adv01_quantization.linear import Int4Linear, quantize_model, weight_bytes
from advanced.adv01_quantization.quality import TEXT, log_probs, score
from advanced.adv01_quantization.quantize import W8A16, QuantScheme
from minivllm_support.cli import base_parser, machine, setup
from minivllm_support.models import embedded_smollm2, load_tokenizer, resolve_model
from minivllm_support.timing import format_ratio
from minivllm_support.workloads import weight_floor
from step04_transformer.config import ModelConfig
from step04_transformer.loader import load_model
from step19_real_model.llm import LLM
from step19_real_model.params import SamplingParams

MB = 1e6
QUALITY = {"W8A16 per-channel": (W8A16, None), "W4A16 g32 asym": (QuantScheme(4, 32, False), None),
           "W4A16 g64 asym": (QuantScheme(4, 64, False), None), "W4A16 g32 sym": (QuantScheme(4, 32, True), None),
           "W4A16 g128 asym": (QuantScheme(4, 128, False), None),
           "W4A16 g32 asym + int8 head": (QuantScheme(4, 32, False), W8A16)}
G128 = QuantScheme(4, 128, symmetric=False)
SPEED = {"bf16 (lesson 14)": (None, None), "W8A16": (W8A16, None), "W4A16 g128": (G128, None),
         "W4A16 g128 + int8 head": (G128, W8A16)}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def gguf_section(dtype: torch.dtype) -> None:
    path = embedded_gguf()
    print(f"== 1. {path.name}: what the file stores")
    cfg = ModelConfig.from_pretrained(embedded_smollm2())
    blocks, report = read_q4_1(path, cfg.num_heads, cfg.num_kv_heads)
    by_type: dict[str, list[str]] = {}
    for key, n in report.types.items():
        kind, name = key.split(" ", 1)
        by_type.setdefault(kind, []).append(f"{name} x{n}")
    for kind, names in by_type.items():
        print(f"  {kind:5}: {', '.join(names)}")
    inexact = sum(b.as_int4()[1] for b in blocks.values())
    nblocks = sum(b.d.numel() for b in blocks.values())
    print(f"  {len(blocks)} linears in Q4_1 ({nblocks:,} blocks of 32); as int4 scale = d, zero = m + 8d: "
          f"{inexact} zeros not exact in float32")
    checks = [("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj"),
              ("blk.29.ffn_down.weight", "model.layers.29.mlp.down_proj")]
    for gguf_name, ours in checks:
        mod = Int4Linear(blocks[ours].as_int4()[0], torch.float32)
        kernel_w = mod(torch.eye(mod.in_features)).t()          # the kernel's own weights, column by column
        ref = gguf_dequantized(path, gguf_name, cfg.num_heads, cfg.num_kv_heads)
        print(f"  {gguf_name}: int4 kernel's fp32 weights == gguf.dequantize: {torch.equal(kernel_w, ref)} "
              f"(max |diff| {float((kernel_w - ref).abs().max()):.1e})")
    print(f"  token_embd (the tied embedding and LM head) is Q8_0, not Q4_1: it stays a {_name(dtype)} copy here\n")


def quality_section(folder, dtype: torch.dtype, embedded: bool) -> None:
    tok = load_tokenizer(folder)
    ids = tok.encode(TEXT)
    base = load_model(folder, dtype)
    ref = log_probs(base, ids)
    rows = {"unquantized (reference)": (score(ref, ids), weight_bytes(base.model.layers), weight_bytes(base), 0)}
    for name, (scheme, head) in QUALITY.items():
        try:
            model = quantize_model(base, scheme, head)        # a new model; `base` stays as it is
        except ValueError as e:
            rows[name] = str(e)
            continue
        head_bytes = 0 if head is None else weight_bytes(model.lm_head)
        rows[name] = (score(log_probs(model, ids), ids, ref), weight_bytes(model.model.layers),
                      weight_bytes(model) - head_bytes, head_bytes)
    if embedded:
        model, _ = load_q4_1(base)
        rows["Q4_1 blocks of the file"] = (score(log_probs(model, ids), ids, ref), weight_bytes(model.model.layers),
                                           weight_bytes(model), 0)
    print(f"== 2. quality: {len(ids) - 1} next tokens of the lesson's text, {_name(dtype)}, against the unquantized model")
    print(f"  {'variant':28} {'linears MB':>10} {'model MB':>9} {'perplexity':>10} {'top-1 same':>10} {'KL nats':>9}")
    for name, row in rows.items():
        if isinstance(row, str):
            print(f"  {name:28} refused: {row}")
            continue
        q, lin, total, head = row
        extra = f"  (+ {head / MB:.1f} MB int8 head)" if head else ""
        print(f"  {name:28} {lin / MB:10.1f} {total / MB:9.1f} {q.perplexity:10.3f} {q.agreement:10.1%} "
              f"{q.kl:9.5f}{extra}")
    print()


def llm_section(folder, dtype: str) -> None:
    q = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    params = SamplingParams(temperature=0, max_tokens=24)
    with LLM(folder, dtype=dtype, enforce_eager=True) as llm:
        plain = llm.chat(q, params, use_tqdm=False)[0].outputs[0]
    llm, report = q4_1_llm(dtype=dtype)
    with llm:
        q41 = llm.chat(q, params, use_tqdm=False)[0].outputs[0]
    print(f"== 3. lesson 19's LLM, greedy, unchanged: float copy vs the file's Q4_1 blocks ({report.swapped} Int4Linear)")
    print(f"  float copy : {plain.text!r}\n  Q4_1 int4  : {q41.text!r}\n  same tokens: {plain.token_ids == q41.token_ids}\n")


def speed_section(context: int, repeats: int = 3) -> None:
    model = random_model()
    cfg = model.config
    print(f"== 4. speed on the Qwen3-0.6B shape (random bf16 weights: {cfg.num_layers} layers, hidden "
          f"{cfg.hidden_size}, intermediate {cfg.intermediate_size}, vocab {cfg.vocab_size}, tied head)")
    _, bandwidth, _ = weight_floor(model)
    variants, seconds = build_variants(model, SPEED)
    print("  quantizing took " + ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items()))
    print(f"  bytes one decode step reads (memory read bandwidth here: {bandwidth / 1e9:.1f} GB/s, a float32 sum):")
    base = variants[0]
    for v in variants:
        fewer = "" if v is base else f"{base.bytes / v.bytes:.2f}x fewer than bf16, "
        print(f"    {v.name:24} linears {v.bytes_linears / MB:6.1f} MB + head {v.bytes_head / MB:5.1f} MB = "
              f"{v.bytes / MB:6.1f} MB  ({fewer}floor {v.bytes / bandwidth * 1e3:.1f} ms a step)")

    gates = [i for i, (_, attr) in enumerate(linear_slots(model)) if attr == "gate_proj"]
    int8 = [variants[1].linears[i] for i in gates]
    sweep = {"bf16 packed": [base.linears[i] for i in gates], "int8 kernel": with_dequant_rows(int8, None),
             "int8 -> bf16 matmul": with_dequant_rows(int8, 0), "int4 kernel": [variants[2].linears[i] for i in gates]}
    stored = {n: weight_bytes(mods[0]) * len(gates) for n, mods in sweep.items()}
    results = rows_sweep(sweep, [1, 4, 8, 16, 64])
    print(f"\n  the {len(gates)} gate_proj linears ({cfg.hidden_size} -> {cfg.intermediate_size}) one after another: "
          f"ms per linear (stored weight bytes per second)")
    print(f"    {'rows':>4} " + " ".join(f"{n:>22}" for n in sweep))
    for r, timings in results.items():
        cells = [f"{t.median / len(gates) * 1e3:7.3f} ({stored[n] / t.median / 1e9:5.1f} GB/s)" for n, t in timings.items()]
        print(f"    {r:4d} " + " ".join(f"{c:>22}" for c in cells))

    for batch, steps, chosen in [(1, 8, variants), (64, 2, variants[:3])]:
        t = time_decode(model, chosen, batch, context, steps, repeats=repeats)
        print(f"\n  lesson 16's engine (eager), {batch} sequence{'s' * (batch > 1)} decoding, context ~{context}, "
              f"{steps} steps a turn")
        for v in chosen:
            ms = t[v.name].median / steps * 1e3
            print(f"    {v.name:24} {ms:7.1f} ms a step, {batch * 1e3 / ms:6.1f} tok/s   ({t[v.name].describe()})")
        for v in chosen[1:]:
            print(f"    {v.name} vs bf16: {format_ratio(t[base.name], t[v.name])}")


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--context", type=int, default=64, help="prompt length of the decode-step benchmark")
    p.add_argument("--skip-speed", action="store_true", help="only the GGUF, quality and LLM parts")
    args = p.parse_args()
    dtype = setup(args)
    folder = resolve_model(args.model)
    embedded = folder.resolve() == embedded_smollm2().resolve()
    print(f"machine: {machine()}\nmodel: {folder} ({args.dtype})\n")
    gguf_section(dtype)
    quality_section(folder, dtype, embedded)
    if embedded:
        llm_section(folder, args.dtype)
    else:
        print("== 3. skipped: the Q4_1 blocks belong to the embedded SmolLM2, not to this model\n")
    if not args.skip_speed:
        speed_section(args.context, args.repeats or 3)


if __name__ == "__main__":
    main()
