"""Advanced lesson 03: speculative decoding on the embedded model, on prompts whose answers repeat
their input (code edits, a summary, answers quoted from a passage): acceptance rate, tokens per
target forward and wall time against the same engine without speculation, at batch 1 and 8.

    python advanced/adv03_speculative/run.py                     # bf16, the embedded SmolLM2
    python advanced/adv03_speculative/run.py --dtype fp32 --k 5 --draft-layers 12
"""
from __future__ import annotations

import dataclasses

import torch

from minivllm_support.cli import base_parser, identity_line
from step04_transformer.start import start_lesson
from minivllm_support.models import chat_prompt_ids
from minivllm_support.timing import compare, format_ratio
from step04_transformer.model import SingleSequenceAttention
from step06_sampler.params import SamplingParams
from step12_paged_attention.scheduler import PagedSchedulerConfig
from step16_cuda_graph.cpu.engine import build_engine, cpu_fast_path
from advanced.adv03_speculative.engine import SpecStats, build_spec_engine
from advanced.adv03_speculative.proposers import LayerSkipProposer, NgramProposer

GREET = '''def greet(name):
    message = "Hello, " + name + "!"
    print(message)
    return message'''
COUNTER = '''class Counter:
    def __init__(self):
        self.count = 0

    def increment(self):
        self.count += 1
        return self.count'''
SPLIT = '''for item in items:
    if item.price > 100:
        expensive.append(item)
    else:
        cheap.append(item)'''
LIBRARY = ("The city library will close for renovation from March to June. During this time, books can be "
           "returned at the town hall, and a small reading room will open in the old post office on Main "
           "Street. The renovated library will have a larger children's section, a cafe, and twenty new "
           "computers. The library director said the work is paid for by a grant from the regional "
           "government and will not raise local taxes.")
TRAIN = ("The night train leaves Vienna at 21:40 and arrives in Venice at 08:55 the next morning. It has "
         "sleeping cars with two or four beds, and a seat car. Breakfast is served in the sleeping cars. "
         "Bicycles can travel on the train if a bicycle place is booked in advance.")
NILE = ("The Nile is a major north-flowing river in northeastern Africa. It flows into the Mediterranean "
        "Sea. The Nile is among the longest rivers in the world, with a length of about 6,650 "
        "kilometres. Its drainage basin covers eleven countries.")

# (kind, user message). Batch 1 runs the first three, one at a time; batch 8 runs all eight together.
TASKS = [
    ("edit code", f"Rewrite the following code, renaming `message` to `greeting`. Keep everything else "
                  f"the same.\n\n```python\n{GREET}\n```"),
    ("summarise", f"Summarise this text in two sentences.\n\n{LIBRARY}"),
    ("answer from a passage", f"Answer the question using the passage. Quote the passage.\n\nPassage: {NILE}"
                              f"\n\nQuestion: How long is the Nile, and into which sea does it flow?"),
    ("edit code", f"Rewrite this class with the attribute `count` renamed to `value`.\n\n```python\n{COUNTER}\n```"),
    ("edit code", f"Rewrite this loop with `item` renamed to `product`.\n\n```python\n{SPLIT}\n```"),
    ("summarise", f"Summarise this text in one sentence.\n\n{TRAIN}"),
    ("answer from a passage", f"Answer the question using the passage. Quote the passage.\n\nPassage: {TRAIN}"
                              f"\n\nQuestion: When does the train arrive in Venice?"),
    ("edit code", f"Rename `items` to `products` in this code:\n\n```python\n{SPLIT}\n```"),
]


def variant(make_engine, prompts: list[list[int]], sp: SamplingParams, batch: int):
    """A fresh engine per run (no prefix-cache hits carried over); `batch` requests at a time."""
    def run() -> dict:
        engine = make_engine()
        outputs, per_request = [], []
        for i in range(0, len(prompts), batch):
            before = dataclasses.replace(engine.spec) if hasattr(engine, "spec") else None
            outputs += [s.output_token_ids for s in engine.generate(prompts[i:i + batch], sp)]
            if before is not None:
                per_request.append(SpecStats(*(getattr(engine.spec, f.name) - getattr(before, f.name)
                                               for f in dataclasses.fields(SpecStats))))
        return dict(outputs=outputs, steps=engine.num_steps, spec=getattr(engine, "spec", None),
                    per_request=per_request)
    return run


