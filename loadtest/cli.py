"""``python -m loadtest``: run the load, print the summary, write the JSON report and the plots."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from loadtest.config import LoadTestConfig, parse_config
from loadtest.prompts import Prompt, load_prompts
from loadtest.report import build_report, compare, format_comparison, format_summary
from loadtest.runner import make_client, resolve_model, run_load


async def run(config: LoadTestConfig, prompts: list[Prompt]) -> dict:
    """Run the configured load (twice with --compare-speculation) and return the full report."""
    async with make_client(config) as client:
        model = config.model or await resolve_model(client)
        if not config.compare_speculation:
            result = await run_load(config, prompts, model, client=client)
            return {"config": config.to_json(), **build_report(result, config)}
        runs = {}
        for label, enabled in (("speculative", True), ("no_speculative", False)):
            result = await run_load(config, prompts, model, speculative=enabled, label=label, client=client)
            runs[label] = build_report(result, config)
        ratios = compare(runs["speculative"], runs["no_speculative"])
        return {"config": config.to_json(), "model": model, "runs": runs, "ratios": ratios}


def main(argv: list[str] | None = None) -> int:
    config = parse_config(argv)
    try:
        prompts = load_prompts(config.prompts)
    except (ValueError, OSError) as e:
        print(f"loadtest: {e}", file=sys.stderr)
        return 2
    try:
        report = asyncio.run(run(config, prompts))
    except KeyboardInterrupt:
        print("loadtest: interrupted", file=sys.stderr)
        return 130

    if config.compare_speculation:
        runs = report["runs"]
        for r in runs.values():
            print(format_summary(r), end="\n\n")
        print(format_comparison(runs["speculative"], runs["no_speculative"], report["ratios"]))
    else:
        print(format_summary(report))

    if config.output:
        path = Path(config.output)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1, allow_nan=False) + "\n", encoding="utf-8")
        print(f"\nreport: {path}", file=sys.stderr)
    if config.plots:
        from loadtest.plots import write_plots  # matplotlib is slow to import; only when asked

        files = write_plots(report["runs"] if config.compare_speculation else {"run": report}, config.plots)
        print(f"plots: {', '.join(str(f) for f in files)}", file=sys.stderr)
    return 0
