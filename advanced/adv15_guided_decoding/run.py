"""Advanced lesson 15: guided decoding on the real checkpoint, and its cost against xgrammar and llguidance.

    python advanced/adv15_guided_decoding/run.py                 # the embedded SmolLM2 (or --model FOLDER)
    python advanced/adv15_guided_decoding/run.py --repeats 1     # quicker: one timed pass of each

The model answers in one batch under a JSON schema, a choice list, a regex and json_object, next
to a free request; each answer is checked (jsonschema / full match). Then, on SmolLM2's 49k and
Qwen3's 151k vocabularies: what compiling a constraint costs and what one token's mask costs,
ours (cold: first visit of a state; warm: cached) against xgrammar and llguidance, and what the
masks add to a sampler step of 8 rows.
"""
from __future__ import annotations

import json
import re
import statistics
import time

import jsonschema
import torch

from minivllm_support.cli import base_parser, machine, setup
from minivllm_support.models import qwen3_tokenizer_json, resolve_model

from advanced.adv15_guided_decoding import reference
from advanced.adv15_guided_decoding.dfa import compile_regex, nfa_to_dfa
from advanced.adv15_guided_decoding.engine import GuidedLLM
from advanced.adv15_guided_decoding.json_schema import schema_regex
from advanced.adv15_guided_decoding.params import SamplingParams, StructuredOutputsParams
from advanced.adv15_guided_decoding.regex_dfa import parse, to_nfa
from advanced.adv15_guided_decoding.sampler import GuidedSampler
from advanced.adv15_guided_decoding.token_index import GuideState, TokenIndex, TokenVocab
from step06_sampler.params import SamplingParams as PlainParams

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer"},
                                           "city": {"enum": ["Paris", "London", "Rome", "Tokyo"]},
                                           "languages": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                         "maxItems": 3}},
          "required": ["name", "age", "city", "languages"]}
PHONE = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"
SAMPLE = '{"name":"Ada Lovelace","age":36,"city":"London","languages":["English","French"]}'


def answers(llm: GuidedLLM) -> None:
    so = StructuredOutputsParams
    cases = [("json schema", "Describe a person as JSON: name, age, city, languages.", so(json=PERSON), 64),
             ("choice", "Is the sky blue? Answer yes or no.", so(choice=["yes", "no"]), 4),
             ("regex", "Give me a US phone number.", so(regex=PHONE), 16),
             ("json_object", "Give the name and age of a cat as a JSON object.", so(json_object=True), 32),
             ("free", "Give the name and age of a cat as a JSON object.", None, 32)]
    params = [SamplingParams(temperature=0, max_tokens=n, structured_outputs=c) for _, _, c, n in cases]
    t0 = time.perf_counter()
    outs = llm.chat([[{"role": "user", "content": q}] for _, q, _, _ in cases], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    print(f"== one batch, greedy: four constrained requests and a free one ({seconds:.1f} s, "
          f"{sum(len(o.outputs[0].token_ids) for o in outs)} tokens)")
    for (name, q, _, _), o in zip(cases, outs):
        text = o.outputs[0].text
        reason = o.outputs[0].finish_reason
        verdict = check(name, text) if reason == "stop" or name == "free" else \
            "cut by max_tokens: only an answer that ends with EOS is complete"
        print(f"  {name:12}: {text!r}\n  {'':12}  -> {verdict} (finish_reason {reason})")
    print()


def check(name: str, text: str) -> str:
    try:
        if name == "json schema":
            jsonschema.validate(json.loads(text), PERSON)
            return "parses and validates against the schema"
        if name == "choice":
            return "one of the choices" if text in ("yes", "no") else "NOT one of the choices"
        if name == "regex":
            return "matches the regex" if re.fullmatch(PHONE, text) else "DOES NOT match the regex"
        value = json.loads(text)
        return f"parses as JSON ({type(value).__name__})"
    except (ValueError, jsonschema.ValidationError) as e:
        return f"does not parse/validate: {str(e)[:60]}"


def timed(fn, repeats: int) -> float:
    """Median seconds of fn() over `repeats` calls."""
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def per_token(make_guide, path: list[int]) -> float:
    """Seconds per token of mask + accept along `path`, with a fresh guide."""
    guide = make_guide()
    t0 = time.perf_counter()
    for tok in path:
        getattr(guide, "fill", guide.allowed)()          # the libraries' packed mask, or ours
        guide.accept(tok)
    return (time.perf_counter() - t0) / len(path)


def speed(name: str, tokenizer, vocab_size: int, eos: list[int], repeats: int) -> None:
    regex = schema_regex(PERSON)
    path = tokenizer.encode(SAMPLE, add_special_tokens=False) + eos[:1]
    t0 = time.perf_counter()
    vocab = TokenVocab.from_hf(tokenizer, vocab_size, eos)
    vocab.walk_arrays()
    prep = {"ours": time.perf_counter() - t0}
    t0 = time.perf_counter()                        # each library's first grammar counts as set-up
    xgr = reference.xgrammar_compiler(tokenizer, vocab_size, eos)
    reference.XgrammarGuide(xgr, "a", vocab_size)
    prep["xgrammar"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    lltok = reference.llguidance_tokenizer(tokenizer, vocab_size, eos)
    reference.LLGuidanceGuide(lltok, "a", vocab_size)
    prep["llguidance"] = time.perf_counter() - t0
    compile_s = {"ours": timed(lambda: TokenIndex(nfa_to_dfa(to_nfa(parse(regex))), vocab), repeats),
                 "xgrammar": timed(lambda: reference.XgrammarGuide(xgr, regex, vocab_size), repeats),
                 "llguidance": timed(lambda: reference.LLGuidanceGuide(lltok, regex, vocab_size), repeats)}
    index = TokenIndex(compile_regex(regex), vocab)
    mask = {"ours, cold": per_token(lambda: GuideState(index), path),          # computes each state's mask
            "ours, warm": statistics.median(per_token(lambda: GuideState(index), path) for _ in range(repeats)),
            "xgrammar": statistics.median(per_token(lambda: reference.XgrammarGuide(xgr, regex, vocab_size), path)
                                          for _ in range(repeats)),
            "llguidance": statistics.median(per_token(lambda: reference.LLGuidanceGuide(lltok, regex, vocab_size),
                                                      path) for _ in range(repeats))}
    per_state = []                                       # every state's mask, computed afresh
    fresh = TokenIndex(index.dfa, vocab)
    for state in range(index.dfa.num_states):
        t0 = time.perf_counter()
        fresh.allowed(state)
        per_state.append(time.perf_counter() - t0)
    open_state = max(range(len(per_state)), key=lambda s: int(fresh.allowed(s).sum()))
    print(f"== {name}: {vocab_size} token ids; the schema above as a regex ({index.dfa.num_states} DFA states), "
          f"a {len(path)}-token answer")
    print("  per tokenizer, once : " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in prep.items()))
    print("  compile (per schema): " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in compile_s.items()))
    print("  mask + accept/token : " + ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in mask.items()))
    print(f"  ours, each of the {len(per_state)} states' mask: median {statistics.median(per_state) * 1e3:.2f} ms, "
          f"max {max(per_state) * 1e3:.2f} ms; the widest state allows {int(fresh.allowed(open_state).sum())} "
          f"tokens and took {per_state[open_state] * 1e3:.2f} ms")
    print()


