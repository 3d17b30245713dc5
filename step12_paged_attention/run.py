"""Lesson 12: KV memory a paged pool really uses, against reserving it contiguously per request."""
from __future__ import annotations

import random
import statistics

from minivllm_support.cli import base_parser, identity_line
from minivllm_support.watch import add_watch_argument, watch_engines
from step09_continuous_batching.engine import LLMEngine
from step04_transformer.start import start_lesson
from minivllm_support.models import chat_prompt_ids
from minivllm_support.timing import compare, format_ratio
from step06_sampler.params import SamplingParams
from step11_preemption.engine import PreemptingEngine
from step11_preemption.scheduler import PreemptionSchedulerConfig
from step12_paged_attention.engine import PagedEngine
from step12_paged_attention.kv_pool import KVPool, slot_mapping
from step12_paged_attention.scheduler import PagedSchedulerConfig

QUESTIONS = ["Say one word about the sea.", "Write a short poem about a cat.", "What is the capital of Italy?",
             "Explain the moon to a child.", "Describe a cup of coffee.", "Tell a story about a robot.",
             "Name three things to do in winter.", "Why do people like music?", "Describe a quiet library.",
             "What lives in the desert?", "How does a train work?", "Give two tips for a small garden.",
             "Explain the rules of chess briefly.", "Why does it rain?", "Describe the sound of a violin.",
             "How is bread made?"]


def workload(tok, n: int, seed: int = 0):
    """Chat requests with varied max_tokens; they stop at EOS, as real requests do."""
    rng = random.Random(seed)
    prompts = [chat_prompt_ids(tok, QUESTIONS[i % len(QUESTIONS)]) for i in range(n)]
    params = [SamplingParams(temperature=0, max_tokens=rng.choice([32, 64, 128])) for _ in range(n)]
    return prompts, params


def mib(n_bytes: float) -> str:
    return f"{n_bytes / 2**20:8.1f} MiB"


def run_paged(model, config: PagedSchedulerConfig, prompts, params) -> dict:
    """The paged engine, stepped by hand so we can watch the pool; a fresh engine every run."""
    engine = PagedEngine(model, config)
    bm = engine.scheduler.block_manager
    seqs = [engine.add_request(pr, sp) for pr, sp in zip(prompts, params)]
    peak_blocks = peak_tokens = max_running = 0
    block_steps = run_steps = 0          # sums over steps: blocks in use, requests running
    watch = max(seqs, key=lambda s: s.params.max_tokens)       # one long request to illustrate with
    snapshot = None
    while engine.has_unfinished():
        engine.step()
        running, used = engine.scheduler.running, engine.scheduler.num_used_blocks
        if used > peak_blocks:
            peak_blocks, peak_tokens = used, sum(s.num_computed_tokens for s in running)
        max_running = max(max_running, len(running))
        block_steps += used
        run_steps += len(running)
        if watch.block_table:
            snapshot = (list(watch.block_table), watch.num_computed_tokens)
    assert bm.num_free_blocks == bm.num_blocks, "blocks leaked"
    return dict(seqs=seqs, steps=engine.num_steps, preemptions=engine.scheduler.num_preemptions,
                peak_blocks=peak_blocks, peak_tokens=peak_tokens, max_running=max_running,
                block_steps=block_steps, run_steps=run_steps, watch=seqs.index(watch), snapshot=snapshot)


