"""What run.py prints after its runs: tokens, busy shares, bytes and their price on a link, the cost model."""
from __future__ import annotations

from minivllm_support.cli import identity_line
from minivllm_support.timeline import busy_fraction, window
from advanced.adv06_pipeline_parallel.wire import LATENCY_US, LINKS_GBIT, link_ms
from advanced.adv11_afd.costmodel import (balanced_ratio, ffn_spans, fit_attention, fit_ffn, fit_hop, hop_samples,
                                          measured_loops, predict_loops, step_shapes)

CONTEXTS = (64, 512, 4096)        # tokens of KV per sequence at which the balancing ratio is shown


def ratio(name: str) -> tuple[int, int]:
    """"AFD 2:1, m=2" -> (2, 1): attention and FFN processes."""
    a, f = name.split()[1].rstrip(",").split(":")
    return int(a), int(f)


def ffn_rows(tls, n_attn: int, n_ffn: int) -> str:
    """Rows per FFN call (2:1 stacks both attention ranks' rows), and how often both ranks worked."""
    calls = [s.args["tokens"] for tl in tls[1:1 + n_ffn] for s in ffn_spans(tl)]
    line = f"FFN calls: {len(calls)}, {sum(calls) / max(1, len(calls)):.1f} rows on average"
    if n_attn > 1:
        shapes = step_shapes(tls[0], tls[1 + n_ffn:])
        both = sum(all([s.micro_batches, *s.peers]) for s in shapes)
        line += f"; steps with every attention rank working: {both} of {len(shapes)}"
    return line


