"""Lesson 01 demo: train a tiny BPE, then run the real Qwen3 tokenizer through our encoder
and compare every id with Hugging Face `tokenizers`; render the Qwen3 chat template.

    python step01_tokenizer/run.py
"""
from __future__ import annotations

import time
import unicodedata

from minivllm_support.cli import base_parser, machine, setup
from minivllm_support.models import qwen3_tokenizer_json
from step01_tokenizer import ByteLevelBPE, render_chat

TRAIN_CORPUS = """\
An inference engine turns a prompt into tokens, runs the model on them, and samples the
next token, again and again, until the answer is complete. The engine keeps the keys and
values of every token in a cache, so that the next step only computes the newest token.
The scheduler decides which requests run in each step; the block manager decides where
their keys and values live; the sampler decides which token comes next.
Tokens are the unit of everything: the engine counts them, caches them, batches them and
bills them. A tokenizer that splits text into fewer tokens makes the same model faster.
def generate(model, prompt, steps):
    tokens = tokenize(prompt)
    for step in range(steps):
        logits = model(tokens)
        tokens.append(sample(logits))
    return detokenize(tokens)
"""

MIXED_TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "It's what they're saying: we'll see, I'd guess, you've won, she's here.",
    "大语言模型推理引擎把提示词切分成词元，然后逐个生成新的词元。",
    "混合 mixed 文本 with English 和中文, numbers 2024-06-01 and 3.14159.",
    "def add(a: int, b: int) -> int:\n    return a + b\n\nprint(add(2, 40))\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += x[i] * y[i];\n}\n",
    "Emoji: \U0001F600 \U0001F680 \U0001F44D\U0001F3FD \u2764\ufe0f \U0001F468\u200d\U0001F4BB",
    "whitespace runs:   three spaces,\t\ttwo tabs,\n\n\nthree newlines,    \n  end  ",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n",
    "first document<|endoftext|>second document<|endoftext|>",
    "<think>\nLet me check: 17 * 23 = 391.\n</think>\n\nThe answer is 391.",
    "Café naïve résumé — Ünïcödé, e\u0301 (decomposed é), ﬁ ligature, Ω, ½, ²",
    "日本語のテキストと한국어 텍스트도 섞여 있습니다.",
    "URL https://example.com/a?b=1&c=%20x#frag  email: someone@example.org",
]

CHAT = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "What is a token?"},
    {"role": "assistant", "content": "<think>\nShort answer.\n</think>\n\nA piece of text."},
    {"role": "user", "content": "用中文再说一遍。"},
]


def show(tok: ByteLevelBPE, text: str) -> str:
    return " | ".join(tok.piece(i) for i in tok.encode(text))


def timed(fn, repeat: int = 1):
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return out, best


def part1_train() -> None:
    print("== 1. train a tiny byte-level BPE on the built-in corpus ==")
    corpus_bytes = len(TRAIN_CORPUS.encode("utf-8"))
    tok, secs = timed(lambda: ByteLevelBPE.train(TRAIN_CORPUS, vocab_size=400,
                                                 special_tokens=("<|endoftext|>",)))
    print(f"corpus: {corpus_bytes} bytes; learned {len(tok.merges)} merges "
          f"-> vocab {tok.vocab_size} (256 bytes + merges + 1 special) in {secs * 1e3:.0f} ms")
    print("first 12 merges (rank: left + right -> new piece; Ġ is a space):")
    for r, (a, b) in enumerate(tok.merges[:12]):
        print(f"  {r:3d}: {a!r:>8} + {b!r:<8} -> {a + b!r}")
    print("last 4 merges:", ", ".join(f"{a + b!r}" for a, b in tok.merges[-4:]))
    ids = tok.encode(TRAIN_CORPUS)
    print(f"its own corpus: {corpus_bytes} bytes -> {len(ids)} tokens "
          f"({corpus_bytes / len(ids):.2f} bytes/token); "
          f"lossless round trip: {tok.decode(ids) == TRAIN_CORPUS}")
    sample = "The engine caches tokens."
    print(f"pieces of {sample!r}: {show(tok, sample)}")
    unseen = "未见过的文字 \U0001F600"
    print(f"unseen text {unseen!r}: {len(tok.encode(unseen))} tokens (bytes), "
          f"round trip: {tok.decode(tok.encode(unseen)) == unseen}")