def run_contiguous(model, config: PreemptionSchedulerConfig, prompts, params) -> dict:
    """Lesson 11 on the same workload: one contiguous cache of prompt + max_tokens each."""
    ref = PreemptingEngine(model, config)
    seqs = [ref.add_request(pr, sp) for pr, sp in zip(prompts, params)]
    peak = token_steps = run_steps = 0
    while ref.has_unfinished():
        ref.step()
        reserved = sum(s.kv_cache.capacity for s in ref.scheduler.running if s.kv_cache is not None)
        peak = max(peak, reserved)
        token_steps += reserved
        run_steps += len(ref.scheduler.running)
    return dict(seqs=seqs, steps=ref.num_steps, preemptions=ref.scheduler.num_preemptions,
                peak=peak, token_steps=token_steps, run_steps=run_steps)


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-mib", type=int, default=256, help="size of the KV pool (the budget)")
    p.add_argument("--short-max-model-len", type=int, default=2048,
                   help="a second, smaller contiguous reservation to compare with")
    args = add_watch_argument(p).parse_args()
    watch_engines(LLMEngine, args)          # --watch: a live page of every engine built below
    dtype, folder, model, tok = start_lesson(args)
    cfg = model.config
    prompts, params = workload(tok, args.requests)
    bs, budget = args.block_size, args.kv_cache_mib * 2**20

    config = PagedSchedulerConfig(max_num_seqs=args.requests, block_size=bs, kv_cache_bytes=budget)
    pool = PagedEngine(model, config).kv_pool          # to describe; every run below builds its own
    per_block = KVPool.bytes_per_block(cfg, bs, dtype)
    per_token = per_block // bs
    print(f"KV pool: {args.kv_cache_mib} MiB budget -> {pool.num_blocks} blocks of {bs} tokens "
          f"({per_block / 2**10:.0f} KiB each, {per_token} B per token); "
          f"layer 0 K is one tensor of shape {tuple(pool.k[0].shape)}")
    print(f"{args.requests} chat requests, prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"max_tokens {sorted(s.max_tokens for s in params)}, stopping at EOS; "
          f"mean prompt + max_tokens {statistics.mean(len(pr) + sp.max_tokens for pr, sp in zip(prompts, params)):.1f}\n")
    num_blocks = pool.num_blocks
    ref_config = PreemptionSchedulerConfig(max_num_seqs=args.requests, max_kv_tokens=num_blocks * bs)
    del pool                                           # its 256 MiB are not needed any more

    # Warm-up, not timed: every request for 8 tokens through both engines. A full untimed
    # round (~40 s) would take the script past two minutes, so the engines run twice each.
    warm = SamplingParams(temperature=0, max_tokens=8)
    PagedEngine(model, config).generate(prompts, warm)
    PreemptingEngine(model, ref_config).generate(prompts, warm)
    runs = compare({"paged": lambda: run_paged(model, config, prompts, params),
                    "lesson 11": lambda: run_contiguous(model, ref_config, prompts, params)},
                   repeats=args.repeats or 2, warmup=False)
    paged, ref = runs["paged"].result, runs["lesson 11"].result
    seqs = paged["seqs"]

    out_lens = [len(s.output_token_ids) for s in seqs]
    stopped = sum(s.finish_reason == "stop" for s in seqs)
    print(f"paged engine:     {runs['paged'].describe()}, {paged['steps']} steps, {paged['preemptions']} preemptions")
    print(f"lesson 11 engine: {runs['lesson 11'].describe()}, {ref['steps']} steps, {ref['preemptions']} preemptions "
          f"(a contiguous cache per request)")
    print(f"time paged / lesson 11: {format_ratio(runs['paged'], runs['lesson 11'], word='')}")
    same = sum(a.output_token_ids == b.output_token_ids for a, b in zip(seqs, ref["seqs"]))
    print(identity_line("outputs, paged vs lesson 11", same, len(seqs), dtype))
    print(f"{sum(out_lens)} tokens generated; {stopped}/{len(seqs)} requests stopped at EOS before max_tokens; "
          f"output lengths {sorted(out_lens)}\n")
    peak_blocks, peak_tokens, max_running = paged["peak_blocks"], paged["peak_tokens"], paged["max_running"]

    # ---- memory: what was used vs what contiguous reservation takes -------------------------
    max_len, short_len = cfg.max_position_embeddings, args.short_max_model_len
    print(f"peak KV memory during the run (up to {max_running} requests running at once):")
    rows = [(f"contiguous, {max_running} x max_model_len={max_len}", max_running * max_len * per_token),
            (f"contiguous, {max_running} x max_model_len={short_len}", max_running * short_len * per_token),
            ("contiguous, prompt + max_tokens each (lesson 11, measured)", ref["peak"] * per_token),
            (f"paged, blocks in use ({peak_blocks} blocks x {bs} slots)", peak_blocks * per_block),
            ("  of which slots holding a token", peak_tokens * per_token)]
    for label, nbytes in rows:
        print(f"  {label:<60} {mib(nbytes)}")
    slots = peak_blocks * bs
    print(f"  empty slots at the ends of last blocks: {slots - peak_tokens} of {slots} "
          f"({100 * (slots - peak_tokens) / slots:.1f}%)\n")

    # ---- capacity: how many such requests the same pool holds -------------------------------
    blocks_per_req = paged["block_steps"] / paged["run_steps"]   # a paged request's average holding while it runs
    tokens_per_req = ref["token_steps"] / ref["run_steps"]       # a contiguous request holds its reservation all along
    print(f"how many requests the same {args.kv_cache_mib} MiB pool holds at once "
          f"(pool size / average KV a running request holds, averaged over every step):")
    fits = [(f"contiguous, max_model_len={max_len}", budget // (max_len * per_token)),
            (f"contiguous, max_model_len={short_len}", budget // (short_len * per_token)),
            (f"contiguous, prompt + max_tokens ({tokens_per_req:.1f} tokens each)",
             int(budget // (tokens_per_req * per_token))),
            (f"paged ({blocks_per_req:.2f} blocks = {blocks_per_req * bs:.1f} slots each)",
             int(num_blocks // blocks_per_req))]
    for label, k in fits:
        print(f"  {label:<60} {k:6d}")
    paged_fit = fits[3][1]
    print("  paged holds " + ", ".join(f"{paged_fit / k:.1f}x" if k else "(none fit)" for _, k in fits[:3])
          + " as many requests as the three contiguous rows\n")

    # ---- one sequence's block table and slot mapping ----------------------------------------
    table, held = paged["snapshot"]
    print(f"request {paged['watch']} just before it finished: {held} tokens in KV, block table {table}")
    boundary = (held - 1) // bs * bs
    lo = max(0, boundary - 2)
    for pos, slot in zip(range(lo, lo + 4), slot_mapping(table, lo, lo + 4, bs)):
        print(f"  position {pos:3d} -> block_table[{pos} // {bs} = {pos // bs}] = block {table[pos // bs]:3d}, "
              f"offset {pos % bs:2d} -> slot {table[pos // bs]} * {bs} + {pos % bs} = {slot}")


if __name__ == "__main__":
    main()
