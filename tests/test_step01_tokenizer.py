"""Lesson 01: our byte-level BPE against Hugging Face `tokenizers` on the real Qwen3 vocab."""
from __future__ import annotations

import random
import unicodedata

import pytest
from tokenizers import Tokenizer

from minivllm_support.models import qwen3_tokenizer_json
from step01_tokenizer import ByteLevelBPE, bytes_to_unicode, render_chat

MIXED_TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "It's what they're saying: we'll see, I'd guess, you've won.",
    "大语言模型推理引擎把提示词切分成词元，然后逐个生成新的词元。",
    "混合 mixed 文本 with English 和中文, numbers 2024-06-01 and 3.14159.",
    "def add(a: int, b: int) -> int:\n    return a + b\n\nprint(add(2, 40))\n",
    "Emoji: \U0001F600 \U0001F680 \U0001F44D\U0001F3FD \u2764\ufe0f \U0001F468\u200d\U0001F4BB",
    "whitespace:   three spaces,\t\ttwo tabs,\n\n\nthree newlines,    \n  end  ",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n",
    "first document<|endoftext|>second document<|endoftext|>",
    "Café naïve — Ünïcödé, ﬁ ligature, Ω, ½, ², 日本語と한국어",
]

TRAIN_CORPUS = """\
The engine keeps the keys and values of every token in a cache, so the next step only
computes the newest token. The scheduler decides which requests run in each step, and the
sampler decides which token comes next. Tokens are the unit of everything: the engine
counts them, caches them, batches them and bills them.
def generate(model, prompt, steps):
    tokens = tokenize(prompt)
    for step in range(steps):
        tokens.append(sample(model(tokens)))
    return detokenize(tokens)
"""


@pytest.fixture(scope="module")
def ours() -> ByteLevelBPE:
    return ByteLevelBPE.from_tokenizer_json(qwen3_tokenizer_json())


@pytest.fixture(scope="module")
def hf() -> Tokenizer:
    return Tokenizer.from_file(str(qwen3_tokenizer_json()))


EXTRA_TEXTS = [
    "",
    " ",
    "\n\n",
    "   ",
    "\t\tindented\twith\ttabs\n",
    "trailing spaces   \n   leading",
    "a\r\nwindows\r\n\r\nlines",
    "I'M sure they'LL say it's what we've done, didn't they?",
    "价格是 3.14 元，共 12345 件。",
    "e\u0301 vs \u00e9 (NFC makes them one)",
    "\U0001F468\u200d\U0001F469\u200d\U0001F467 family, \U0001F1E8\U0001F1F3 flag, \U0001F600\U0001F600",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|><think>\n\n</think>",
    "<|im_start|<|im_end|>>x<|endoftext|><|endoftext|>",
    "x = {'a': [1, 2, 3]}  # dict\nfor k, v in x.items():\n    print(f\"{k}={v!r}\")\n",
]


def test_bytes_to_unicode_is_a_printable_bijection():
    m = bytes_to_unicode()
    assert sorted(m) == list(range(256))
    assert len(set(m.values())) == 256
    assert all(c.isprintable() and not c.isspace() for c in m.values())
    assert m[ord(" ")] == "Ġ" and m[ord("\n")] == "Ċ" and m[ord("A")] == "A"


def test_loads_real_qwen3_tokenizer(ours, hf):
    assert ours.vocab_size == hf.get_vocab_size(with_added_tokens=True)
    assert ours.normalize == "NFC"
    assert ours.added_tokens["<|im_start|>"] == hf.token_to_id("<|im_start|>")
    assert "<|endoftext|>" in ours.special and "<think>" not in ours.special


@pytest.mark.parametrize("text", MIXED_TEXTS + EXTRA_TEXTS)
def test_same_ids_as_hf(ours, hf, text):
    assert ours.encode(text) == hf.encode(text).ids


def test_same_ids_as_hf_on_joined_corpus(ours, hf):
    corpus = "\n\n".join(MIXED_TEXTS + EXTRA_TEXTS) * 5
    assert len(corpus.encode("utf-8")) > 4000
    ids = ours.encode(corpus)
    assert ids == hf.encode(corpus).ids
    assert ours.decode(ids) == unicodedata.normalize("NFC", corpus)


def test_same_ids_as_hf_on_random_strings(ours, hf):
    # Random mixes of the characters where regexes and normalizers tend to disagree.
    pool = (list("abcXYZ 019'\n\r\t\x0b\x0c\x1c\x1f\x85\xa0\u2028\u3000\u200b!?.,:-_()<>|/\\\"#")
            + list("你好世界日本語한국어éÅ") + ["e\u0301", "\U0001F600", "\U0001F1E8\U0001F1F3",
            "<|im_start|>", "<|endoftext|>", "<think>", "<|im_end", "'S", "'ll", "   ", "\n\n",
            "\t\t", "٣", "½", "²", "ﬁ", "\x00", "𝔘"])
    rnd = random.Random(1234)
    texts = ["".join(rnd.choice(pool) for _ in range(rnd.randint(1, 25))) for _ in range(1500)]
    assert [ours.encode(t) for t in texts] == [e.ids for e in hf.encode_batch(texts)]