def part2_qwen3() -> ByteLevelBPE:
    from tokenizers import Tokenizer

    print("\n== 2. the real Qwen3 tokenizer.json: our encoder vs HF tokenizers ==")
    path = qwen3_tokenizer_json()
    ours, t_ours = timed(lambda: ByteLevelBPE.from_tokenizer_json(path))
    hf, t_hf = timed(lambda: Tokenizer.from_file(str(path)))
    print(f"file: {path}")
    print(f"loaded: {len(ours.vocab)} pieces, {len(ours.merges)} merges, "
          f"{len(ours.added_tokens)} added tokens ({len(ours.special)} special), "
          f"normalizer {ours.normalize}; ours {t_ours * 1e3:.0f} ms, HF {t_hf * 1e3:.0f} ms")
    for text in (MIXED_TEXTS[2], MIXED_TEXTS[6], MIXED_TEXTS[9]):
        print(f"  {text!r}\n    -> {show(ours, text)}")

    # Per text, then one long document built from all of them.
    mismatches = [t for t in MIXED_TEXTS if ours.encode(t) != hf.encode(t).ids]
    n_tokens = sum(len(hf.encode(t).ids) for t in MIXED_TEXTS)
    once = "\n\n".join(MIXED_TEXTS)  # every word new to the cache: the real BPE cost
    doc = once * 20  # repeated: most words come from the per-word cache
    ours.clear_cache()
    ids_once, t_once = timed(lambda: ours.encode(once))
    ids_doc, t_doc = timed(lambda: ours.encode(doc), repeat=3)
    hf_once, t_hf_once = timed(lambda: hf.encode(once), repeat=3)
    hf_doc, t_hf_doc = timed(lambda: hf.encode(doc), repeat=3)
    print(f"compared {len(MIXED_TEXTS)} texts, {n_tokens} tokens: "
          f"{'all ids match' if not mismatches else f'{len(mismatches)} texts DIFFER'}")
    print(f"joined ({len(once.encode('utf-8'))} bytes, {len(hf_once.ids)} tokens) and repeated "
          f"x20 ({len(doc.encode('utf-8'))} bytes, {len(hf_doc.ids)} tokens): ids match: "
          f"{ids_once == hf_once.ids and ids_doc == hf_doc.ids}")
    print(f"encode time, joined: ours {t_once * 1e3:.1f} ms (empty cache), "
          f"HF (Rust) {t_hf_once * 1e3:.1f} ms")
    print(f"encode time, x20:    ours {t_doc * 1e3:.1f} ms (warm cache), "
          f"HF (Rust) {t_hf_doc * 1e3:.1f} ms")
    ids_warm = ids_doc
    text, secs = timed(lambda: ours.decode(ids_warm), repeat=3)
    same = text == unicodedata.normalize("NFC", doc) == hf.decode(ids_warm, skip_special_tokens=False)
    print(f"decode: {len(ids_warm)} ids in {secs * 1e3:.1f} ms; equals NFC(input) and HF decode: {same}")
    return ours


def part3_chat(ours: ByteLevelBPE) -> None:
    from transformers import AutoTokenizer

    print("\n== 3. chat template (Qwen3 ChatML) ==")
    text = render_chat(CHAT, add_generation_prompt=True)
    print(text, end="<END>\n")
    hf = AutoTokenizer.from_pretrained(str(qwen3_tokenizer_json().parent))
    results = []
    for gen in (True, False):
        for thinking in (True, False):
            mine = render_chat(CHAT, add_generation_prompt=gen, enable_thinking=thinking)
            theirs = hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=gen,
                                            enable_thinking=thinking)
            ids_hf = hf(theirs, add_special_tokens=False)["input_ids"]
            results.append(mine == theirs and ours.encode(mine) == ids_hf)
    ids = ours.encode(text)
    print(f"{len(ids)} tokens; first 8 ids: {ids[:8]}")
    print(f"same string and ids as transformers apply_chat_template "
          f"(4 variants: generation prompt on/off x thinking on/off): "
          f"{sum(results)}/{len(results)}")
    kept = "Short answer." in text
    print(f"reasoning of the earlier assistant turn kept in the prompt: {kept} (the template "
          "keeps <think> blocks only after the last user question)")


def main() -> None:
    args = base_parser(__doc__.splitlines()[0]).parse_args()
    setup(args)
    print(machine())
    part1_train()
    ours = part2_qwen3()
    part3_chat(ours)


if __name__ == "__main__":
    main()
