"""Advanced lesson 10: prefill/decode disaggregation. The same mixed load (short chats, a few long
prompts arriving among them) played into one colocated engine process and into a prefill process
plus a decode process joined by a KV connector (a file store, gloo send/recv): tokens compared,
TTFT split into prefill / transfer / first decode, ITL of the chats while the long prompts arrive,
KV bytes per request and their price on 10/25/100 Gbit/s links, goodput under an SLO, and every
run's timeline as a Chrome trace."""
from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from minivllm_support.cli import base_parser, identity_line, machine, setup
from minivllm_support.models import chat_prompt_ids, load_tokenizer, resolve_model
from minivllm_support.timing import busy_warning
from minivllm_support.timeline import chrome_trace, draw_png, validate_trace, write_chrome_trace
from step04_transformer.config import ModelConfig
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step17_tensor_parallel.launch import add_launch_flags, launch_from_args
from step18_benchmark.loadgen import arrival_times
from step18_benchmark.metrics import SLO, RequestRecord, percentile_stats, summarize
from advanced.adv06_pipeline_parallel.wire import LATENCY_US, LINKS_GBIT, link_ms
from advanced.adv10_pd_disaggregation.cluster import PDCluster
from advanced.adv10_pd_disaggregation.records import PDRecord, PDRequest

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
             "Why do cats purr?", "Explain what a compiler does in two sentences.", "Suggest a name for a grey cat.",
             "How do I boil an egg?", "What is 12 times 7?", "Name a famous painting and its painter.",
             "Give me a tip for learning to swim.", "What does a bee do all day?", "Describe the colour blue."]
NOTES = ("Meeting notes. The team reviewed the quarterly plan, the budget for the new office, the hiring of two "
         "engineers, the schedule of the product launch, the feedback from the first customers and the risks "
         "of the supply chain. ")


def parse():
    p = base_parser(__doc__.split("\n")[0])
    p.add_argument("--chats", type=int, default=12, help="short chat requests (Poisson arrivals)")
    p.add_argument("--rate", type=float, default=2.0, help="chat arrivals per second")
    p.add_argument("--chat-tokens", type=int, default=24, help="tokens generated per chat")
    p.add_argument("--long", type=int, default=2, help="long prompts, arriving evenly among the chats")
    p.add_argument("--long-prompt", type=int, default=800, help="tokens in a long prompt (about)")
    p.add_argument("--long-tokens", type=int, default=8, help="tokens generated per long prompt")
    p.add_argument("--slo-ttft-ms", type=float, default=3000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=150.0)
    p.add_argument("--transfer-timeout", type=float, default=10.0, help="seconds a decode engine waits for a "
                   "layer once its prefill started, before recomputing the prompt itself")
    p.add_argument("--fault", default="", help="inject, e.g. drop-once:3 (request 3's last layer is lost once: "
                   "a retry brings it), drop:3 (lost every time: a fallback after the retry) or exit-prefill:5 "
                   "(the prefill process dies mid-transfer): retries and fallbacks are counted below")
    p.add_argument("--transports", default="store,gloo", help="KV transports to run disaggregated: store "
                   "(files in /dev/shm, store.py), gloo (torch.distributed send/recv, gloo.py)")
    p.add_argument("--prefill", type=int, default=1, help="prefill engine processes (N:M: the store only)")
    p.add_argument("--decode", type=int, default=1, help="decode engine processes")
    p.add_argument("--out", type=Path, default=Path("build/adv10"), help="folder for the traces and PNGs")
    p.add_argument("--remote", choices=("decode", "prefill"), default="decode", help="with --nnodes 2: the "
                   "engine node 1 runs (node.py --role); the launcher and the other engine run here")
    add_launch_flags(p, "python -m advanced.adv10_pd_disaggregation.node --role decode --engines 2")
    return p.parse_args()


def workload(tok, args) -> tuple[list[PDRequest], list[bool]]:
    """The chats at Poisson times; the long prompts (a summary of notes) spread over that window."""
    chats = arrival_times(args.chats, args.rate, seed=0)
    span = chats[-1] if chats else 1.0
    reqs = [PDRequest(t, chat_prompt_ids(tok, QUESTIONS[i % len(QUESTIONS)]), args.chat_tokens)
            for i, t in enumerate(chats)]
    is_long = [False] * len(reqs)
    notes = NOTES * math.ceil(args.long_prompt / max(1, len(tok.encode(NOTES))))
    for j in range(args.long):
        ids = chat_prompt_ids(tok, f"Summarise these notes in one line ({j}): {notes}")
        reqs.append(PDRequest(span * (j + 1) / (args.long + 1), ids, args.long_tokens))
        is_long.append(True)
    return reqs, is_long


