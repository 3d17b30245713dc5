"""Lesson 19: the LLM API on the embedded checkpoint: equal to lesson 05 and to HF token for
token, n/seed, stop strings and stop tokens with vLLM's semantics, logprobs against HF's
log-softmax, incremental detokenization of multi-byte text, clear errors, nothing left behind."""
from __future__ import annotations

import pytest
import torch

from minivllm_support.models import chat_prompt_ids, qwen3_tokenizer_json
from step19_real_model.detokenizer import IncrementalDetokenizer
from step19_real_model.llm import LLM, render_chat
from step19_real_model.params import SamplingParams

TEXTS = {
    "chinese": "你好，世界！今天的天气很好，我们去公园散步吧。",
    "emoji": "Party time 🎉🥳 with family 👨‍👩‍👧‍👦 and flags 🇫🇷!",
    "code": "def area(r: float) -> float:\n    return 3.14159 * r ** 2  # πr²\n",
}


@pytest.fixture(scope="module")
def llm(smol_dir):
    engine = LLM(smol_dir, dtype="fp32", enforce_eager=True, max_num_seqs=8)
    yield engine
    engine.close()


def _idle(llm: LLM) -> None:
    s = llm.engine.stats()
    assert (s.num_running, s.num_waiting, s.kv_blocks_used) == (0, 0, 0)


# ---- the same tokens as before -------------------------------------------------------------
def test_greedy_equals_lesson05(llm, engine_workload):
    prompts, params, ref = engine_workload
    outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=p.max_tokens) for p in params],
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert [o.prompt_token_ids for o in outs] == prompts
    for o, r, p in zip(outs, ref, params):
        c = o.outputs[0]
        assert c.finish_reason == ("length" if len(r) == p.max_tokens else "stop")
        assert c.metrics.ttft > 0 and c.metrics.e2e >= c.metrics.ttft
    _idle(llm)


def test_chat_and_text_equal_hf(llm, smol_hf, smol_tokenizer):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(question, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert out.prompt_token_ids == chat_prompt_ids(smol_tokenizer, question[0]["content"])
    ids = torch.tensor([out.prompt_token_ids])
    eos = llm.engine.eos_ids
    hf = smol_hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                          eos_token_id=eos, pad_token_id=eos[0])
    assert out.outputs[0].token_ids == hf[0, ids.shape[1]:].tolist()
    assert out.outputs[0].text == smol_tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)
    text = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
    assert text.prompt == "The capital of France is"
    assert text.prompt_token_ids == smol_tokenizer.encode("The capital of France is")


# ---- n, seed -------------------------------------------------------------------------------
def test_n_and_seed(llm):
    sp = SamplingParams(temperature=1.0, n=3, seed=11, max_tokens=12, ignore_eos=True)
    a = llm.generate("Once upon a time", sp, use_tqdm=False)[0]
    b = llm.generate("Once upon a time", sp, use_tqdm=False)[0]
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]      # reproducible
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1                            # and not copies
    single = llm.generate("Once upon a time", SamplingParams(temperature=1.0, seed=12, max_tokens=12, ignore_eos=True),
                          use_tqdm=False)[0]
    assert single.outputs[0].token_ids == a.outputs[1].token_ids                       # completion i: seed + i
    _idle(llm)


# ---- stop conditions -----------------------------------------------------------------------
def test_stop_string_is_cut_and_ends_the_request(llm):
    prompt = "The capital of France is"
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    words = full.text.split()
    stop = words[1][1:] + " " + words[2][:2]        # starts inside one word, ends inside another
    cut = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=["zzz", stop]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.text == full.text[:full.text.index(stop)]
    assert (cut.finish_reason, cut.stop_reason) == ("stop", stop)
    assert cut.token_ids == full.token_ids[:len(cut.token_ids)] and len(cut.token_ids) < len(full.token_ids)
    kept = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=stop,
                                               include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == full.text[:full.text.index(stop) + len(stop)]
    _idle(llm)                                        # the aborted requests' blocks are free again


def test_stop_token_ids(llm):
    prompt = "The capital of France is"
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    stop_id = full.token_ids[2]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop_token_ids=[stop_id]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full.token_ids[:3]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
    assert out.text == llm.tokenizer.decode(full.token_ids[:2])          # the stop token's text is left out


# ---- logprobs ------------------------------------------------------------------------------
def test_logprobs_match_hf_log_softmax(llm, smol_hf):
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4, logprobs=3),
                       use_tqdm=False)[0]
    c = out.outputs[0]
    assert len(c.logprobs) == len(c.token_ids) == 4
    ids = torch.tensor([out.prompt_token_ids + c.token_ids])
    ref = torch.log_softmax(smol_hf(ids).logits[0].float(), dim=-1)[len(out.prompt_token_ids) - 1:-1]
    for step, (entry, tok) in enumerate(zip(c.logprobs, c.token_ids)):
        assert list(entry)[0] == tok and entry[tok].rank == 1                   # the chosen first; greedy: rank 1
        assert 3 <= len(entry) <= 4
        top = ref[step].topk(3)
        assert [t for t in entry if entry[t].rank <= 3] == top.indices.tolist()
        for t, lp in entry.items():
            assert lp.logprob == pytest.approx(ref[step, t].item(), abs=1e-3)
            assert lp.decoded_token == llm.tokenizer.decode([t])
    assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for e, t in zip(c.logprobs, c.token_ids)))
    sampled = llm.generate("Hi", SamplingParams(temperature=1.5, seed=3, max_tokens=6, logprobs=0), use_tqdm=False)[0]
    for entry, tok in zip(sampled.outputs[0].logprobs, sampled.outputs[0].token_ids):
        assert list(entry) == [tok] and entry[tok].rank >= 1                    # logprobs=0: the chosen only