def report(runs, args, dtype, cfg, ffn_counts) -> None:
    base = next(iter(runs.values()))
    gen = args.generated
    print(f"\n{'variant':<26}{'wall time':>34}{'tokens/s':>10}   identical to one process")
    for name, t in runs.items():
        same = sum(a == b for a, b in zip(t.result["outputs"], base.result["outputs"]))
        print(f"{name:<26}{t.describe():>34}{gen / t.median:>10.0f}   {same}/{args.requests}")
    afd = {n: t for n, t in runs.items() if n.startswith("AFD")}
    same = sum(a == b for t in afd.values() for a, b in zip(t.result["outputs"], base.result["outputs"]))
    print(identity_line("outputs, every AFD run vs one process", same, args.requests * len(afd), dtype))

    print("\nbusy share of each process (compute spans / the run's window; the last timed run), and inside the "
          "layer loops only (rank 0: attention halves; FFN: its MLP halves):")
    for name, t in afd.items():
        tls, (n_attn, n_ffn) = t.result["timelines"], ratio(name)
        win, loops = window(tls), measured_loops(tls)
        ffn = ", ".join(f"{busy_fraction(tl, ('compute',), win):.0%}" for tl in tls[1:1 + n_ffn])
        peers = "".join(f", attn {busy_fraction(tl, ('compute',), win):.0%}" for tl in tls[1 + n_ffn:])
        whole = f"rank 0 {busy_fraction(tls[0], ('compute',), win):.0%}, FFN {ffn}{peers}"
        print(f"  {name:<16} whole run: {whole:<24} layer loops ({loops.seconds:.2f} s): "
              f"{'busiest ' if n_attn > 1 else ''}attention {loops.attention_busy:.0%}, "
              f"busiest FFN rank {loops.ffn_busy:.0%}; "
              f"{1e3 * t.median / t.result['traffic']['steps']:.1f} ms a step ({t.result['traffic']['steps']} steps)\n"
              f"  {'':<16} {ffn_rows(tls, n_attn, n_ffn)}\n"
              f"  {'':<16} trace: {t.result['trace']}")

    first = afd[f"AFD 1:{ffn_counts[0]}, m=1"] if f"AFD 1:{ffn_counts[0]}, m=1" in afd else next(iter(afd.values()))
    traffic, tls = first.result["traffic"], first.result["timelines"]
    per_token = traffic["to_ffn"] / max(1, traffic["layer_tokens"])
    hop = fit_hop(tls)
    B, L = args.requests, cfg.num_layers
    step_bytes, step_msgs = 2 * per_token * B * L, 2 * L        # one decode step, m = 1: there and back per layer
    print(f"\nwhat crosses between the sides (measured: rank 0's counters): {per_token:.0f} B per token per layer "
          f"each way (hidden {cfg.hidden_size} x {per_token / cfg.hidden_size:.0f} B), {2 * per_token:.0f} B both ways; "
          f"{traffic['exchanges']} exchanges over {traffic['steps']} steps; plans {traffic['plan'] / 1024:.1f} KiB")
    print(f"  one decode step of {B} sequences: {step_bytes / 1024:.0f} KiB in {step_msgs} messages ({L} layers x 2) "
          f"with m = 1; m micro-batches: m x the messages, the same bytes")
    print(f"  measured exchange overhead on this machine (gloo over loopback): {1e6 * hop:.0f} us per layer "
          f"(mean round trip less the FFN's compute, {len(hop_samples(tls))} exchanges of the m=1 run)")
    peer = next((t.result["traffic"] for n, t in afd.items() if ratio(n)[0] > 1), None)
    if peer:
        print(f"  2:1: the second attention rank's last hidden rows go to rank 0 once a step (its share of the "
              f"tokens x {per_token:.0f} B): {peer['from_peers'] / 1024:.0f} KiB over {peer['steps']} steps")
    print(f"  link model (computed, not measured): ms per decode step = bytes x 8 / bandwidth + messages x "
          f"{LATENCY_US:.0f} us")
    print(f"  {'':24}" + "".join(f"{f'{g} Gbit/s':>14}" for g in LINKS_GBIT))
    for m in (1, 2):
        print(f"  {f'm={m}, batch {B}':24}" + "".join(f"{link_ms(step_bytes, step_msgs * m, g):>11.2f} ms"
                                                      for g in LINKS_GBIT))

    attn, ffn = fit_attention(tls[0]), fit_ffn(tls)
    print(f"\ncost model, fitted on the {next(n for n, t in afd.items() if t is first)} run (least squares over "
          f"its per-layer spans):")
    print(f"  attention half: {1e6 * attn.fixed_s:.0f} us + {1e6 * attn.per_token_s:.1f} us per token + "
          f"{1e9 * attn.per_kv_token_s:.1f} ns per KV token read, per layer")
    print(f"  FFN half:       {1e6 * ffn.fixed_s:.0f} us + {1e6 * ffn.per_token_s:.1f} us per token, per layer")
    print(f"  exchange:       {1e6 * hop:.0f} us per layer and micro-batch (both ways)")
    print(f"  {'':<16} layer loops of the run, predicted and measured: seconds (a step), busy attention, FFN")
    for name, t in afd.items():
        n_attn, n_ffn = ratio(name)
        tl, steps = t.result["timelines"], t.result["traffic"]["steps"]
        shapes = step_shapes(tl[0], tl[1 + n_ffn:])
        pred, meas = predict_loops(shapes, attn, ffn, hop, n_ffn), measured_loops(tl)
        print(f"  {name:<16} predicted {pred.seconds:.2f} s ({1e3 * pred.seconds / steps:5.1f} ms) "
              f"{pred.attention_busy:4.0%} {pred.ffn_busy:4.0%}   measured {meas.seconds:.2f} s "
              f"({1e3 * meas.seconds / steps:5.1f} ms) {meas.attention_busy:4.0%} {meas.ffn_busy:4.0%}"
              f"{'   <- fitted here' if t is first else ''}")
    print(f"\nthe attention:FFN ratio that balances a decode batch of {B} (attention time / FFN time for the same "
          f"tokens, by the model):")
    for c in CONTEXTS:
        r = balanced_ratio(attn, ffn, B, c)
        say = f"1 attention : {1 / r:.1f} FFN" if r < 1 else f"{r:.1f} attention : 1 FFN"
        print(f"  context {c:>5} tokens: {r:.2f} attention workers per FFN worker ({say})")
