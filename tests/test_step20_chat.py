"""Lesson 20's terminal chat (chat.py): the conversation it sends, its commands, its errors, and,
through a pseudo-terminal, Ctrl-C stopping a reply (the server aborts it) without ending the chat."""
from __future__ import annotations

import sys
import threading
import time
from types import SimpleNamespace

import pytest

from step18_benchmark import frontend
from step19_real_model.llm import LLM
from step19_real_model.params import SamplingParams
from step20_http_serve.api import build_app
from step20_http_serve.async_llm import AsyncLLM
from step20_http_serve.chat import ChatError, ChatSession, Endpoint, run_chat, served_model
from step20_http_serve.server import ServerThread

MODEL = "smollm2-chat"
SYSTEM, QUESTION = "Answer in one word.", "What colour is the sky?"


@pytest.fixture(scope="module")
def server(smol_dir):
    llm = LLM(smol_dir, dtype="fp32", enforce_eager=True, max_num_seqs=8)
    first = llm.chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
                     SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0].text   # before the engine thread owns llm
    engine = AsyncLLM(llm, MODEL)
    try:
        with ServerThread(build_app(engine)) as url:
            yield SimpleNamespace(url=url, llm=llm, first=first)
    finally:
        engine.shutdown()


def _session(url: str, **kw) -> ChatSession:
    endpoint = Endpoint.parse(f"{url}/v1")
    return ChatSession(endpoint, served_model(endpoint), max_tokens=kw.pop("max_tokens", 8), temperature=0, **kw)


def test_turns_carry_the_history_and_reset_forgets_it(server):
    chat = _session(server.url, system=SYSTEM)
    assert chat.model == MODEL
    first = "".join(chat.reply(QUESTION))
    assert first == server.first                      # the streamed pieces, joined = lesson 19's LLM.chat
    assert chat.history == [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": first}]
    assert [m["role"] for m in chat.messages("And grass?")] == ["system", "user", "assistant", "user"]
    second = "".join(chat.reply("And grass?"))
    assert second and len(chat.history) == 4
    chat.reset()
    assert chat.history == [] and chat.messages("hi")[0] == {"role": "system", "content": SYSTEM}


def test_commands_and_a_refused_request_keep_the_chat_going(server):
    chat = _session(server.url)
    chat.model = "no-such-model"                       # the server answers 404 naming the model it has
    lines = iter(["/system Be brief.", "hello", "/bogus", "/reset", "/quit", "never read"])
    out = []
    run_chat(chat, read=lambda prompt: next(lines), out=SimpleNamespace(write=out.append, flush=lambda: None))
    text = "".join(out)
    assert "system prompt set" in text and chat.system == "Be brief."
    assert "error: the server answered 404" in text and MODEL in text
    assert "unknown command '/bogus'" in text and "conversation forgotten" in text
    assert next(lines) == "never read"                  # /quit left the loop
    assert chat.history == []                           # a refused turn is not kept


def test_unreachable_server_and_bad_url_are_clear_errors():
    with pytest.raises(ChatError, match="cannot reach http://127.0.0.1:9/v1"):
        served_model(Endpoint.parse("http://127.0.0.1:9/v1"), timeout_s=5)
    with pytest.raises(ChatError, match="--url must look like"):
        Endpoint.parse("ftp://example.org")


@pytest.mark.slow
def test_ctrl_c_stops_the_reply_the_server_aborts_it_and_the_chat_goes_on(server, monkeypatch):
    pexpect = pytest.importorskip("pexpect")
    aborted = threading.Event()
    real_abort = frontend.abort

    def abort(engine, seq):                              # the engine thread, when the client hung up
        aborted.set()
        real_abort(engine, seq)

    monkeypatch.setattr(frontend, "abort", abort)
    child = pexpect.spawn(sys.executable, ["-m", "step20_http_serve", "chat", "--url", f"{server.url}/v1",
                                           "--max-tokens", "96", "--temperature", "0", "--ignore-eos"],
                          encoding="utf-8", timeout=120)
    try:
        child.expect(f"chatting with {MODEL}")
        child.expect("> ")
        child.sendline("What is the capital of France?")      # a two-turn conversation first
        child.expect(r"Paris.*\r\n> ")
        child.sendline("Tell me a long story about a dragon.")
        child.expect(r"dragon\.\r\n\s*\w")                         # past the echo: the reply is streaming
        child.sendintr()
        child.expect(r"reply stopped; this turn is not kept\)\r\n> ")
        assert aborted.wait(10), "the server never aborted the request"
        stats = server.llm.engine.stats()
        deadline = time.monotonic() + 10
        while (stats.num_running or stats.kv_blocks_used) and time.monotonic() < deadline:
            time.sleep(0.05)
            stats = server.llm.engine.stats()
        assert stats.num_running == 0 and stats.kv_blocks_used == 0
        child.sendline("/reset")
        child.expect(r"conversation forgotten\)\r\n> ")         # up to the next prompt
        child.sendline("What is 2+2?")                          # the chat still answers
        child.expect(r"2\+2\?\r\n")                             # the echo
        child.expect(r"\r\n> ", timeout=120)                    # the reply, then the prompt
        assert child.before.strip()
        child.sendeof()                                         # at the prompt: the chat ends
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