# ---- incremental detokenization ------------------------------------------------------------
def _stream(tokenizer, ids: list[int], params: SamplingParams) -> tuple[list[str], IncrementalDetokenizer]:
    d = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say: "), params)
    pieces = []
    for t in ids:
        pieces.append(d.add(t))
        if d.stop_string is not None:
            break
    pieces.append(d.flush())
    return pieces, d


@pytest.fixture(scope="module")
def qwen3_tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(qwen3_tokenizer_json().parent))


@pytest.mark.parametrize("kind", sorted(TEXTS))
def test_streamed_pieces_concatenate_to_the_full_decode(kind, smol_tokenizer, qwen3_tokenizer):
    for tok in (smol_tokenizer, qwen3_tokenizer):
        ids = tok.encode(TEXTS[kind], add_special_tokens=False)
        pieces, d = _stream(tok, ids, SamplingParams())
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True) == TEXTS[kind]
        assert all("\ufffd" not in p for p in pieces)            # never half a character
        assert d.output_text == TEXTS[kind]
    # a split character really happens in these texts: some token decodes to U+FFFD alone
    assert any("\ufffd" in smol_tokenizer.decode([t]) for t in smol_tokenizer.encode(TEXTS["chinese"]))


def test_stop_string_across_tokens_is_held_back_and_cut(smol_tokenizer):
    text = TEXTS["code"]
    ids = smol_tokenizer.encode(text)
    stop = "* r **"                                   # spans several tokens
    pieces, d = _stream(smol_tokenizer, ids, SamplingParams(stop=["never there", stop]))
    assert d.stop_string == stop and "".join(pieces) == text[:text.index(stop)]
    # nothing handed out was later taken back: every piece is a prefix piece of the final text
    assert d.output_text.startswith("".join(pieces))
    # a longer stop list holds back more, but releases all of it at the end
    pieces, d = _stream(smol_tokenizer, ids, SamplingParams(stop=["x" * 12]))
    assert d.stop_string is None and "".join(pieces) == text and pieces[-1] != ""


def test_special_tokens_skipped_or_kept(smol_tokenizer):
    ids = smol_tokenizer.encode("<|im_start|>assistant\nHi<|im_end|>")
    assert "".join(_stream(smol_tokenizer, ids, SamplingParams(ignore_eos=True))[0]) == "assistant\nHi"
    kept = _stream(smol_tokenizer, ids, SamplingParams(ignore_eos=True, skip_special_tokens=False))[0]
    assert "".join(kept) == "<|im_start|>assistant\nHi<|im_end|>"


def test_qwen3_thinking_switch_reaches_the_template(qwen3_tokenizer):
    messages = [{"role": "user", "content": "2+2?"}]
    on = render_chat(qwen3_tokenizer, messages)
    off = render_chat(qwen3_tokenizer, messages, {"enable_thinking": False})
    assert on.endswith("<|im_start|>assistant\n") and off.endswith("<think>\n\n</think>\n\n")


# ---- bad input -----------------------------------------------------------------------------
@pytest.mark.parametrize("call, words", [
    (lambda llm: llm.generate([[1, 2, 10**7]]), "out of range [0, 49152): [10000000]"),
    (lambda llm: llm.generate(["ok", 5]), "prompt 1"),
    (lambda llm: llm.generate(5), "prompts must be"),
    (lambda llm: llm.generate([[]]), "prompt 0"),
    (lambda llm: llm.generate("hi", SamplingParams(max_tokens=10**5)), "max_model_len"),
    (lambda llm: llm.generate(["a", "b"], [SamplingParams()]), "1 SamplingParams for 2 prompts"),
    (lambda llm: llm.chat([]), "messages must be a non-empty list"),
    (lambda llm: llm.chat([{"role": "wizard", "content": "hi"}]), "messages[0].role"),
    (lambda llm: llm.chat([{"role": "user", "content": 5}]), "messages[0].content"),
    (lambda llm: SamplingParams(n=0), "SamplingParams.n"),
    (lambda llm: SamplingParams(stop=[""]), "SamplingParams.stop"),
    (lambda llm: SamplingParams(logprobs=21), "SamplingParams.logprobs"),
    (lambda llm: LLM(dtype="fp8"), "dtype must be one of"),
])
def test_bad_input_is_named_and_nothing_reaches_the_engine(llm, call, words):
    with pytest.raises((ValueError, TypeError)) as err:
        call(llm)
    assert words in str(err.value)
    _idle(llm)


def test_an_error_mid_run_leaves_the_engine_empty(llm, monkeypatch):
    real_step, calls = llm.engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(llm.engine, "step", failing_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["one", "two", "three"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                     use_tqdm=False)
    monkeypatch.undo()
    assert not llm.engine.has_unfinished()
    _idle(llm)