def play(folder, mode: str, dtype, config, threads: int, reqs, args, transport: str = "store"):
    n, m = (args.prefill, args.decode) if mode == "disaggregated" else (1, 1)
    launch = args.launch if mode == "disaggregated" else None
    with PDCluster(folder, mode, dtype, config, threads, args.transfer_timeout,
                   args.fault if mode == "disaggregated" else "", transport=transport, num_prefill=n,
                   num_decode=m, launch=launch, remote=args.remote) as c:
        recs = c.run(reqs, timeout_s=600)
        return recs, c.stats(), c.timelines()


def as_record(r: PDRecord) -> RequestRecord:
    return RequestRecord(r.prompt_len, r.start, list(r.token_times), len(r.token_ids), r.token_times[-1])


def ttft_split(r: PDRecord) -> tuple[float, float, float] | None:
    """(prefill, transfer, first decode) seconds, adding up to the TTFT: the prefill (queue and
    compute) until the prefill engine handed over the last layer; the transfer until that layer
    was in the decode pool (the earlier layers travelled during the prefill: streamed); then the
    decode engine's first step for the request, queueing for it included."""
    if r.transfer is None or r.prefill_done is None:
        return None
    landed = max(r.prefill_done, r.transfer["landed"])
    return r.prefill_done - r.start, landed - r.prefill_done, r.token_times[0] - landed


def ms(values) -> str:
    return f"{1e3 * float(np.mean(values)):8.1f}" if len(values) else "       -"


