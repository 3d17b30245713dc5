"""python -m step20_http_serve chat [--url URL]: talk to a model from the terminal.

    you type            ChatSession                               the server (this lesson's)
    "hello"   ---->  messages = [system?, ...history, user]  --POST /v1/chat/completions-->
                     prints each delta as it arrives        <--- data: {"choices": [{"delta": ...}]}
    Ctrl-C    ---->  closes the connection                  ---> sees the disconnect, aborts the
                     (the turn is dropped, the chat goes on)      request, frees its KV blocks

With --url it talks to any OpenAI-compatible server (this lesson's, vLLM's). Without it, it
starts this lesson's server inside the process on a free local port (the embedded model unless
--model says otherwise) and talks to that over HTTP the same way, so the two cases are one path.
The client is the standard library's http.client: a reply is read line by line in this thread,
so Ctrl-C lands in the read, and closing the socket is the whole of the cancellation.

Commands: /reset (forget the conversation, keep the system prompt), /system TEXT (a new system
prompt; forgets the conversation), /quit or Ctrl-D (leave).
"""
from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import signal
import sys
from dataclasses import dataclass, field
from typing import Iterator
from urllib.parse import urlsplit

HELP = "/reset forgets the conversation, /system TEXT sets a system prompt, /quit or Ctrl-D leaves; Ctrl-C stops a reply"


class ChatError(RuntimeError):
    """The server could not be reached or refused the request: the message says which and why."""


@dataclass
class Endpoint:
    host: str
    port: int
    prefix: str                     # "" or "/v1"-less path part of the URL

    @classmethod
    def parse(cls, url: str) -> "Endpoint":
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme != "http" or not parts.hostname:
            raise ChatError(f"--url must look like http://HOST:PORT[/v1], got {url!r}")
        path = parts.path.rstrip("/")
        return cls(parts.hostname, parts.port or 80, path[:-3] if path.endswith("/v1") else path)

    def connect(self, timeout_s: float) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout_s)

    def url(self) -> str:
        return f"http://{self.host}:{self.port}{self.prefix}/v1"


def _error_text(resp: http.client.HTTPResponse) -> str:
    body = resp.read().decode(errors="replace")
    with contextlib.suppress(ValueError, KeyError, TypeError):
        return json.loads(body)["error"]["message"]
    return body.strip()[:300] or resp.reason


def served_model(endpoint: Endpoint, timeout_s: float = 30.0) -> str:
    """The first model /v1/models lists, as `vllm chat` picks one when none is named."""
    conn = endpoint.connect(timeout_s)
    try:
        conn.request("GET", f"{endpoint.prefix}/v1/models")
        resp = conn.getresponse()
        if resp.status != 200:
            raise ChatError(f"{endpoint.url()}/models answered {resp.status}: {_error_text(resp)}")
        models = json.loads(resp.read())["data"]
    except OSError as e:
        raise ChatError(f"cannot reach {endpoint.url()}: {e}") from None
    finally:
        conn.close()
    if not models:
        raise ChatError(f"{endpoint.url()} serves no model")
    return models[0]["id"]


@dataclass
class ChatSession:
    """One conversation: the history it sends with every turn and the sampling it asks for."""
    endpoint: Endpoint
    model: str
    system: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    ignore_eos: bool = False          # vLLM's extension field; makes replies as long as max_tokens
    timeout_s: float = 600.0
    history: list[dict] = field(default_factory=list)

    def messages(self, user: str) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.history + [{"role": "user", "content": user}]

    def reset(self) -> None:
        self.history.clear()

    def body(self, user: str) -> dict:
        body = {"model": self.model, "messages": self.messages(user), "stream": True}
        body.update({k: v for k, v in (("max_tokens", self.max_tokens), ("temperature", self.temperature)) if v is not None})
        if self.ignore_eos:
            body["ignore_eos"] = True
        return body

    def reply(self, user: str) -> Iterator[str]:
        """Yield the reply's text as it streams. The turn joins the history only once the reply is
        complete: a reply cut off by Ctrl-C (or an error) leaves the history as it was. Leaving the
        iterator early closes the connection, which is how the server learns of the abort."""
        conn = self.endpoint.connect(self.timeout_s)
        pieces: list[str] = []
        try:
            try:
                conn.request("POST", f"{self.endpoint.prefix}/v1/chat/completions", json.dumps(self.body(user)),
                             {"Content-Type": "application/json"})
                resp = conn.getresponse()
            except OSError as e:
                raise ChatError(f"cannot reach {self.endpoint.url()}: {e}") from None
            if resp.status != 200:
                raise ChatError(f"the server answered {resp.status}: {_error_text(resp)}")
            for text in _deltas(resp):
                pieces.append(text)
                yield text
        finally:
            conn.close()
        self.history += [{"role": "user", "content": user}, {"role": "assistant", "content": "".join(pieces)}]