def sampler_overhead(vocab_size: int, index: TokenIndex, repeats: int) -> None:
    logits = torch.randn(8, vocab_size)
    params = [PlainParams(temperature=0)] * 8
    sampler = GuidedSampler()
    for state in range(index.dfa.num_states):          # warm every mask: this times applying them
        index.allowed(state)

    def step(guided: int):
        def run():
            for _ in range(20):                         # fresh guides: each step starts in state 0
                sampler(logits, params, guides=[GuideState(index) if i < guided else None for i in range(8)])
        return run
    step(4)(), step(8)()                                # warm-up: torch's first indexed writes are slow
    plain = timed(step(0), repeats) / 20
    half = timed(step(4), repeats) / 20
    full = timed(step(8), repeats) / 20
    print(f"== a greedy sampler step of 8 rows x {vocab_size} (masks cached): plain {plain * 1e3:.2f} ms, "
          f"4 guided rows {half * 1e3:.2f} ms, 8 guided rows {full * 1e3:.2f} ms")


def main() -> None:
    p = base_parser(__doc__)
    args = p.parse_args()
    setup(args)
    repeats = args.repeats or 3
    folder = resolve_model(args.model)
    print(f"machine: {machine()}\nmodel: {folder} ({args.dtype})\n")
    # enforce_eager: lesson 16's compiled decode steps take minutes to record on a small CPU.
    with GuidedLLM(folder, dtype=args.dtype, max_num_seqs=8, enforce_eager=True) as llm:
        answers(llm)
        speed(f"{folder.name} tokenizer", llm.tokenizer, llm.vocab_size, llm.engine.eos_ids, repeats)
        sampler_overhead(llm.vocab_size, TokenIndex(compile_regex(schema_regex(PERSON)), llm.engine.guide_vocab),
                         repeats)
    from transformers import PreTrainedTokenizerFast
    qwen = PreTrainedTokenizerFast(tokenizer_file=str(qwen3_tokenizer_json()))
    speed("Qwen3 tokenizer", qwen, 151936, [qwen.convert_tokens_to_ids("<|im_end|>")], repeats)


if __name__ == "__main__":
    main()