def main() -> None:
    args = parse()
    dtype = setup(args)
    folder = resolve_model(args.model)
    cores = args.threads or os.cpu_count() or 1
    print(f"machine: {machine()}\nmodel: {folder} ({args.dtype})")
    tok = load_tokenizer(folder)
    reqs, is_long = workload(tok, args)
    long_len = [len(r.prompt_ids) for r, lg in zip(reqs, is_long) if lg]
    config = PagedSchedulerConfig(max_num_seqs=32, max_num_batched_tokens=512, block_size=16,
                                  kv_cache_bytes=256 * 2**20)
    print(f"load: {args.chats} chats ({args.chat_tokens} tokens each) at {args.rate:g}/s, {args.long} long prompts "
          f"of {long_len[0] if long_len else 0} tokens ({args.long_tokens} tokens each) among them; prompts chunked "
          f"by {config.max_num_batched_tokens}")
    transports = [t for t in args.transports.split(",") if t]
    if not transports or any(t not in ("store", "gloo") for t in transports):
        raise SystemExit(f"--transports {args.transports!r}: a comma-separated list of store, gloo")
    if "gloo" in transports and (args.prefill, args.decode) != (1, 1):
        raise SystemExit("--prefill/--decode other than 1:1 need --transports store (gloo joins two processes)")
    args.launch = launch_from_args(args)
    if args.launch.multi_node and transports != ["gloo"]:
        raise SystemExit("--nnodes 2 needs --transports gloo: the store's files in /dev/shm cannot cross machines")
    # Across machines each engine has a machine of its own; on one, they share its cores.
    per_engine = cores if args.launch.multi_node else max(1, cores // (args.prefill + args.decode))
    # The colocated engine twice: with every core (the same cores as the split in all), and with
    # one engine's share of the split (the same threads per engine: prefill interference alone).
    col_threads = sorted({cores, per_engine}, reverse=True)
    print(f"colocated: 1 engine process with {' and then '.join(map(str, col_threads))} thread(s)   disaggregated: "
          f"{args.prefill} prefill + {args.decode} decode process(es), {per_engine} thread(s) each, KV through "
          f"{' / '.join(transports)}" + (f", the {args.remote} engine on node 1 of 2 (node.py; its thread count is "
                                         f"its own)" if args.launch.multi_node else "") + "\n")
    if warning := busy_warning():
        print(warning)
    runs = {f"colocated {t}t": play(folder, "colocated", dtype, config, t, reqs, args) for t in col_threads}
    for t in transports:
        runs[f"PD {t}"] = play(folder, "disaggregated", dtype, config, per_engine, reqs, args, t)
    col = runs[f"colocated {cores}t"][0]
    same = sum(a.token_ids == b.token_ids for name, run in runs.items() if name.startswith("PD")
               for a, b in zip(col, run[0]))
    print(identity_line("outputs, disaggregated vs colocated", same, len(reqs) * len(transports), dtype))

    slo = SLO(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms)
    print(f"\n{'':16}{'TTFT chats':>22}{'TTFT long':>11}{'ITL chats':>22}{'goodput':>10}{'SLO met':>9}")
    print(f"{'':16}{'p50 ms':>11}{'p99 ms':>11}{'mean ms':>11}{'p50 ms':>11}{'p99 ms':>11}{'req/s':>10}")
    for mode, (recs, _, _) in runs.items():
        chats = [as_record(r) for r, lg in zip(recs, is_long) if not lg]
        longs = [as_record(r) for r, lg in zip(recs, is_long) if lg]
        ttft = percentile_stats([r.ttft for r in chats])
        itl = percentile_stats([g for r in chats for g in r.itl])
        everything = [as_record(r) for r in recs]
        duration = max(r.end for r in everything) - min(r.start for r in everything)
        result = summarize(everything, duration, slo)
        met = sum(slo.met(r) for r in everything)
        print(f"{mode:16}{ttft.median:11.1f}{ttft.p99:11.1f}{ms([r.ttft for r in longs]):>11}"
              f"{itl.median:11.1f}{itl.p99:11.1f}{result.goodput:10.2f}{met:>5}/{len(everything)}")
    print(f"  (SLO: TTFT <= {args.slo_ttft_ms:g} ms and TPOT <= {args.slo_tpot_ms:g} ms; goodput = requests/s "
          f"meeting both)")

    num_layers = ModelConfig.from_pretrained(folder).num_layers
    for name, (dis, stats, _) in runs.items():
        if name.startswith("PD"):
            transfer_report(name, dis, stats, col, is_long, num_layers)
    for mode, (_, st, _) in runs.items():
        print(f"{mode}: " + ", ".join(f"{role} {s['free_blocks']}/{s['num_blocks']} blocks free"
                                      for role, s in st.items()) + " after the run")

    args.out.mkdir(parents=True, exist_ok=True)
    for mode, (_, _, tls) in runs.items():
        slug = mode.replace(" ", "_")
        problems = validate_trace(chrome_trace(tls))
        trace = write_chrome_trace(tls, args.out / f"trace_{slug}.json")
        png = draw_png(tls, args.out / f"timeline_{slug}.png", title=f"{mode}: {len(reqs)} requests")
        print(f"timeline ({mode}): {'valid' if not problems else problems[:2]} {trace}, {png}")


def transfer_report(name: str, dis: list[PDRecord], stats: dict, col: list[PDRecord], is_long: list[bool],
                    num_layers: int) -> None:
    """One disaggregated run: its TTFT split, the KV it moved and that KV's price on a link, its fallbacks."""
    print(f"\n{name}: TTFT split (mean ms; the three add up to the TTFT)")
    print(f"  {'':12}{'prefill':>9}{'transfer':>9}{'1st decode':>11}{'TTFT':>9}   colocated, all threads")
    for label, want in (("chats", False), ("long", True)):
        parts = [p for r, lg in zip(dis, is_long) if lg == want and (p := ttft_split(r)) is not None]
        col_ttft = [r.token_times[0] - r.start for r, lg in zip(col, is_long) if lg == want]
        if parts:
            a, b, c = zip(*parts)
            print(f"  {label:12}{ms(a):>9}{ms(b):>9}{ms(c):>11}{ms([x + y + z for x, y, z in parts]):>9}   "
                  f"{ms(col_ttft)}")
    streamed = [r.transfer["first_layer"] < r.prefill_done for r in dis if r.transfer and r.prefill_done]
    print(f"  layer 0 was in the decode pool before the prefill engine handed over the last layer for "
          f"{sum(streamed)}/{len(streamed)} requests (layer-by-layer streaming)")
    moved = [(r.prompt_len, r.transfer["bytes"]) for r in dis if r.transfer]
    if moved:
        print(f"  KV moved per request (counted as it lands in the decode pool): mean "
              f"{np.mean([b for _, b in moved]) / 2**10:.0f} KiB, "
              f"{sum(b for _, b in moved) / sum(n for n, _ in moved) / 2**10:.1f} KiB per prompt token; "
              f"sent {stats.get('prefill', {}).get('bytes_saved', 0) / 2**20:.1f} MiB in all")
        print(f"  link model (computed from those bytes, not measured): bytes x 8 / bandwidth + one message per "
              f"layer x {LATENCY_US:.0f} us")
        print(f"  {'':20}" + "".join(f"{f'{g} Gbit/s':>12}" for g in LINKS_GBIT))
        for label, want in (("a chat", False), ("a long prompt", True)):
            b = [r.transfer["bytes"] for r, lg in zip(dis, is_long) if lg == want and r.transfer]
            if b:
                print(f"  {label:20}" + "".join(f"{link_ms(np.mean(b), num_layers, g):9.2f} ms" for g in LINKS_GBIT))
    retried, fallbacks = [r for r in dis if r.retry], [r for r in dis if r.fallback]
    print(f"  retries (a failed transfer asked for again, once): {len(retried)}"
          + "".join(f"\n    request {r.rid}: {r.retry}" for r in retried))
    print(f"  fallbacks (prompt recomputed on the decode engine): {len(fallbacks)}"
          + "".join(f"\n    request {r.rid}: {r.fallback}" for r in fallbacks))


if __name__ == "__main__":
    main()
