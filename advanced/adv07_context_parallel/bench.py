"""Advanced lesson 07, the heavy part: memory per rank and prefill time at 16k and 32k tokens,
one process against cp ranks, and the work balance of zigzag against contiguous pieces.

What is measured, exactly: SmolLM2-135M's real weights cut to its first --layers layers (2 by
default) and its RoPE table extended past the 8192 positions it was trained for (the numbers
it computes there mean nothing; the time and the bytes are the same as for a model trained that
long). A 30-layer 32k prefill would take many minutes on 2 cores; per-layer figures scale: the
KV of the full model is computed from the measured per-layer bytes, labelled as computed, and
the activation peak is that of one layer (layers run one after the other, so it does not grow
with their number).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from advanced.adv07_context_parallel.engine import CPEngine
from advanced.adv07_context_parallel.run import fmt_list, kv_bytes_per_token, mib, summary
from advanced.adv07_context_parallel.zigzag import imbalance
from minivllm_support.cli import base_parser, machine, setup
from minivllm_support.models import resolve_model
from minivllm_support.timeline import draw_png, write_chrome_trace
from minivllm_support.timing import busy_warning
from step04_transformer.config import ModelConfig
from step06_sampler.params import SamplingParams
from step12_paged_attention.scheduler import PagedSchedulerConfig


def truncated_model(folder: Path, layers: int, positions: int, out: Path) -> Path:
    """A checkpoint folder with `folder`'s first `layers` layers and a RoPE table of `positions`."""
    target = out / f"{folder.name}-{layers}layers-{positions}pos"
    if (target / "model.safetensors").is_file():
        return target
    target.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(num_hidden_layers=layers, max_position_embeddings=positions)
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                parts = name.split(".")
                if len(parts) > 2 and parts[1] == "layers" and int(parts[2]) >= layers:
                    continue              # a layer we cut off
                tensors[name] = f.get_tensor(name).contiguous()
    save_file(tensors, str(target / "model.safetensors"))
    (target / "config.json").write_text(json.dumps(cfg, indent=1))
    return target


def prefill(engine: CPEngine, T: int, vocab: int) -> dict:
    ids = [5 + (i * 7919) % (vocab - 5) for i in range(T)]        # any ids: the cost is the same
    engine.prefill_prompt(ids, SamplingParams(max_tokens=1))
    while engine.has_unfinished():
        engine.step()
    return summary(engine.last_prefill)


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--layers", type=int, default=2, help="layers of the model kept (default 2)")
    p.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768], help="prompt lengths")
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--out", default="build/adv07")
    p.set_defaults(dtype="fp32")
    args = p.parse_args()
    dtype = setup(args)
    src = resolve_model(args.model)
    cores = args.threads or os.cpu_count() or 1
    out = Path(args.out)
    folder = truncated_model(src, args.layers, max(args.lengths) + 64, out)
    full = ModelConfig.from_pretrained(src)
    cfg = ModelConfig.from_pretrained(folder)
    kvb = kv_bytes_per_token(cfg, 4 if args.dtype == "fp32" else 2)
    print(f"machine: {machine()}\nmodel: {src} cut to its first {args.layers} of {full.num_layers} layers, "
          f"RoPE table {max(args.lengths) + 64} positions ({args.dtype})")
    warning = busy_warning()
    if warning:
        print(warning)
    print(f"one process: {cores} threads; cp={args.cp}: {max(1, cores // args.cp)} thread(s) per rank\n")
    budget = int(1.1 * max(args.lengths) * kvb * cfg.num_layers) + 2**20
    config = PagedSchedulerConfig(block_size=16, kv_cache_bytes=budget, max_num_batched_tokens=max(args.lengths))
    rows = {}
    for cp, threads in ((1, cores), (args.cp, max(1, cores // args.cp))):
        with CPEngine(folder, config, context_parallel_size=cp, dtype=dtype, threads_per_rank=threads,
                      timeout_s=600, exact_memory=True) as engine:
            prefill(engine, 256, cfg.vocab_size)                    # warm-up, untimed
            for T in args.lengths:
                rows[cp, T, True] = prefill(engine, T, cfg.vocab_size)
                if cp > 1 and T == args.lengths[0]:
                    info = engine.last_prefill
                    write_chrome_trace(info["timelines"], out / f"bench_cp{cp}_{T}.json")
                    draw_png(info["timelines"], out / f"bench_cp{cp}_{T}.png",
                             title=f"cp={cp} zigzag prefill of {T} tokens, {args.layers} layers")
                    engine.zigzag = False
                    rows[cp, T, False] = prefill(engine, T, cfg.vocab_size)
                    engine.zigzag = True
    print(f"memory and time, {args.layers} layers measured, per rank (rank 0 / rank 1 / ...). 'peak' = the "
          f"process's peak resident memory during the prefill minus before it, with rank 0's KV pool made "
          f"resident beforehand: activations and transient buffers. KV = the prompt's K/V in rank 0's pool, "
          f"computed ({kvb} bytes per token per layer)")
    for T in args.lengths:
        kv_measured, kv_full = T * kvb * cfg.num_layers, T * kvb * full.num_layers
        for cp in (1, args.cp):
            s = rows[cp, T, True]
            full_rank = [None if pk is None else pk + (kv_full if r == 0 else 0) for r, pk in enumerate(s["peak"])]
            print(f"  {T:>6} tokens cp={cp}: prefill {s['wall']:7.2f} s  peak {mib(s['peak'])}  + KV {kv_measured / 2**20:.0f}"
                  f" MiB on rank 0  | ring {fmt_list([b / 2**20 for b in s['bytes_per_layer']], '.1f')} MiB/layer/rank")
            print(f"  {'':>14}  full {full.num_layers}-layer model, computed (peak + KV of {full.num_layers} layers "
                  f"= {kv_full / 2**20:.0f} MiB on rank 0): {mib(full_rank)}")
    T = args.lengths[0]
    print(f"\nbalance at {T} tokens, cp={args.cp} (rank 0 / rank 1 / ...):")
    for zigzag in (True, False):
        s = rows[args.cp, T, zigzag]
        print(f"  {'zigzag' if zigzag else 'contiguous':<11} score pairs {fmt_list([p / 1e6 for p in s['pairs']], ',.0f')} M "
              f"(max/mean {imbalance(s['pairs']):.2f})   attention {fmt_list(s['attention'], '.1f')} s   "
              f"ring wait {fmt_list(s['wait'], '.1f')} s   prefill {s['wall']:.1f} s")
    print(f"\ntimeline: {out / f'bench_cp{args.cp}_{T}.json'} and .png")


if __name__ == "__main__":
    main()