def _deltas(resp: http.client.HTTPResponse) -> Iterator[str]:
    """The content pieces of a chat completion stream (Server-Sent Events), until [DONE]."""
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue                                  # blank separators, comments
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        chunk = json.loads(data)
        if "error" in chunk:
            raise ChatError(f"the server stopped the reply: {chunk['error'].get('message', chunk['error'])}")
        for choice in chunk.get("choices", []):
            text = choice.get("delta", {}).get("content")
            if text:
                yield text
    raise ChatError("the stream ended before [DONE]: the server went away mid-reply")


def run_chat(session: ChatSession, read=input, out=sys.stdout) -> None:
    """The loop: read a line, run a command or send it, print the reply as it streams."""
    while True:
        try:
            line = read("> ")
        except EOFError:                                 # Ctrl-D
            print(file=out)
            return
        except KeyboardInterrupt:                        # Ctrl-C at the prompt: a fresh line, as a shell does
            print(file=out)
            continue
        text = line.strip()
        if not text:
            continue
        if text in ("/quit", "/exit"):
            return
        if text == "/reset":
            session.reset()
            print("(conversation forgotten)", file=out, flush=True)
            continue
        if text == "/system" or text.startswith("/system "):
            session.system = text[len("/system"):].strip() or None
            session.reset()
            print(f"(system prompt {'set' if session.system else 'removed'}; conversation forgotten)", file=out, flush=True)
            continue
        if text.startswith("/"):
            print(f"unknown command {text.split()[0]!r}: {HELP}", file=out, flush=True)
            continue
        stream = session.reply(text)
        try:
            for piece in stream:
                print(piece, end="", file=out, flush=True)
            print(file=out, flush=True)
        except KeyboardInterrupt:
            stream.close()                               # closes the connection: the server aborts
            print("\n(reply stopped; this turn is not kept)", file=out, flush=True)
        except ChatError as e:
            print(f"\nerror: {e}", file=out, flush=True)


@contextlib.contextmanager
def local_server(model: str | None, dtype: str, enforce_eager: bool, kv_cache_mib: int) -> Iterator[str]:
    """This lesson's server on a free local port inside this process, for as long as the chat runs."""
    from step20_http_serve.server import ServerThread, build_server   # torch and the engine: only when needed
    app, engine = build_server(model, dtype=dtype, enforce_eager=enforce_eager, kv_cache_bytes=kv_cache_mib * 2**20)
    try:
        with ServerThread(app) as url:
            yield url
    finally:
        engine.shutdown()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m step20_http_serve chat", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="an OpenAI-compatible server, e.g. http://localhost:8000/v1 "
                   "(default: start this lesson's server in this process)")
    p.add_argument("--model-name", default=None, help="the model to ask for (default: the first /v1/models lists)")
    p.add_argument("--system-prompt", default=None)
    p.add_argument("-q", "--quick", metavar="MESSAGE", default=None, help="send one message, print the reply, exit")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--ignore-eos", action="store_true", help="vLLM's extension: replies run to --max-tokens")
    local = p.add_argument_group("without --url: the in-process server")
    local.add_argument("--model", default=None, help="checkpoint folder (default: $MINIVLLM_MODEL, a cached "
                       "Qwen3-0.6B, else the embedded SmolLM2-135M-Instruct)")
    local.add_argument("--dtype", default="auto", choices=["auto", "bf16", "bfloat16", "fp32", "float32"])
    local.add_argument("--enforce-eager", action="store_true", help="skip compiling the decode step (starts faster)")
    local.add_argument("--kv-cache-mib", type=int, default=256)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    # Ctrl-C must reach the reply loop even when the chat was started from a place that ignores
    # SIGINT (a background job of a shell does, and Python then leaves it ignored).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if args.max_tokens is not None and args.max_tokens < 1:
        parser().error("--max-tokens must be at least 1")
    with contextlib.ExitStack() as stack:
        url = args.url
        if url is None:
            print("starting the engine in this process ...", file=sys.stderr, flush=True)
            url = stack.enter_context(local_server(args.model, args.dtype, args.enforce_eager, args.kv_cache_mib))
        try:
            endpoint = Endpoint.parse(url)
            model = args.model_name or served_model(endpoint)
        except ChatError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        session = ChatSession(endpoint, model, args.system_prompt, args.max_tokens, args.temperature, args.ignore_eos)
        if args.quick is not None:
            try:
                print("".join(session.reply(args.quick)))
            except ChatError as e:
                print(f"error: {e}", file=sys.stderr)
                return 1
            return 0
        print(f"chatting with {model} at {endpoint.url()}\n{HELP}", flush=True)
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401  (line editing and history for input(), where the platform has it)
        run_chat(session, read=input if sys.stdin.isatty() else _echoed_input)
    return 0


def _echoed_input(prompt: str) -> str:
    """input() for piped lines: echo each one after the prompt, as a terminal would have shown it."""
    line = input(prompt)
    print(line, flush=True)
    return line