def test_allow_special_false_matches_hf_encode_special_tokens(ours):
    hf = Tokenizer.from_file(str(qwen3_tokenizer_json()))
    hf.encode_special_tokens = True
    text = "<|im_start|>user\n<think>x</think><|endoftext|>"
    ids = ours.encode(text, allow_special=False)
    assert ids == hf.encode(text).ids
    assert ours.added_tokens["<|im_start|>"] not in ids
    assert ours.added_tokens["<think>"] in ids


@pytest.mark.parametrize("text", MIXED_TEXTS + EXTRA_TEXTS)
def test_decode_round_trip(ours, hf, text):
    ids = ours.encode(text)
    assert ours.decode(ids) == unicodedata.normalize("NFC", text)
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=False)
    assert ours.decode(ids, skip_special=True) == hf.decode(ids, skip_special_tokens=True)


def test_decode_partial_character_gives_replacement(ours):
    ids = ours.encode("你")
    one_byte = ours.vocab[bytes_to_unicode()["你".encode("utf-8")[0]]]
    assert ours.decode([one_byte]) == "\ufffd"
    assert ours.decode(ids) == "你"


def test_decode_accepts_numpy_integers(ours):
    np = pytest.importorskip("numpy")
    ids = ours.encode("Hello, 世界")
    assert ours.decode(np.array(ids, dtype=np.int64)) == "Hello, 世界"


def test_trained_bpe_is_lossless_on_its_corpus():
    tok = ByteLevelBPE.train(TRAIN_CORPUS, vocab_size=400, special_tokens=("<|endoftext|>",))
    assert len(tok.merges) > 50
    assert tok.vocab_size <= 400
    ids = tok.encode(TRAIN_CORPUS)
    assert tok.decode(ids) == TRAIN_CORPUS
    assert len(ids) < len(TRAIN_CORPUS.encode("utf-8")) / 2  # merges actually compress
    # Any text, even unseen and non-English, round-trips: every byte is in the vocabulary.
    for text in MIXED_TEXTS:
        assert tok.decode(tok.encode(text)) == text
    eot = tok.added_tokens["<|endoftext|>"]
    assert tok.encode("a<|endoftext|>b")[1] == eot


def test_trained_merges_are_frequent_pairs():
    tok = ByteLevelBPE.train("low low low low lower lowest newer newest", vocab_size=260)
    assert tok.merges[0] == ("l", "o")
    assert tok.decode(tok.encode("lowest")) == "lowest"


def test_training_stops_when_pairs_run_out():
    tok = ByteLevelBPE.train("ab ab ab", vocab_size=10_000)
    assert tok.vocab_size < 300


def test_bad_input_errors(ours):
    with pytest.raises(TypeError, match="expects str"):
        ours.encode(b"bytes")
    with pytest.raises(TypeError, match="expects str"):
        ours.encode(None)
    with pytest.raises(ValueError, match=r"token id 999999 at position 1 is out of range"):
        ours.decode([1, 999999])
    with pytest.raises(ValueError, match="out of range"):
        ours.decode([-1])
    with pytest.raises(TypeError, match="expects ints"):
        ours.decode(["a"])
    with pytest.raises(ValueError, match="smaller than"):
        ByteLevelBPE.train("abc", vocab_size=100)
    with pytest.raises(TypeError):
        ByteLevelBPE.train(123, vocab_size=300)


def test_bad_tokenizer_json(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text('{"model": {"type": "WordPiece"}}')
    with pytest.raises(ValueError, match="expected 'BPE'"):
        ByteLevelBPE.from_tokenizer_json(path)


CHATS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "你好"},
     {"role": "assistant", "content": "<think>\nGreet back.\n</think>\n\n你好！"},
     {"role": "user", "content": "Write `x = 1` in code"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}],
    [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "checking"},
     {"role": "tool", "content": "sunny"}, {"role": "tool", "content": "22C"}],
]


@pytest.fixture(scope="module")
def hf_chat():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(qwen3_tokenizer_json().parent))


@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("gen,thinking", [(True, True), (True, False), (False, True)])
def test_chat_template_matches_hf(ours, hf_chat, messages, gen, thinking):
    text = render_chat(messages, add_generation_prompt=gen, enable_thinking=thinking)
    expected = hf_chat.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen,
                                           enable_thinking=thinking)
    assert text == expected
    assert ours.encode(text) == hf_chat(expected, add_special_tokens=False)["input_ids"]


def test_chat_template_shape():
    text = render_chat([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_chat_template_bad_input():
    with pytest.raises(ValueError, match="empty"):
        render_chat([])
    with pytest.raises(ValueError, match="role 'robot'"):
        render_chat([{"role": "robot", "content": "x"}])
    with pytest.raises(TypeError, match="content must be str"):
        render_chat([{"role": "user", "content": 3}])
    with pytest.raises(TypeError, match="list of dicts"):
        render_chat("hello")