def report(title: str, runs: dict, kinds: list[str], dtype, batch: int) -> None:
    print(f"\n{title}")
    (base, tb), *others = runs.items()
    if batch == 1:                                  # each request ran alone: its own numbers
        print(f"  {'':<24}" + "".join(f"{name:>28}" for name, _ in others))
        print(f"  {'request':<24}" + f"{'acceptance':>14}{'tokens/fwd':>14}" * len(others))
        for i, kind in enumerate(kinds):
            stats = [t.result["per_request"][i] for _, t in others]
            print(f"  {kind:<24}" + "".join(f"{s.acceptance_rate:>14.1%}{s.tokens_per_forward:>14.2f}" for s in stats))
    print(f"  {'engine':<20}{'target forwards':>16}{'tokens/forward':>16}{'acceptance':>12}   wall time")
    for name, t in runs.items():
        r, s = t.result, t.result["spec"]
        acc = f"{s.acceptance_rate:.1%}" if s else "-"
        tpf = f"{s.tokens_per_forward:.2f}" if s else "1.00"
        print(f"  {name:<20}{r['steps']:>16}{tpf:>16}{acc:>12}   {t.describe()}")
    for name, t in others:
        print(f"  {name}: {format_ratio(tb, t)} than {base}")
    notes = []
    for name, t in others:
        ref, got = tb.result["outputs"], t.result["outputs"]
        line, *note = identity_line(f"outputs, {name} vs {base}", sum(a == b for a, b in zip(ref, got)),
                                    len(ref), dtype).split("\n")
        print("  " + line)
        notes += [n for n in note if n not in notes]
    for n in notes:                                 # the bf16 explanation once, not once per engine
        print(n)


@torch.inference_mode()
def exit_agreement(model, prompts: list[list[int]], outputs: list[list[int]], exits: list[int]) -> dict[int, float]:
    """How often the first L' layers (+ final norm + LM head) pick the full model's greedy token,
    on the given outputs: the acceptance rate a greedy layer-skip draft of L' layers would see."""
    agree, total = dict.fromkeys(exits, 0), 0
    for p, out in zip(prompts, outputs):
        ids = torch.tensor(p + out[:-1])
        cos, sin = model.rotary(torch.arange(len(ids)))
        x = model.model.embed_tokens(ids)
        picks = {}
        for depth, layer in enumerate(model.model.layers, start=1):
            x = layer(x, cos, sin, SingleSequenceAttention())
            if depth in exits or depth == len(model.model.layers):
                picks[depth] = model.compute_logits(model.model.norm(x[len(p) - 1:])).argmax(-1)
        full = picks[len(model.model.layers)]
        for e in exits:
            agree[e] += int((picks[e] == full).sum())
        total += len(out)
    return {e: agree[e] / max(1, total) for e in exits}


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--k", type=int, default=4, help="draft tokens per step, prompt lookup")
    p.add_argument("--draft-layers", type=int, default=8, help="layers of the layer-skip draft")
    p.add_argument("--draft-k", type=int, default=2, help="draft tokens per step, layer skip")
    args = p.parse_args()
    args.repeats = args.repeats or 2
    dtype, folder, model, tok = start_lesson(args)
    n_layers = model.config.num_layers
    config = PagedSchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024, kv_cache_bytes=128 * 2**20)
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    # Lesson 16's fast-path model transforms once, here: build_engine finds nothing left to transform, so a
    # fresh engine per timed run costs no packing.
    fast = cpu_fast_path(model)
    engines = {
        "no speculation": lambda: build_engine(fast, config, use_graph=False),
        "prompt lookup": lambda: build_spec_engine(fast, config, use_graph=False, proposer=NgramProposer(1, 3),
                                                   num_speculative_tokens=args.k),
        f"layer skip {args.draft_layers}/{n_layers}": lambda: build_spec_engine(
            fast, config, use_graph=False, proposer=LayerSkipProposer(args.draft_layers),
            num_speculative_tokens=args.draft_k),
    }
    print(f"all engines: lesson 16's fast-path engine without graphs (use_graph=False), greedy, max_tokens={args.max_tokens}\n"
          f"prompt lookup: the last 3 (else 2, else 1) tokens found earlier in prompt + output, k={args.k}\n"
          f"layer skip: the first {args.draft_layers} of {n_layers} layers + final norm + LM head, k={args.draft_k}")
    prompts = [chat_prompt_ids(tok, q) for _, q in TASKS]
    kinds = [k for k, _ in TASKS]

    # Warm-up (compare's own would be one more full round): every engine once on short outputs, so
    # the first timed run does not pay for building the kernels and picking oneDNN's.
    short = SamplingParams(temperature=0, max_tokens=8)
    for make in engines.values():
        make().generate(prompts[:1], short)
        make().generate(prompts, short)
    one = compare({n: variant(f, prompts[:3], sp, 1) for n, f in engines.items()}, repeats=args.repeats,
                  warmup=False)
    report("(a) batch 1: three requests, one after the other", one, kinds[:3], dtype, 1)
    eight = compare({n: variant(f, prompts, sp, 8) for n, f in engines.items()}, repeats=args.repeats,
                    warmup=False)
    report(f"(b) batch 8: eight requests together ({', '.join(sorted(set(kinds)))})", eight, kinds, dtype, 8)

    exits = sorted({e for e in (4, 8, 12, 16, 20, 24, 28, args.draft_layers) if e < n_layers})
    agreement = exit_agreement(model, prompts[:3], one["no speculation"].result["outputs"], exits)
    print(f"\n(c) a greedy layer-skip draft's acceptance, by depth: the first L' layers' argmax = the full "
          f"model's, on the outputs of (a)")
    print("  " + "   ".join(f"L'={e}: {a:.1%}" for e, a in agreement.items()))


if __name__ == "__main__":
    main()
