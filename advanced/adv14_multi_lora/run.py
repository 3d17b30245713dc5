"""Advanced lesson 14: many LoRA adapters over one base model, in one batch, on the real checkpoint.

    python advanced/adv14_multi_lora/run.py                  # the embedded SmolLM2 (or --model FOLDER)
    python advanced/adv14_multi_lora/run.py --max-tokens 32  # longer answers

Adapters are made on the spot with peft (random B, fixed seed: make_adapters.py says why).
Prints: what each adapter makes of one prompt; throughput of 16 requests spread over 1, 4 and
16 adapters in one batch (segments vs stacked deltas) against the base model alone and against
merging each adapter into its own model run one after another; the LRU's loads and evictions
with fewer slots than adapters. Each variant runs once after a short warm-up request
(--repeats is accepted, as by every run.py, and not used).
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from minivllm_support.cli import base_parser, machine, setup
from minivllm_support.models import load_tokenizer, resolve_model
from minivllm_support.timing import busy_warning
from step04_transformer.loader import load_model
from step12_paged_attention.scheduler import PagedSchedulerConfig

from advanced.adv14_multi_lora.adapters import LoRARequest
from advanced.adv14_multi_lora.bench import base_alone, lora_batch, merged_per_adapter, same_tokens
from advanced.adv14_multi_lora.make_adapters import describe, make_adapters

TOPICS = ["rivers", "bread", "volcanoes", "chess", "bees", "glass", "trains", "owls", "tides", "paper",
          "comets", "cheese", "kites", "moss", "violins", "salt"]
NUM_REQUESTS = 16


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated per request")
    args = p.parse_args()
    dtype = setup(args)
    folder = resolve_model(args.model)
    print(f"machine: {machine()}\nmodel: {folder} ({args.dtype})")
    tok = load_tokenizer(folder)
    # Prompts differ from their first token: no prefix-cache hits for the base requests either.
    prompts = [tok.encode(f"{t.capitalize()} are interesting because") for t in TOPICS[:NUM_REQUESTS]]
    warm_prompt = tok.encode("Warm-up: one two three")
    model = load_model(folder, dtype)
    config = PagedSchedulerConfig(max_num_seqs=NUM_REQUESTS, max_num_batched_tokens=512, kv_cache_bytes=64 * 2**20)
    with tempfile.TemporaryDirectory(prefix="adv14-") as tmp:
        folders = make_adapters(folder, Path(tmp), 16)
        adapters = [LoRARequest(f"adapter-{i:02d}", i + 1, str(f)) for i, f in enumerate(folders)]
        base_params = sum(p.numel() for p in model.parameters())
        print(f"adapters: 16 PEFT folders made with peft here (random B, seed 0), alternating\n"
              f"  [{describe(folders[0], base_params)}]\n  [{describe(folders[1], base_params)}]\n")
        samples(model, config, tok, adapters[:3], warm_prompt)
        throughput(model, config, prompts, adapters, args.max_tokens, warm_prompt, dtype)
        lru(model, config, prompts, adapters, args.max_tokens, warm_prompt)


def samples(model, config, tok, adapters, warm_prompt) -> None:
    prompt = tok.encode("The best thing about mornings is")
    run, _ = lora_batch(model, config, [prompt] * 4, [None, *adapters], 12, warm_prompt, 4, "auto")
    print("== one prompt, four requests in one batch: the base and three adapters (greedy)")
    for lr, t in zip([None, *adapters], run.tokens):
        print(f"  {lr.lora_name if lr else 'base':11}: {tok.decode(t)!r}")
    print()


def throughput(model, config, prompts, adapters, max_tokens, warm_prompt, dtype) -> None:
    warning = busy_warning()
    if warning:
        print(warning)
    n = len(prompts)
    print(f"== {n} requests x {max_tokens} tokens, greedy; tok/s = generated tokens / step-loop seconds")
    base = base_alone(model, config, prompts, max_tokens, warm_prompt)
    print(f"  {'base model alone (lesson 15 engine)':44}{base.tok_per_s:8.1f} tok/s")
    on_lora = lora_batch(model, config, prompts, [None] * n, max_tokens, warm_prompt, 16, "auto")[0]
    print(f"  {'base requests on the LoRA engine':44}{on_lora.tok_per_s:8.1f} tok/s (LoRA layers, no adapter)")
    print(f"  {'adapters in the batch':24}{'segments':>14}{'stacked':>14}{'merged, in turn':>18}   merging")
    same = {"segments vs merged": 0, "stacked vs segments": 0}
    for k in (1, 4, 16):
        loras = [adapters[i % k] for i in range(n)]
        seg = lora_batch(model, config, prompts, loras, max_tokens, warm_prompt, 16, "segments")[0]
        stk = lora_batch(model, config, prompts, loras, max_tokens, warm_prompt, 16, "stacked")[0]
        mrg = merged_per_adapter(model, config, prompts, loras, max_tokens, warm_prompt)
        print(f"  {k:>3} ({n // k:>2} requests each){'':4}{seg.tok_per_s:8.1f} tok/s{stk.tok_per_s:8.1f} tok/s"
              f"{mrg.tok_per_s:12.1f} tok/s   {mrg.setup_seconds:5.1f} s")
        same["segments vs merged"] += same_tokens(seg, mrg)
        same["stacked vs segments"] += same_tokens(stk, seg)
    for what, count in same.items():
        print(f"  identical requests, {what}: {count}/{3 * n}")
    if same["segments vs merged"] < 3 * n and dtype != torch.float32:
        print("  (bf16: a merged weight is W + scaling B A rounded to bf16, and the matmuls run over other batch\n"
              "  shapes; greedy decoding follows the first near-tie that flips. The tests compare in fp32)")
    print()


def lru(model, config, prompts, adapters, max_tokens, warm_prompt) -> None:
    n = len(prompts)
    loras = [adapters[i % 16] for i in range(n)] * 2          # 32 requests, each adapter twice
    print(f"== LRU: {len(loras)} requests over 16 adapters (each used twice, in turn), max_num_seqs {n}")
    for max_loras in (16, 8, 4):
        run, engine = lora_batch(model, config, prompts * 2, loras, max_tokens, warm_prompt, max_loras, "auto")
        s = engine.loras.stats()
        print(f"  max_loras {max_loras:>2}: {run.tok_per_s:6.1f} tok/s, {s.loads:>2} loads, {s.evictions:>2} evictions, "
              f"{s.load_seconds:.2f} s loading, {engine.num_steps} steps")


if __name__ == "__main__":
    main()
