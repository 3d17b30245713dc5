"""Serving metrics, defined the way `vllm bench serve` defines them, so our numbers and vLLM's
can sit in one table.

    TTFT     time to first token: first token's arrival - request sent. It holds the queueing
             and the prefill, which is what a user waits before anything appears.
    TPOT     time per output token, one value per request: (E2EL - TTFT) / (output tokens - 1).
             The first token is left out because it is TTFT's; a one-token request has none.
    ITL      inter-token latency: every gap between two successive arrivals of a request, all
             requests' gaps pooled. A long stall is one large gap here, averaged away in TPOT.
    E2EL     end-to-end latency: response complete - request sent.
    goodput  requests per second that met every latency limit given (DistServe's measure):
             throughput that users would call good, not just throughput.

A failed request is counted in `failed` and nowhere else: its timings say nothing about the
engine's speed. Statistics are in milliseconds; percentiles use numpy's linear interpolation and
the standard deviation is the population one (np.std), both as vLLM reports them.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass
class RequestRecord:
    """One request as the client saw it; every time is a time.perf_counter() reading."""
    prompt_len: int                 # prompt tokens
    start: float                    # when the request was sent
    token_times: list[float] = field(default_factory=list)   # arrival of each streamed chunk/token
    output_len: int = 0             # tokens generated (the server's usage count when it gives one)
    end: float = 0.0                # when the response completed
    success: bool = True
    error: str = ""

    @property
    def ttft(self) -> float | None:
        """None when nothing arrived: there is no first token to time."""
        return self.token_times[0] - self.start if self.token_times else None

    @property
    def e2el(self) -> float:
        return self.end - self.start

    @property
    def itl(self) -> list[float]:
        return [later - earlier for earlier, later in zip(self.token_times, self.token_times[1:])]

    @property
    def tpot(self) -> float | None:
        # output_len, not the number of chunks: a server may pack several tokens in one chunk,
        # and TPOT is per token.
        if self.output_len <= 1 or self.ttft is None:
            return None
        return (self.e2el - self.ttft) / (self.output_len - 1)


@dataclass
class SLO:
    """Latency limits in milliseconds; None means that metric is not checked."""
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @property
    def given(self) -> bool:
        return any(limit is not None for limit in (self.ttft_ms, self.tpot_ms, self.e2el_ms))

    def met(self, rec: RequestRecord) -> bool:
        """Whether a request meets every limit given (a value equal to its limit meets it)."""
        # A one-token request has no TPOT; vLLM counts it as 0 there, so it always meets the
        # TPOT limit. A request with no first token cannot be said to meet a TTFT limit.
        tpot = rec.tpot if rec.tpot is not None else 0.0
        checks = [(self.ttft_ms, rec.ttft), (self.tpot_ms, tpot), (self.e2el_ms, rec.e2el)]
        return all(_within(value, limit) for limit, value in checks)


def _within(value_s: float | None, limit_ms: float | None) -> bool:
    if limit_ms is None:
        return True
    return value_s is not None and value_s * 1e3 <= limit_ms


@dataclass
class Stats:
    """One metric over a run, in milliseconds."""
    mean: float
    median: float
    p90: float
    p99: float
    std: float


def percentile_stats(values_s: list[float]) -> Stats:
    """Seconds in, milliseconds out; an empty list gives zeros (vLLM's np.mean(x or 0) does too)."""
    if not values_s:
        return Stats(0.0, 0.0, 0.0, 0.0, 0.0)
    ms = np.asarray(values_s, dtype=np.float64) * 1e3
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])       # numpy's default: linear interpolation
    return Stats(mean=float(ms.mean()), median=float(p50), p90=float(p90), p99=float(p99),
                 std=float(ms.std()))


@dataclass
class ServingResult:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float       # completed requests / duration
    output_throughput: float        # output tokens / duration
    total_token_throughput: float   # (input + output tokens) / duration
    goodput: float | None           # requests / s that met every SLO given; None without an SLO
    ttft: Stats
    tpot: Stats
    itl: Stats
    e2el: Stats

    def to_dict(self) -> dict:
        """Plain numbers and nested dicts ({"ttft": {"mean": ...}}), ready for json.dumps."""
        return asdict(self)

    def table(self) -> str:
        """A summary laid out like `vllm bench serve`'s, one metric a line."""
        lines = [_title(" Serving Benchmark Result ", "=")]
        lines += [_row(label, value) for label, value in self._totals()]
        for name, title, stats in self._latencies():
            lines.append(_title(title, "-"))
            for stat in ("mean", "median", "p90", "p99"):
                lines.append(_row(f"{stat.capitalize()} {name} (ms):", f"{getattr(stats, stat):.2f}"))
        lines.append("=" * _WIDTH)
        return "\n".join(lines)

    def _totals(self) -> list[tuple[str, str]]:
        rows = [("Successful requests:", f"{self.completed}"),
                ("Failed requests:", f"{self.failed}"),
                ("Benchmark duration (s):", f"{self.duration_s:.2f}"),
                ("Total input tokens:", f"{self.total_input_tokens}"),
                ("Total generated tokens:", f"{self.total_output_tokens}"),
                ("Request throughput (req/s):", f"{self.request_throughput:.2f}"),
                ("Output token throughput (tok/s):", f"{self.output_throughput:.2f}"),
                ("Total token throughput (tok/s):", f"{self.total_token_throughput:.2f}")]
        if self.goodput is not None:
            rows.insert(6, ("Request goodput (req/s):", f"{self.goodput:.2f}"))
        return rows

    def _latencies(self) -> list[tuple[str, str, Stats]]:
        return [("TTFT", "Time to First Token", self.ttft),
                ("TPOT", "Time per Output Token (excl. 1st token)", self.tpot),
                ("ITL", "Inter-token Latency", self.itl),
                ("E2EL", "End-to-end Latency", self.e2el)]


_WIDTH = 50


def _title(text: str, fill: str) -> str:
    return text.center(_WIDTH, fill)


def _row(label: str, value: str) -> str:
    return f"{label:<40}{value:>10}"


def _rate(count: float, duration_s: float) -> float:
    # A run that took no measurable time has no meaningful rate; 0 beats a division error.
    return count / duration_s if duration_s > 0 else 0.0


def summarize(records: list[RequestRecord], duration_s: float, slo: SLO | None = None) -> ServingResult:
    """Everything `vllm bench serve` prints, from the records of one run of `duration_s` seconds."""
    ok = [r for r in records if r.success]
    tokens_in = sum(r.prompt_len for r in ok)
    tokens_out = sum(r.output_len for r in ok)
    goodput = None
    if slo is not None and slo.given:
        goodput = _rate(sum(slo.met(r) for r in ok), duration_s)
    return ServingResult(
        completed=len(ok), failed=len(records) - len(ok), duration_s=duration_s,
        total_input_tokens=tokens_in, total_output_tokens=tokens_out,
        request_throughput=_rate(len(ok), duration_s),
        output_throughput=_rate(tokens_out, duration_s),
        total_token_throughput=_rate(tokens_in + tokens_out, duration_s),
        goodput=goodput,
        ttft=percentile_stats([r.ttft for r in ok if r.ttft is not None]),
        tpot=percentile_stats([r.tpot for r in ok if r.tpot is not None]),
        itl=percentile_stats([gap for r in ok for gap in r.itl]),
        e2el=percentile_stats([r.e2el for r in ok]))
