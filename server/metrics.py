"""Prometheus metrics (prefix ``augur_``), one registry per app so several apps can share a process."""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 20, 60)


class TokenRate:
    """Output tokens per second over a sliding window, fed from the engine thread."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._events: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()

    def add(self, n: int, now: float | None = None) -> None:
        if n <= 0:
            return
        now = time.monotonic() if now is None else now
        with self._lock:
            self._events.append((now, n))
            self._trim(now)

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        with self._lock:
            self._trim(now)
            return sum(n for _, n in self._events) / self.window_s

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window_s:
            self._events.popleft()


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        labels = {"model_name": model_name}
        self.labels = labels
        self.prompt_tokens = Counter("augur_prompt_tokens", "Prompt tokens processed", ["model_name"], registry=r)
        self.generation_tokens = Counter("augur_generation_tokens", "Tokens generated", ["model_name"], registry=r)
        self.request_success = Counter(
            "augur_request_success", "Requests finished", ["model_name", "finish_reason"], registry=r
        )
        self.request_failure = Counter(
            "augur_request_failure", "Requests that failed", ["model_name", "reason"], registry=r
        )
        self.ttft = Histogram(
            "augur_time_to_first_token_seconds",
            "Time to first token",
            ["model_name"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "augur_inter_token_latency_seconds",
            "Time between consecutive outputs of a request, per token",
            ["model_name"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "augur_time_per_output_token_seconds",
            "Mean time per output token after the first, per request",
            ["model_name"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "augur_e2e_request_latency_seconds",
            "End-to-end request latency",
            ["model_name"],
            buckets=_LATENCY_BUCKETS + (120, 300),
            registry=r,
        )
        self.running = Gauge("augur_num_requests_running", "Requests running in the engine", ["model_name"], registry=r)
        self.waiting = Gauge("augur_num_requests_waiting", "Requests waiting to run", ["model_name"], registry=r)
        self.kv_usage = Gauge("augur_kv_cache_usage_ratio", "Fraction of KV blocks in use", ["model_name"], registry=r)
        self.tokens_per_s = Gauge(
            "augur_generation_tokens_per_second", "Output tokens/s over a 10 s window", ["model_name"], registry=r
        )
        self.token_rate = TokenRate()
        self.tokens_per_s.labels(**labels).set_function(self.token_rate.rate)

    def bind_engine(self, engine) -> None:
        """Gauges read the engine's state at scrape time (approximate reads of another thread's lists)."""
        self.running.labels(**self.labels).set_function(lambda: engine.num_requests_running)
        self.waiting.labels(**self.labels).set_function(lambda: engine.num_requests_waiting)
        self.kv_usage.labels(**self.labels).set_function(lambda: engine.block_manager.usage)

    def on_step(self, outputs, _elapsed: float) -> None:
        self.token_rate.add(sum(len(c.delta_token_ids) for o in outputs for c in o.outputs))

    def render(self) -> bytes:
        return generate_latest(self.registry)
