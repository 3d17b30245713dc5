"""What the launcher sends and keeps: a request of the load, and its record, token by token."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PDRequest:
    arrival_s: float              # seconds after the start
    prompt_ids: list[int]
    max_tokens: int


@dataclass
class PDRecord:
    """One request as the launcher saw it; times are time.perf_counter() readings."""
    rid: int
    prompt_len: int
    start: float = 0.0
    prefill_done: float | None = None         # the prefill engine handed over its last layer
    transfer: dict | None = None              # decode side: when the layers landed, bytes
    token_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    fallback: str | None = None               # why the KV was recomputed on the decode side
    retry: str | None = None                  # why the KV was asked for a second time
    prefill_sent: int = 0                     # times sent to a prefill engine (2 after a retry)
    prefill_started: int = 0                  # "started" and "prefilled" heard back, per attempt:
    prefill_finished: int = 0                 # only the latest attempt's news goes to decode
    done: bool = False
    prefill_on: str | None = None             # the engines it was sent to
    decode_on: str = ""
