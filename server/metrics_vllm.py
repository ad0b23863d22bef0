"""vLLM's metric names next to Augur's own (``--metrics-compat vllm``, the default).

Kubernetes LLM routers and the dashboards built for vLLM read ``vllm:*`` series by name: llm-d's
endpoint picker (the Gateway API inference extension) scores pods by ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc``, ``vllm:lora_requests_info`` and ``vllm:cache_config_info``; vLLM's
production-stack router and its Grafana dashboard read the request counts, token counters and latency
histograms. Exporting the same names, types and labels (``model_name``, ``engine``) lets them work
against Augur unchanged. The values are the ones Augur's ``augur_*`` series carry; this class only
gives them vLLM's names (the caller, :class:`server.metrics.Metrics`, feeds both).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# Token-count buckets (prompt and generation lengths): 1-2-5 steps up to 100k.
_TOKEN_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5) if m * 10**e <= 100_000)


class _EngineCounters(Collector):
    """Counters the engine thread owns (it publishes cumulative totals in its load snapshot): read at
    scrape time rather than incremented, so they can never drift from the engine's own count."""

    def __init__(self, labels: dict[str, str]) -> None:
        self.labels = labels
        self.load: Callable | None = None

    def collect(self):
        if self.load is None:
            return
        load = self.load()
        names = list(self.labels)
        values = list(self.labels.values())
        for name, doc, value in (
            ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", load.prefix_queries),
            ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache", load.prefix_hits),
            ("vllm:num_preemptions", "Preemptions (KV blocks freed, recomputed later)", load.preemptions),
        ):
            family = CounterMetricFamily(name, doc, labels=names)
            family.add_metric(values, value)
            yield family


class _LoraInfo(Collector):
    """``vllm:lora_requests_info``: one sample whose labels are the adapters running and waiting now."""

    def __init__(self) -> None:
        self.load: Callable | None = None

    def collect(self):
        load = self.load() if self.load is not None else None
        family = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running and waiting LoRA adapters",
            labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
        )
        running, waiting, most = ((), (), 0) if load is None else (load.lora_running, load.lora_waiting, load.max_lora)
        family.add_metric([str(most), ",".join(waiting), ",".join(running)], time.time())
        yield family


class VllmMetrics:
    """The ``vllm:*`` series; :class:`server.metrics.Metrics` calls the same-named methods it runs for
    its own series, with the same values."""

    def __init__(self, registry: CollectorRegistry, model_name: str, latency_buckets: dict[str, tuple]) -> None:
        r = registry
        self.labels = {"model_name": model_name, "engine": "0"}  # one engine per Augur process
        names = list(self.labels)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=r)

        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch", names, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled", names, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage (1 = every block in use)", names, registry=r)
        # The name vLLM used before kv_cache_usage_perc, which older endpoint pickers still read.
        self.gpu_cache_usage = Gauge(
            "vllm:gpu_cache_usage_perc", "KV-cache usage (old name of vllm:kv_cache_usage_perc)", names, registry=r
        )
        self.cache_config = Gauge(
            "vllm:cache_config_info",
            "KV-cache configuration (an info metric: always 1, the facts are its labels)",
            ["block_size", "num_gpu_blocks", "cache_dtype", "enable_prefix_caching", "engine"],
            registry=r,
        )
        # The LoRA adapters of the running and the waiting requests (comma-separated) and the slots, read
        # at scrape time; its value is the time it was read, as vLLM's is. With no adapters served: none
        # running, none waiting, max 0 (routers that filter pods by adapter still find the series).
        self.lora = _LoraInfo()
        r.register(self.lora)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed", names, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generation tokens processed", names, registry=r)
        self.request_success = Counter(
            "vllm:request_success", "Requests finished", [*names, "finished_reason"], registry=r
        )
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Prompt tokens per request", _TOKEN_BUCKETS
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Generated tokens per request", _TOKEN_BUCKETS
        )
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token", latency_buckets["ttft"])
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Time between consecutive output tokens", latency_buckets["itl"]
        )
        self.tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Mean time per output token after the first, per request",
            latency_buckets["tpot"],
        )
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency", latency_buckets["e2e"])
        self.engine_counters = _EngineCounters(self.labels)
        r.register(self.engine_counters)
        self.spec_drafts = Counter("vllm:spec_decode_num_drafts", "Speculative drafts verified", names, registry=r)
        self.spec_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens", names, registry=r)
        self.spec_accepted_tokens = Counter(
            "vllm:spec_decode_num_accepted_tokens", "Accepted draft tokens", names, registry=r
        )
        self.spec_accepted_per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens per draft position",
            [*names, "position"],
            registry=r,
        )

    def bind_engine(self, engine, load: Callable) -> None:
        labels = self.labels
        self.running.labels(**labels).set_function(lambda: load().running)
        self.waiting.labels(**labels).set_function(lambda: load().waiting)
        self.kv_usage.labels(**labels).set_function(lambda: load().kv_usage)
        self.gpu_cache_usage.labels(**labels).set_function(lambda: load().kv_usage)
        self.engine_counters.load = load
        self.lora.load = load
        c = engine.cache_info
        self.cache_config.labels(
            block_size=str(c.block_size),
            num_gpu_blocks=str(c.num_blocks),  # KV blocks, on whatever device holds them
            cache_dtype=c.dtype,
            enable_prefix_caching=str(c.prefix_caching),
            engine="0",
        ).set(1)

    # -- per request (same calls, same values as Augur's series) ------------------------------------
    def request_started(self, prompt_tokens: int) -> None:
        self.prompt_tokens.labels(**self.labels).inc(prompt_tokens)

    def first_token(self, seconds: float) -> None:
        self.ttft.labels(**self.labels).observe(seconds)

    def tokens(self, n: int, seconds_per_token: float | None) -> None:
        self.generation_tokens.labels(**self.labels).inc(n)
        if seconds_per_token is not None:
            self.itl.labels(**self.labels).observe(seconds_per_token)

    def request_finished(
        self, reason: str, e2e: float, tpot: float | None, prompt_tokens: int, generation_tokens: int
    ) -> None:
        labels = self.labels
        self.request_success.labels(**labels, finished_reason=reason).inc()
        self.e2e.labels(**labels).observe(e2e)
        if tpot is not None:
            self.tpot.labels(**labels).observe(tpot)
        self.request_prompt_tokens.labels(**labels).observe(prompt_tokens)
        self.request_generation_tokens.labels(**labels).observe(generation_tokens)

    def request_failed(self, reason: str) -> None:
        # vLLM counts a request the client abandoned as finished with reason "abort", and one the
        # engine failed as "error".
        finished = "abort" if reason == "client_disconnect" else "error"
        self.request_success.labels(**self.labels, finished_reason=finished).inc()

    def spec_step(self, drafts: int, draft_tokens: int, accepted: int, accepted_per_pos: dict[int, int]) -> None:
        labels = self.labels
        self.spec_drafts.labels(**labels).inc(drafts)
        self.spec_draft_tokens.labels(**labels).inc(draft_tokens)
        self.spec_accepted_tokens.labels(**labels).inc(accepted)
        for pos, n in accepted_per_pos.items():
            self.spec_accepted_per_pos.labels(**labels, position=str(pos)).inc(n)
