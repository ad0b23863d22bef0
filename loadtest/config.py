"""The load test's one configuration object, built from the command line and validated on creation."""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from urllib.parse import urlsplit

PROMPT_SETS = ("code", "chat", "tutorial")


@dataclass
class LoadTestConfig:
    """What to send, how fast, and for how long.

    Exactly one of ``concurrency`` (closed loop: that many requests always in flight) and ``rate``
    (open loop: Poisson arrivals at ``rate`` requests/s, whatever the server's speed) is set. The run
    ends at ``num_requests`` requests or after ``duration`` seconds, whichever comes first.
    """

    url: str
    num_requests: int
    concurrency: int | None = None
    rate: float | None = None
    duration: float | None = None
    api: str = "chat"
    prompts: str | None = None  # a shipped set (code, chat, tutorial) or a .jsonl path; None: by api
    max_tokens: int = 64
    temperature: float = 0.0
    model: str | None = None  # None: the first id from GET /v1/models
    api_key: str | None = None
    output: str | None = None
    plots: str | None = None
    slo_ttft: float | None = None  # seconds
    slo_tpot: float | None = None  # seconds
    compare_speculation: bool = False
    seed: int = 0
    progress: bool = True
    ignore_eos: bool = False
    request_timeout: float = 600.0
    warmup: int = 0

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"--url must be an http(s) URL such as http://127.0.0.1:8000, got {self.url!r}")
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError("give exactly one of --concurrency and --rate")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"--concurrency must be at least 1, got {self.concurrency}")
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"--rate must be positive, got {self.rate}")
        if self.num_requests < 1:
            raise ValueError(f"--num-requests must be at least 1, got {self.num_requests}")
        if self.duration is not None and not self.duration > 0:
            raise ValueError(f"--duration must be positive, got {self.duration}")
        if self.api not in ("chat", "completions"):
            raise ValueError(f"--api must be chat or completions, got {self.api!r}")
        if self.max_tokens < 1:
            raise ValueError(f"--max-tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be non-negative, got {self.temperature}")
        for name in ("slo_ttft", "slo_tpot"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive seconds, got {value}")
        if not self.request_timeout > 0:
            raise ValueError(f"--request-timeout must be positive, got {self.request_timeout}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be non-negative, got {self.warmup}")
        if self.prompts is None:
            self.prompts = "chat" if self.api == "chat" else "code"

    @property
    def base_url(self) -> str:
        """The server root: ``http://host:port/v1`` and ``http://host:port/`` both give ``http://host:port``."""
        base = self.url.rstrip("/")
        return base[: -len("/v1")] if base.endswith("/v1") else base

    @property
    def mode(self) -> str:
        return "closed" if self.concurrency is not None else "open"

    def to_json(self) -> dict:
        """Everything, except that the API key is never written out."""
        out = asdict(self)
        if out["api_key"] is not None:
            out["api_key"] = "***"
        out["mode"] = self.mode
        return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtest",
        description="Load-test an OpenAI-compatible server with streaming requests and report latency and "
        "throughput (TTFT, TPOT, ITL, E2E, goodput, speculative acceptance length).",
    )
    p.add_argument("--url", required=True, help="server root, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    load = p.add_mutually_exclusive_group(required=True)
    load.add_argument("--concurrency", type=int, help="closed loop: keep N requests in flight")
    load.add_argument("--rate", type=float, help="open loop: Poisson arrivals at R requests/s")
    p.add_argument("--num-requests", type=int, required=True, help="send at most M requests")
    p.add_argument(
        "--duration", type=float, help="stop the measured run after S seconds (requests in flight are cancelled)"
    )
    p.add_argument("--api", choices=["chat", "completions"], default="chat")
    p.add_argument(
        "--prompts",
        help="code, chat, tutorial (shipped sets) or a .jsonl file with a 'prompt' or 'messages' field per "
        "line (default: chat for --api chat, code for --api completions)",
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="ask the server to always generate --max-tokens")
    p.add_argument("--model", help="model name (default: the first id from GET /v1/models)")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--output", help="write the full report (config, summary, per-request records) as JSON")
    p.add_argument("--plots", help="write PNG plots (latency CDFs, output throughput over time) into DIR")
    p.add_argument("--slo-ttft", type=float, help="goodput SLO on time to first token, seconds")
    p.add_argument("--slo-tpot", type=float, help="goodput SLO on time per output token, seconds")
    p.add_argument(
        "--compare-speculation",
        action="store_true",
        help='run the load twice, with "speculative": {"enabled": true} and then false, and print the ratios',
    )
    p.add_argument("--seed", type=int, default=0, help="prompt order, arrival times, and sampling seeds")
    p.add_argument(
        "--warmup",
        type=int,
        default=0,
        help="before each measured run, send N unrecorded requests one at a time (fairer --compare-speculation)",
    )
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds without progress before a timeout")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def parse_config(argv: list[str] | None = None) -> LoadTestConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return LoadTestConfig(
            url=args.url,
            num_requests=args.num_requests,
            concurrency=args.concurrency,
            rate=args.rate,
            duration=args.duration,
            api=args.api,
            prompts=args.prompts,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            model=args.model,
            api_key=args.api_key,
            output=args.output,
            plots=args.plots,
            slo_ttft=args.slo_ttft,
            slo_tpot=args.slo_tpot,
            compare_speculation=args.compare_speculation,
            seed=args.seed,
            progress=not args.no_progress,
            ignore_eos=args.ignore_eos,
            request_timeout=args.request_timeout,
            warmup=args.warmup,
        )
    except ValueError as e:
        parser.error(str(e))
