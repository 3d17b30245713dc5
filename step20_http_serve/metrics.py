"""GET /metrics: the engine's state in Prometheus' text format, under vLLM's metric names, so
dashboards and alerts written for vLLM work unchanged.

Two kinds of numbers:
  - the engine's own counts (lesson 14's EngineStats: queues, KV blocks, prefix-cache lookups,
    preemptions, tokens) are read at scrape time by a custom collector: the engine already
    keeps them, so nothing is counted twice and a scrape always sees the current value;
  - latencies exist only per request, so the async layer observes them into histograms when
    a request finishes: TTFT (arrival -> first token), every inter-token gap, end to end.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class EngineCollector(Collector):
    """Gauges and counters straight from engine.stats(), labelled with the served model's name."""

    def __init__(self, engine, model_name: str):
        self.engine, self.labels = engine, [model_name]

    def collect(self):
        s = self.engine.stats()     # read from the event loop while the engine steps: plain ints
        # Blocks the block manager hands out (lesson 16's scratch block is outside them).
        usage = s.kv_blocks_used / max(1, s.kv_blocks_total)
        gauges = [("num_requests_running", "Requests in the running batch.", s.num_running),
                  ("num_requests_waiting", "Requests waiting to be scheduled (new or preempted).", s.num_waiting),
                  ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", usage)]
        counters = [("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries),
                    ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits),
                    ("num_preemptions", "Requests preempted (KV blocks taken back, recomputed later).",
                     s.num_preemptions),
                    ("prompt_tokens", "Prompt tokens computed (prefix-cache hits excluded).", s.prompt_tokens),
                    ("generation_tokens", "Tokens generated.", s.generation_tokens)]
        for name, doc, value in gauges:
            g = GaugeMetricFamily(f"vllm:{name}", doc, labels=["model_name"])
            g.add_metric(self.labels, value)
            yield g
        for name, doc, value in counters:       # exposed as vllm:<name>_total
            c = CounterMetricFamily(f"vllm:{name}", doc, labels=["model_name"])
            c.add_metric(self.labels, value)
            yield c


class ServerMetrics:
    def __init__(self, engine, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine, model_name))

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"vllm:{name}", doc, ["model_name"], buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Gap between successive tokens.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token.", E2E_BUCKETS)
        self._success = Counter("vllm:request_success", "Requests finished, by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)
        self.model_name = model_name

    def observe(self, arrival: float, token_times: list[float], end: float, finish_reason: str) -> None:
        """One finished request (one choice: each of n is an engine request of its own)."""
        if token_times:
            self.ttft.observe(max(0.0, token_times[0] - arrival))
        for earlier, later in zip(token_times, token_times[1:]):
            self.itl.observe(later - earlier)
        self.e2e.observe(end - arrival)
        self._success.labels(self.model_name, finish_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
