"""Turn a run's request records into the report: throughput, latency percentiles, goodput, errors,
speculative acceptance length; and format it as a table.

Throughputs divide by the run's wall time (first request sent to last one finished, or to the
``--duration`` cut). Only requests that finished ("ok") count towards throughput and latencies.

*Mean acceptance length* is the number of tokens a sequence gains per target forward (verify step):
the accepted draft tokens plus the one token the target adds itself, so plain decoding scores 1.0.
From the server's Prometheus counters it is ``1 + Δaccepted / Δdrafts`` over the run (one draft per
sequence per verify step), as vLLM defines it.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np

from loadtest.client import RequestRecord
from loadtest.config import LoadTestConfig
from loadtest.runner import RunResult

SPEC_PREFIX = "augur_spec_decode_"
ACCEPTANCE_GAUGE = "augur_spec_decode_mean_acceptance_length"
ACCEPTED_COUNTER = "augur_spec_decode_num_accepted_tokens_total"
DRAFTS_COUNTER = "augur_spec_decode_num_drafts_total"
# (accepted, drafts) counter names by the server that exports them: Augur's, else vLLM's (Augur exports both).
SPEC_COUNTERS = {
    "augur": (ACCEPTED_COUNTER, DRAFTS_COUNTER),
    "vllm": ("vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_drafts_total"),
}
LATENCIES = ("ttft_s", "tpot_s", "itl_s", "e2e_s")
STATS = ("mean", "p50", "p90", "p99")
TIMELINE_BINS = 60


def summarize(values: list[float]) -> dict:
    """count, mean, p50, p90, p99, min, max (None for an empty list)."""
    if not values:
        return {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None, "min": None, "max": None}
    a = np.asarray(values, dtype=float)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {
        "count": int(a.size),
        "mean": float(a.mean()),
        "p50": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "min": float(a.min()),
        "max": float(a.max()),
    }


# -- the server's /metrics ------------------------------------------------------------------------------
def parse_prometheus(text: str) -> dict[str, list[float]]:
    """Sample values by metric name (one per label set), from Prometheus text exposition format."""
    samples: dict[str, list[float]] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, rest = line.split("{", 1)
            rest = rest.rsplit("}", 1)[-1]
        else:
            name, _, rest = line.partition(" ")
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        samples.setdefault(name.strip(), []).append(value)
    return samples


def spec_metrics(text: str | None) -> dict[str, float] | None:
    """The server's ``augur_spec_decode_*`` samples, summed over label sets (a gauge is averaged)."""
    if text is None:
        return None
    out = {}
    for name, values in parse_prometheus(text).items():
        if name.startswith(SPEC_PREFIX):
            value = sum(values) / len(values) if name == ACCEPTANCE_GAUGE else sum(values)
            out[name] = value if math.isfinite(value) else None  # JSON has no NaN
    return out


def server_acceptance_length(before: str | None, after: str | None) -> tuple[float | None, str | None]:
    """(mean acceptance length, "gauge" | "counters") from /metrics scraped around the run: Augur's gauge,
    else the counters (:func:`counter_acceptance_length`); (None, None) when the server exposes neither,
    or /metrics could not be read."""
    end = spec_metrics(after)
    gauge = end.get(ACCEPTANCE_GAUGE) if end else None
    if gauge is not None and gauge > 0:
        return gauge, "gauge"
    value, _ = counter_acceptance_length(before, after)
    return (value, "counters") if value is not None else (None, None)


def counter_acceptance_length(before: str | None, after: str | None) -> tuple[float | None, str | None]:
    """(``1 + Δaccepted / Δdrafts``, "augur" | "vllm") between two /metrics scrapes, from Augur's counters
    or else vLLM's, so a vLLM server's acceptance shows too. Unlike the gauge (a 60 s window), it covers
    exactly the interval between the scrapes. (None, None) without the counters or without drafts."""
    if before is None or after is None:
        return None, None
    start, end = parse_prometheus(before), parse_prometheus(after)
    for source, (accepted_name, drafts_name) in SPEC_COUNTERS.items():
        if accepted_name not in end or drafts_name not in end:
            continue
        drafts = sum(end[drafts_name]) - sum(start.get(drafts_name, ()))
        accepted = sum(end[accepted_name]) - sum(start.get(accepted_name, ()))
        if drafts > 0 and math.isfinite(accepted / drafts):
            return 1.0 + accepted / drafts, source
    return None, None


def usage_acceptance_length(records: list[RequestRecord]) -> tuple[float | None, int]:
    """The mean of ``usage.speculative.mean_acceptance_length`` over the responses that carry it."""
    values = []
    for r in records:
        value = (r.speculative or {}).get("mean_acceptance_length") if r.status == "ok" else None
        if isinstance(value, (int, float)) and math.isfinite(value):
            values.append(float(value))
    return (sum(values) / len(values) if values else None), len(values)


