"""PNG plots of one or more runs' reports: latency CDFs (TTFT, TPOT, E2E) and output tokens/s over time."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, never a window
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

CDFS = (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "E2E latency"))


def _latencies(report: dict, key: str) -> list[float]:
    return [r[key] for r in report["requests"] if r["status"] == "ok" and r[key] is not None]


def write_plots(reports: dict[str, dict], out_dir: str | Path) -> list[Path]:
    """One figure per quantity, each with a line per run (``reports`` maps a label to a report).
    Returns the files written: ttft_cdf.png, tpot_cdf.png, e2e_cdf.png, output_throughput.png."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for key, name in CDFS:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        plotted = False
        for label, report in reports.items():
            values = np.sort(np.asarray(_latencies(report, key)) * 1000.0)
            if values.size == 0:
                continue
            ax.step(values, np.arange(1, values.size + 1) / values.size, where="post", label=label)
            plotted = True
        if not plotted:
            ax.text(0.5, 0.5, "no completed requests", ha="center", va="center", transform=ax.transAxes)
        ax.set(xlabel=f"{name} (ms)", ylabel="fraction of requests", title=f"{name} CDF", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        if plotted and len(reports) > 1:
            ax.legend()
        written.append(_save(fig, out / f"{key.removesuffix('_s')}_cdf.png"))

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, report in reports.items():
        tl = report["output_throughput_timeline"]
        centers = np.asarray(tl["t_s"]) + tl["bin_s"] / 2
        ax.plot(centers, tl["output_tokens_per_s"], label=label)
    ax.set(xlabel="time since start (s)", ylabel="output tokens/s", title="Output throughput over time")
    ax.grid(alpha=0.3)
    if len(reports) > 1:
        ax.legend()
    written.append(_save(fig, out / "output_throughput.png"))
    return written


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
