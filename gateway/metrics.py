"""Prometheus metrics of one app (own registry, so several apps in one process do not collide)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("moegate_requests_total", "HTTP requests answered", ["route", "status"], registry=r)
        self.latency = Histogram("moegate_request_duration_seconds", "Request latency (to the last byte)",
                                 ["route"], registry=r,
                                 buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
        self.ttft = Histogram("moegate_time_to_first_token_seconds", "Time to the first streamed token",
                              ["route"], registry=r, buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.tokens = Counter("moegate_tokens_total", "Tokens processed", ["kind"], registry=r)
        self.mode = Counter("moegate_requests_by_mode_total", "Requests by initial mode", ["mode"], registry=r)
        self.switches = Counter("moegate_mode_switches_total", "Segment mode switches", ["to", "segment"], registry=r)
        self.validations = Counter("moegate_validations_total", "Structured validations", ["kind", "result"],
                                   registry=r)
        self.retries = Counter("moegate_strict_retries_total", "Strict regenerations after a failed validation",
                               registry=r)
        self.aborts = Counter("moegate_aborted_requests_total", "Requests aborted (disconnect, timeout)", ["reason"],
                              registry=r)
        self.rejected = Counter("moegate_rejected_requests_total", "Requests refused before generation", ["reason"],
                                registry=r)
        self.in_flight = Gauge("moegate_requests_in_flight", "Generation requests in flight", registry=r)
        self.engine_active = Gauge("moegate_engine_sequences", "Sequences in the engine", registry=r)
        self.prefix_cache = Gauge("moegate_prefix_cache", "Prefix-cache counters per tier (engine)",
                                  ["tier", "counter"], registry=r)
        self.hot_set = Gauge("moegate_hot_set", "Dynamic hot set (engine): version, swaps, pending, hit_rate",
                             ["counter"], registry=r)
        self.engine_steps = Gauge("moegate_engine_steps", "Engine steps since start (engine loop thread): steps, "
                                  "sequences and tokens output, wall_seconds and thread_cpu_seconds inside the steps, "
                                  "idle_seconds waiting for work", ["counter"], registry=r)
        self.multi_token = Gauge("moegate_multi_token_tokens", "Multi-token decoding (engine): forced (jump-forward), "
                                 "sampled, drafted and accepted tokens since start", ["counter"], registry=r)

    def render(self, llm=None) -> bytes:
        """The exposition text; engine gauges are read from `llm` at scrape time."""
        if llm is not None:
            self.engine_active.set(llm.num_active)
            stats = llm.cache_stats() if hasattr(llm, "cache_stats") else {}
            for tier, counters in stats.items():
                for name, value in counters.items():
                    if isinstance(value, int | float):
                        self.prefix_cache.labels(tier, name).set(value)
            hot = getattr(getattr(llm, "engine", None), "hot_set", None)
            for name, value in (hot.stats() if hot is not None else {}).items():
                self.hot_set.labels(name).set(value)
            steps = getattr(llm, "step_stats", None)
            for name, value in (steps.as_dict() if steps is not None else {}).items():
                self.engine_steps.labels(name).set(value)
            decoder = getattr(getattr(llm, "engine", None), "decoder", None)
            for name, value in (decoder.stats.as_dict() if decoder is not None else {}).items():
                self.multi_token.labels(name).set(value)
        return generate_latest(self.registry)
