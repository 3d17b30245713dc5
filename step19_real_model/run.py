"""Lesson 19: vLLM's offline API on the real checkpoint.

    python step19_real_model/run.py                 # the embedded SmolLM2 (or --model FOLDER)
    python step19_real_model/run.py --dtype fp32 --threads 2

Chat with a batch of questions, several completions of one prompt (n, seed), stop strings,
logprobs, a streamed answer in Chinese, and what the API layer costs over the bare engine.
"""
from __future__ import annotations

from minivllm_support.cli import base_parser, machine, setup
from minivllm_support.watch import add_watch_argument, watch_engines
from step09_continuous_batching.engine import LLMEngine
from minivllm_support.models import resolve_model
from minivllm_support.timing import compare, format_ratio
from step06_sampler.params import SamplingParams as EngineParams
from step19_real_model.detokenizer import IncrementalDetokenizer
from step19_real_model.llm import LLM
from step19_real_model.params import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for writing clear code.",
    "Why is the sky blue? Answer in two sentences.",
    "Write a haiku about autumn.",
    "What is 12 times 12?",
    "Name three planets of the solar system.",
    "How do I boil an egg?",
    "Translate 'good morning' into French and Spanish.",
]


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--max-tokens", type=int, default=64)
    args = add_watch_argument(p).parse_args()
    watch_engines(LLMEngine, args)          # --watch: a live page of every engine built below
    setup(args)
    folder = resolve_model(args.model)
    print(f"machine: {machine()}\nmodel: {folder} ({args.dtype})\n")
    with LLM(folder, dtype=args.dtype, max_num_seqs=8) as llm:
        print(f"LLM ready: max_model_len {llm.max_model_len}, {llm.engine.kv_pool.num_blocks} KV blocks, "
              f"decode steps {'compiled' if getattr(llm.engine.runner, 'mode', 'eager') != 'eager' else 'eager'}\n")
        chat(llm, args.max_tokens)
        several(llm)
        stops(llm)
        logprobs(llm)
        streamed(llm)
        api_cost(llm, args.max_tokens, args.repeats or 2)


def chat(llm: LLM, max_tokens: int) -> None:
    print(f"== llm.chat: {len(QUESTIONS)} questions, greedy, max_tokens {max_tokens}")
    outs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS],
                    SamplingParams(temperature=0, max_tokens=max_tokens))
    for q, o in zip(QUESTIONS, outs):
        c = o.outputs[0]
        print(f"Q: {q}\nA: {c.text!r}\n   ({len(c.token_ids)} tokens, finish_reason={c.finish_reason}, "
              f"TTFT {c.metrics.ttft * 1e3:.0f} ms)")
    print()


def several(llm: LLM) -> None:
    sp = SamplingParams(temperature=0.8, top_p=0.95, n=3, seed=42, max_tokens=20)
    print("== n=3 completions of one prompt, temperature 0.8, top_p 0.95, seed 42 (completion i gets seed 42 + i)")
    first = llm.generate("The best thing about weekends is", sp, use_tqdm=False)[0]
    again = llm.generate("The best thing about weekends is", sp, use_tqdm=False)[0]
    for c in first.outputs:
        print(f"  [{c.index}] {c.text!r}")
    same = [a.token_ids == b.token_ids for a, b in zip(first.outputs, again.outputs)]
    print(f"  run again with the same seed: {sum(same)}/{len(same)} completions identical\n")


def stops(llm: LLM) -> None:
    print("== stop strings (found in the text, cut from it, the request aborted at once)")
    q = [{"role": "user", "content": "Count from 1 to 20, separated by commas."}]
    full = llm.chat(q, SamplingParams(temperature=0, max_tokens=60), use_tqdm=False)[0].outputs[0]
    cut = llm.chat(q, SamplingParams(temperature=0, max_tokens=60, stop=["7"]), use_tqdm=False)[0].outputs[0]
    kept = llm.chat(q, SamplingParams(temperature=0, max_tokens=60, stop=["7"], include_stop_str_in_output=True),
                    use_tqdm=False)[0].outputs[0]
    print(f"  no stop       : {full.text!r} ({len(full.token_ids)} tokens, {full.finish_reason})")
    print(f"  stop=['7']    : {cut.text!r} ({len(cut.token_ids)} tokens, finish_reason={cut.finish_reason}, "
          f"stop_reason={cut.stop_reason!r})")
    print(f"  ... kept      : {kept.text!r}")
    s = llm.engine.stats()
    print(f"  afterwards: {s.num_running} running, {s.kv_blocks_used} KV blocks in use\n")


def logprobs(llm: LLM) -> None:
    print("== logprobs=3: the model's top 3 (raw logits, before temperature) at each step, chosen first")
    out = llm.generate("The capital of Italy is", SamplingParams(temperature=0, max_tokens=4, logprobs=3),
                       use_tqdm=False)[0].outputs[0]
    for tok, entry in zip(out.token_ids, out.logprobs):
        top = "  ".join(f"{lp.decoded_token!r} {lp.logprob:.2f}" for lp in sorted(entry.values(), key=lambda x: x.rank))
        print(f"  chose {entry[tok].decoded_token!r:12} | {top}")
    print(f"  cumulative logprob {out.cumulative_logprob:.3f}\n")


def streamed(llm: LLM) -> None:
    print("== incremental detokenization of a Chinese answer: what a stream would send, token by token")
    q = [{"role": "user", "content": "请用中文回答：天空为什么是蓝色的？"}]
    out = llm.chat(q, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    tok = llm.tokenizer
    d = IncrementalDetokenizer(tok, out.prompt_token_ids, SamplingParams())
    pieces = [d.add(t) for t in out.outputs[0].token_ids] + [d.flush()]
    alone = [tok.decode([t]) for t in out.outputs[0].token_ids]
    print(f"  answer: {out.outputs[0].text!r}")
    print(f"  tokens decoded one by one: {alone[:10]}")
    print(f"  incremental pieces       : {pieces[:10]}")
    print(f"  pieces joined == full decode: {''.join(pieces) == out.outputs[0].text}; "
          f"tokens that are half a character: {sum(chr(0xfffd) in a for a in alone)}\n")


def api_cost(llm: LLM, max_tokens: int, repeats: int = 2) -> None:
    """Same requests through LLM.chat and through the engine alone: what the API layer adds
    (tokenizing, the template, detokenizing every token, the output objects)."""
    prompts = [llm.chat_prompt_ids([{"role": "user", "content": q}]) for q in QUESTIONS]
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine_sp = EngineParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    runs = compare({"engine": lambda: llm.engine.generate(prompts, engine_sp),
                    "LLM.chat": lambda: llm.chat(conversations, sp, use_tqdm=False)}, repeats=repeats)
    tokens = len(QUESTIONS) * max_tokens
    print(f"== what the API costs: {len(QUESTIONS)} chats x {max_tokens} tokens (ignore_eos), taking turns")
    for name, t in runs.items():
        print(f"  {name:9}: {t.describe()}, {tokens / t.median:.1f} output tok/s")
    print(f"  LLM.chat / engine time: {format_ratio(runs['LLM.chat'], runs['engine'], word='')}")


if __name__ == "__main__":
    main()
