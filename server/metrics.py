"""Prometheus metrics (prefix ``augur_``), one registry per app so several apps can share a process.

With ``compat="vllm"`` (``--metrics-compat vllm``, the default) the same values are also exported under
vLLM's names (:mod:`server.metrics_vllm`), for the routers and dashboards that read those."""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from server.metrics_vllm import VllmMetrics

COMPAT = ("vllm", "none")
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 20, 60)
_E2E_BUCKETS = _LATENCY_BUCKETS + (120, 300)


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
    def __init__(self, model_name: str, compat: str = "vllm") -> None:
        if compat not in COMPAT:
            raise ValueError(f"metrics compat must be one of {COMPAT}, not {compat!r}")
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
            buckets=_E2E_BUCKETS,
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
        # Speculative decoding (label: method, the proposer that drafted: each of auto's under its own name).
        self.spec_drafts = Counter(
            "augur_spec_decode_num_drafts", "Verify steps that carried a draft", ["method"], registry=r
        )
        self.spec_draft_tokens = Counter(
            "augur_spec_decode_num_draft_tokens", "Draft tokens proposed", ["method"], registry=r
        )
        self.spec_accepted_tokens = Counter(
            "augur_spec_decode_num_accepted_tokens", "Draft tokens accepted", ["method"], registry=r
        )
        self.spec_accepted_per_pos = Counter(
            "augur_spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position",
            ["method", "position"],
            registry=r,
        )
        self.lossy_requests = Counter(
            "augur_spec_decode_lossy_requests",
            "Requests verified by a lossy rule they asked for (typical acceptance): not the target's exact output",
            ["model_name", "acceptance"],
            registry=r,
        )
        self.engine_info = Gauge(
            "augur_engine_info",
            "The served engine's layout in its labels (value 1): tensor_parallel_size, the ranks of the target",
            ["model_name", "tensor_parallel_size"],
            registry=r,
        )
        self.spec_acceptance_rate = Gauge(
            "augur_spec_decode_acceptance_rate", "Accepted / drafted tokens over a 60 s window", ["method"], registry=r
        )
        self.spec_mean_acceptance_length = Gauge(
            "augur_spec_decode_mean_acceptance_length",
            "Tokens per verify step over a 60 s window (plain decoding: 1.0)",
            ["method"],
            registry=r,
        )
        # Structured outputs: requests by kind, the host time each spent in its grammar, and what the
        # grammar did to drafts (cut) and to forwards (tokens it forced, emitted without one).
        self.grammar_requests = Counter(
            "augur_structured_requests", "Requests constrained by a grammar", ["model_name", "kind"], registry=r
        )
        self.grammar_seconds = Histogram(
            "augur_structured_grammar_seconds",
            "Host time a constrained request spent in its grammar (masks, advancing, forced tokens)",
            ["model_name"],
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=r,
        )
        self.grammar_tokens = Counter(
            "augur_structured_tokens",
            "Tokens of constrained requests: drafted, cut from drafts by the grammar, forced (no forward)",
            ["model_name", "what"],
            registry=r,
        )
        # The HTTP APIs: generation requests admitted, by endpoint; the Responses API's store.
        self.api_requests = Counter(
            "augur_api_requests", "Generation requests admitted, by endpoint", ["model_name", "endpoint"], registry=r
        )
        self.lora_requests = Counter(
            "augur_lora_requests", "Generation requests admitted under each LoRA adapter", ["model_name", "lora_name"],
            registry=r,
        )  # fmt: skip
        self.lora_spec_tokens = Counter(
            "augur_lora_spec_decode_tokens",
            "Draft tokens verified for the requests of each LoRA adapter, and of those accepted (what: drafted, "
            "accepted)",
            ["model_name", "lora_name", "what"],
            registry=r,
        )
        self.responses_stored = Gauge(
            "augur_responses_stored", "Responses kept for previous_response_id (what: count, bytes)",
            ["model_name", "what"], registry=r,
        )  # fmt: skip
        self._grammar_seen = (0, 0, 0)
        self._spec_window: deque[tuple[float, int, int, int]] = deque()  # (t, drafts, drafted, accepted)
        self._spec_lock = threading.Lock()
        self._spec_seen = (0, 0, 0, [])
        self._spec_by_seen: dict[str, tuple[int, int, int]] = {}  # SpecStats.by_method as last seen
        self._engine = None
        self.vllm = None
        if compat == "vllm":
            buckets = {"ttft": _LATENCY_BUCKETS, "itl": _LATENCY_BUCKETS, "tpot": _LATENCY_BUCKETS, "e2e": _E2E_BUCKETS}
            self.vllm = VllmMetrics(r, model_name, buckets)

    def bind_engine(self, engine) -> None:
        """``engine``: the AsyncEngine. Gauges read ``engine.load``, the load as its thread last
        published it (never the scheduler's queues themselves, which that thread mutates)."""
        self._engine = engine

        def load():
            return engine.load

        self.running.labels(**self.labels).set_function(lambda: load().running)
        self.waiting.labels(**self.labels).set_function(lambda: load().waiting)
        self.kv_usage.labels(**self.labels).set_function(lambda: load().kv_usage)
        self.engine_info.labels(**self.labels, tensor_parallel_size=str(engine.tensor_parallel_size)).set(1)
        method = engine.spec_method
        self.spec_acceptance_rate.labels(method=method).set_function(lambda: self._spec_window_value("rate"))
        self.spec_mean_acceptance_length.labels(method=method).set_function(lambda: self._spec_window_value("mal"))
        if self.vllm is not None:
            self.vllm.bind_engine(engine, load)

    # -- per request: called by the HTTP front as a request's outputs pass --------------------------
    def request_started(self, prompt_tokens: int) -> None:
        self.prompt_tokens.labels(**self.labels).inc(prompt_tokens)
        if self.vllm is not None:
            self.vllm.request_started(prompt_tokens)

    def first_token(self, seconds: float) -> None:
        self.ttft.labels(**self.labels).observe(seconds)
        if self.vllm is not None:
            self.vllm.first_token(seconds)

    def tokens(self, n: int, seconds_per_token: float | None) -> None:
        """``n`` tokens arrived; ``seconds_per_token`` is the gap since the previous output over ``n``
        (None for the first output, whose latency is the time to first token)."""
        self.generation_tokens.labels(**self.labels).inc(n)
        if seconds_per_token is not None:
            self.itl.labels(**self.labels).observe(seconds_per_token)
        if self.vllm is not None:
            self.vllm.tokens(n, seconds_per_token)

    def request_finished(
        self, reason: str, e2e: float, tpot: float | None, prompt_tokens: int, generation_tokens: int, lossy: bool
    ) -> None:
        labels = self.labels
        self.request_success.labels(**labels, finish_reason=reason).inc()
        if lossy:
            self.lossy_requests.labels(**labels, acceptance="typical").inc()
        self.e2e.labels(**labels).observe(e2e)
        if tpot is not None:
            self.tpot.labels(**labels).observe(tpot)
        if self.vllm is not None:
            self.vllm.request_finished(reason, e2e, tpot, prompt_tokens, generation_tokens)

    def lora_speculation(self, lora: str, drafted: int, accepted: int) -> None:
        """A finished request of adapter ``lora``: its draft tokens and those its adapted target kept."""
        self.lora_spec_tokens.labels(**self.labels, lora_name=lora, what="drafted").inc(drafted)
        self.lora_spec_tokens.labels(**self.labels, lora_name=lora, what="accepted").inc(accepted)

    def grammar_request(self, kind: str, seconds: float) -> None:
        self.grammar_requests.labels(**self.labels, kind=kind).inc()
        self.grammar_seconds.labels(**self.labels).observe(seconds)

    def bind_store(self, store) -> None:
        """``store``: the Responses API's :class:`~server.responses.store.ResponseStore`."""
        self.responses_stored.labels(**self.labels, what="count").set_function(lambda: len(store))
        self.responses_stored.labels(**self.labels, what="bytes").set_function(lambda: store.bytes)

    def api_request(self, endpoint: str, lora: str | None = None) -> None:
        self.api_requests.labels(**self.labels, endpoint=endpoint).inc()
        if lora is not None:
            self.lora_requests.labels(**self.labels, lora_name=lora).inc()

    def request_failed(self, reason: str) -> None:
        self.request_failure.labels(**self.labels, reason=reason).inc()
        if self.vllm is not None:
            self.vllm.request_failed(reason)

    def on_step(self, outputs, _elapsed: float) -> None:
        """Runs on the engine thread after each step."""
        self.token_rate.add(sum(len(c.delta_token_ids) for o in outputs for c in o.outputs))
        if self._engine is None:
            return
        grammar = self._engine.grammar_stats
        for what, now, before in zip(("drafted", "cut", "forced"), grammar, self._grammar_seen):
            if now > before:
                self.grammar_tokens.labels(**self.labels, what=what).inc(now - before)
        self._grammar_seen = grammar
        st = self._engine.spec_stats
        drafts, drafted, accepted, per_pos = self._spec_seen
        d_drafts, d_drafted, d_acc = (
            st.num_drafts - drafts,
            st.num_draft_tokens - drafted,
            st.num_accepted_tokens - accepted,
        )
        if d_drafts:
            method = self._engine.spec_method
            # Per proposer (the one that drafted: each of auto's under its own name).
            for name, (n, tokens, kept) in st.by_method.items():
                was = self._spec_by_seen.get(name, (0, 0, 0))
                label = name or method
                if n > was[0]:
                    self.spec_drafts.labels(method=label).inc(n - was[0])
                    self.spec_draft_tokens.labels(method=label).inc(tokens - was[1])
                    self.spec_accepted_tokens.labels(method=label).inc(kept - was[2])
            self._spec_by_seen = {name: tuple(v) for name, v in st.by_method.items()}
            new_per_pos = {}
            for pos, count in enumerate(st.accepted_per_pos):
                prev = per_pos[pos] if pos < len(per_pos) else 0
                if count > prev:
                    new_per_pos[pos] = count - prev
                    self.spec_accepted_per_pos.labels(method=method, position=str(pos)).inc(count - prev)
            if self.vllm is not None:
                self.vllm.spec_step(d_drafts, d_drafted, d_acc, new_per_pos)
            with self._spec_lock:
                self._spec_window.append((time.monotonic(), d_drafts, d_drafted, d_acc))
        self._spec_seen = (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens, list(st.accepted_per_pos))

    def _spec_window_value(self, which: str, window_s: float = 60.0) -> float:
        now = time.monotonic()
        with self._spec_lock:
            while self._spec_window and self._spec_window[0][0] < now - window_s:
                self._spec_window.popleft()
            drafts = sum(x[1] for x in self._spec_window)
            drafted = sum(x[2] for x in self._spec_window)
            accepted = sum(x[3] for x in self._spec_window)
        if which == "rate":
            return accepted / drafted if drafted else 0.0
        return 1.0 + accepted / drafts if drafts else 1.0

    def render(self) -> bytes:
        return generate_latest(self.registry)
