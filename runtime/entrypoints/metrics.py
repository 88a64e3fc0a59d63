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
        # The same quantities under vLLM's names, so vLLM's dashboards find them.
        self.vllm = {
            name: Gauge(f"vllm:{name}", doc, ["model_name"], registry=self.registry)
            for name, doc in (("num_requests_running", "Running requests"),
                              ("num_requests_waiting", "Waiting requests"),
                              ("kv_cache_usage_perc", "KV-cache usage (0-1)"))
        }  # fmt: skip
        self.vllm_ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token",
                                   buckets=_LATENCY_BUCKETS, registry=self.registry)  # fmt: skip
        self.vllm_itl = Histogram("vllm:inter_token_latency_seconds", "Inter-token latency",
                                  buckets=_LATENCY_BUCKETS, registry=self.registry)  # fmt: skip
        # Speculative decoding, vLLM's counters: verification steps, proposed tokens and
        # accepted ones, since the start (zero without speculative_config).
        self.vllm_spec = {
            name: Counter(f"vllm:spec_decode_{name}", doc, ["model_name"], registry=self.registry)
            for name, doc in (("num_drafts", "Verification steps"),
                              ("num_draft_tokens", "Proposed tokens"),
                              ("num_accepted_tokens", "Proposed tokens accepted"))
        }  # fmt: skip
        self._spec_seen = dict.fromkeys(self.vllm_spec, 0)
        self.model_name = "model"

    def count(self, status: str) -> None:
        self.requests.labels(status=status).inc()

    def observe_token(self, seconds: float, first: bool) -> None:
        (self.ttft if first else self.itl).observe(seconds)
        (self.vllm_ttft if first else self.vllm_itl).observe(seconds)

    def render(self, stats: dict[str, Any]) -> str:
        self.running.set(stats["running"])
        self.waiting.set(stats["waiting"])
        self.kv_usage.set(stats["kv_cache_usage"])
        for name, key in (("num_requests_running", "running"),
                          ("num_requests_waiting", "waiting"),
                          ("kv_cache_usage_perc", "kv_cache_usage")):  # fmt: skip
            self.vllm[name].labels(model_name=self.model_name).set(stats[key])
        for name, counter in self.vllm_spec.items():  # the engine's totals: add what is new
            total = stats.get(name, 0)
            counter.labels(model_name=self.model_name).inc(total - self._spec_seen[name])
            self._spec_seen[name] = total
        return generate_latest(self.registry).decode()