# -- the report -----------------------------------------------------------------------------------------
def throughput_timeline(records: list[RequestRecord], duration: float) -> dict:
    """Output tokens/s in equal time bins over the run. A chunk's tokens are the request's usage count
    spread evenly over its chunks (one per chunk when the count is unknown)."""
    bin_s = max(duration, 1e-3) / TIMELINE_BINS
    tokens = np.zeros(TIMELINE_BINS)
    for r in records:
        if r.ttft_s is None or r.num_chunks == 0:
            continue
        per_chunk = r.completion_tokens / r.num_chunks if r.status == "ok" and r.completion_tokens else 1.0
        times = r.start_s + r.ttft_s + np.concatenate([[0.0], np.cumsum(r.itl_s)])
        idx = np.clip((times / bin_s).astype(int), 0, TIMELINE_BINS - 1)
        np.add.at(tokens, idx, per_chunk)
    return {
        "bin_s": bin_s,
        "t_s": [float(i * bin_s) for i in range(TIMELINE_BINS)],
        "output_tokens_per_s": [float(x / bin_s) for x in tokens],
    }


def build_report(result: RunResult, config: LoadTestConfig) -> dict:
    records = result.records
    ok = [r for r in records if r.status == "ok"]
    failed = [r for r in records if r.status == "error"]
    duration = result.duration_s
    errors = Counter(r.error for r in failed)
    examples: dict[str, str] = {}
    for r in failed:
        examples.setdefault(r.error, r.error_message or "")
    output_tokens = sum(r.completion_tokens for r in ok)
    prompt_tokens = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]

    goodput = None
    if config.slo_ttft is not None or config.slo_tpot is not None:
        good = [
            r
            for r in ok
            if (config.slo_ttft is None or (r.ttft_s is not None and r.ttft_s <= config.slo_ttft))
            and (config.slo_tpot is None or r.tpot_s is None or r.tpot_s <= config.slo_tpot)
        ]
        goodput = {
            "slo_ttft_s": config.slo_ttft,
            "slo_tpot_s": config.slo_tpot,
            "num_good": len(good),
            "fraction_of_completed": len(good) / len(ok) if ok else None,
            "requests_per_s": len(good) / duration if duration > 0 else 0.0,
        }

    server_mal, source = server_acceptance_length(result.metrics_before, result.metrics_after)
    usage_mal, usage_n = usage_acceptance_length(records)
    return {
        "label": result.label,
        "speculative_enabled": result.speculative,
        "model": result.model,
        "api": config.api,
        "mode": config.mode,
        "concurrency": config.concurrency,
        "rate": config.rate,
        "started_at": result.started_at,
        "duration_s": duration,
        "num_requests": len(records),
        "num_completed": len(ok),
        "num_failed": len(failed),
        "num_cancelled": sum(r.status == "cancelled" for r in records),
        "errors": dict(sorted(errors.items())),
        "error_examples": examples,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": output_tokens / duration if duration > 0 else 0.0,
        "total_output_tokens": output_tokens,
        "total_prompt_tokens": sum(prompt_tokens) if prompt_tokens else None,
        "output_tokens_from_usage": all(r.tokens_from_usage for r in ok) if ok else None,
        "ttft_s": summarize([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_s": summarize([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_s": summarize([gap for r in ok for gap in r.itl_s]),
        "e2e_s": summarize([r.e2e_s for r in ok if r.e2e_s is not None]),
        "goodput": goodput,
        "mean_acceptance_length": {
            "server_metrics": server_mal,
            "server_metrics_source": source,
            "usage": usage_mal,
            "usage_responses": usage_n,
        },
        "server_metrics": {
            "available": result.metrics_after is not None,
            "before": spec_metrics(result.metrics_before),
            "after": spec_metrics(result.metrics_after),
        },
        "output_throughput_timeline": throughput_timeline(records, duration),
        "requests": [r.to_json() for r in records],
    }


def _ratio(a, b) -> float | None:
    if a is None or b is None or not b:
        return None
    return a / b


def compare(spec: dict, base: dict) -> dict:
    """spec / no-spec for throughputs (above 1: speculation is faster) and latencies (below 1: faster),
    and how many requests gave the same text both times (expected: all, at temperature 0)."""
    ratios: dict = {
        "request_throughput": _ratio(spec["request_throughput"], base["request_throughput"]),
        "output_throughput": _ratio(spec["output_throughput"], base["output_throughput"]),
        "goodput": _ratio((spec["goodput"] or {}).get("requests_per_s"), (base["goodput"] or {}).get("requests_per_s")),
        "mean_acceptance_length": {
            k: _ratio(spec["mean_acceptance_length"][k], base["mean_acceptance_length"][k])
            for k in ("server_metrics", "usage")
        },
    }
    for key in LATENCIES:
        ratios[key] = {s: _ratio(spec[key][s], base[key][s]) for s in STATS}
    texts = {r["index"]: r["text"] for r in base["requests"] if r["status"] == "ok"}
    pairs = [(r["text"], texts[r["index"]]) for r in spec["requests"] if r["status"] == "ok" and r["index"] in texts]
    ratios["same_output"] = {"compared": len(pairs), "identical": sum(a == b for a, b in pairs)}
    return ratios


# -- tables ---------------------------------------------------------------------------------------------
def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def format_summary(report: dict) -> str:
    load = f"concurrency {report['concurrency']}" if report["mode"] == "closed" else f"rate {report['rate']} req/s"
    title = f"Augur load test: {report['api']} API, {load}, model {report['model'] or '(none)'}"
    if report["label"]:
        title += f" [{report['label']}]"
    mal = report["mean_acceptance_length"]
    lines = [
        title,
        "=" * len(title),
        f"{'requests':<22}{report['num_requests']} sent: {report['num_completed']} ok, "
        f"{report['num_failed']} failed, {report['num_cancelled']} cancelled, in {report['duration_s']:.2f} s",
        f"{'request throughput':<22}{report['request_throughput']:.2f} req/s",
        f"{'output throughput':<22}{report['output_throughput']:.1f} tok/s ({report['total_output_tokens']} tokens)",
    ]
    g = report["goodput"]
    if g is not None:
        slos = ", ".join(
            f"{name} <= {_ms(v)} ms" for name, v in (("TTFT", g["slo_ttft_s"]), ("TPOT", g["slo_tpot_s"])) if v
        )
        lines.append(f"{'goodput':<22}{g['requests_per_s']:.2f} req/s ({g['num_good']} requests with {slos})")
    src = f" ({mal['server_metrics_source']})" if mal["server_metrics_source"] else ""
    lines.append(
        f"{'acceptance length':<22}server metrics {_num(mal['server_metrics'])}{src}; "
        f"usage {_num(mal['usage'])} over {mal['usage_responses']} responses"
    )
    errors = ", ".join(f"{k}: {v}" for k, v in report["errors"].items()) or "none"
    lines.append(f"{'errors':<22}{errors}")
    for kind, message in report["error_examples"].items():
        lines.append(f"{'':<22}{kind}: {message[:100]}")
    lines += ["", f"{'latency (ms)':<14}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'count':>8}"]
    for key, name in zip(LATENCIES, ("TTFT", "TPOT", "ITL", "E2E")):
        s = report[key]
        lines.append(f"{name:<14}" + "".join(f"{_ms(s[k]):>10}" for k in STATS) + f"{s['count']:>8}")
    return "\n".join(lines)


def format_comparison(spec: dict, base: dict, ratios: dict) -> str:
    title = "Speculation on vs off (ratio = on / off)"
    lines = [title, "=" * len(title), f"{'':<22}{'on':>12}{'off':>12}{'ratio':>10}"]

    def row(name: str, a, b, r, fmt) -> None:
        lines.append(f"{name:<22}{fmt(a):>12}{fmt(b):>12}{_num(r, '.3f'):>10}")

    row("req/s", spec["request_throughput"], base["request_throughput"], ratios["request_throughput"], _num)
    row(
        "output tok/s",
        spec["output_throughput"],
        base["output_throughput"],
        ratios["output_throughput"],
        lambda x: _num(x, ".1f"),
    )
    if spec["goodput"] and base["goodput"]:
        good = spec["goodput"]["requests_per_s"], base["goodput"]["requests_per_s"]
        row("goodput req/s", *good, ratios["goodput"], _num)
    for key, name in zip(LATENCIES, ("TTFT", "TPOT", "ITL", "E2E")):
        for s in ("mean", "p50", "p99"):
            row(f"{name} {s} (ms)", spec[key][s], base[key][s], ratios[key][s], _ms)
    for k in ("server_metrics", "usage"):
        a, b = spec["mean_acceptance_length"][k], base["mean_acceptance_length"][k]
        row(f"accept. len ({k.split('_')[0]})", a, b, ratios["mean_acceptance_length"][k], _num)
    same = ratios["same_output"]
    lines.append(f"{'identical outputs':<22}{same['identical']} of {same['compared']} requests")
    return "\n".join(lines)
