"""The server's Prometheus metrics (`GET /metrics`, text format), in a registry of its own
so that several servers in one process (tests) do not collide."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "compilecore:requests", "Finished HTTP generation requests by status",
            ["status"], registry=self.registry,
        )  # fmt: skip
        self.ttft = Histogram(
            "compilecore:time_to_first_token_seconds", "Time to the first output token",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.itl = Histogram(
            "compilecore:inter_token_latency_seconds", "Time between output tokens",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.running = Gauge("compilecore:num_requests_running", "Running requests",
                             registry=self.registry)  # fmt: skip
        self.waiting = Gauge("compilecore:num_requests_waiting", "Waiting requests",
                             registry=self.registry)  # fmt: skip
        self.kv_usage = Gauge("compilecore:kv_cache_usage_perc", "KV-cache blocks in use (0-1)",
                              registry=self.registry)  # fmt: skip

    def count(self, status: str) -> None:
        self.requests.labels(status=status).inc()

    def observe_token(self, seconds: float, first: bool) -> None:
        (self.ttft if first else self.itl).observe(seconds)

    def render(self, stats: dict[str, Any]) -> str:
        self.running.set(stats["running"])
        self.waiting.set(stats["waiting"])
        self.kv_usage.set(stats["kv_cache_usage"])
        return generate_latest(self.registry).decode()
