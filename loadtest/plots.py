"""PNG plots of one or more runs' reports: latency CDFs (TTFT, TPOT, E2E) and output tokens/s over time."""

from __future__ import annotations

from pathlib import Path

try:
    import matplotlib
except ImportError as e:  # an extra: augur serve never needs it
    raise ImportError("plots need the tools extra: pip install 'augur[tools]'") from e

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


# -- the benchmark suite (augur bench --suite) ----------------------------------------------------------
SUITE_PLOTS = (
    ("output_tok_s", "output tokens/s", "suite_tokens_per_s.png", "Output tokens/s per category"),
    ("mean_acceptance_length", "mean acceptance length", "suite_acceptance.png", "Acceptance length per category"),
)


def write_suite_plots(rows: list[dict], out_dir: str | Path) -> list[Path]:
    """Grouped bars, a group per category and a bar per server/mode, a panel per concurrency:
    suite_tokens_per_s.png and suite_acceptance.png (tokens per target forward; plain decoding is 1).
    ``rows`` are ``augur bench --suite`` rows; a failed or unmeasured cell is left empty."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    categories = list(dict.fromkeys(r["category"] for r in rows))
    labels = list(dict.fromkeys(r["label"] for r in rows))
    concurrencies = sorted({r["concurrency"] for r in rows}) or [1]
    value = {(r["label"], r["category"], r["concurrency"], key): r.get(key) for r in rows for key, *_ in SUITE_PLOTS}
    written = []
    for key, ylabel, filename, title in SUITE_PLOTS:
        fig, axes = plt.subplots(
            1, len(concurrencies), figsize=(max(6.4, 1.2 * len(categories) * len(concurrencies)), 4.2), squeeze=False
        )
        width = 0.8 / max(1, len(labels))
        for ax, c in zip(axes[0], concurrencies):
            x = np.arange(len(categories))
            plotted = False
            for i, label in enumerate(labels):
                heights = [value.get((label, cat, c, key)) for cat in categories]
                if all(h is None for h in heights):
                    continue
                heights = [np.nan if h is None else h for h in heights]
                ax.bar(x + (i - (len(labels) - 1) / 2) * width, heights, width, label=label)
                plotted = True
            if key == "mean_acceptance_length" and plotted:
                ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
            if not plotted:
                ax.text(0.5, 0.5, "nothing measured", ha="center", va="center", transform=ax.transAxes)
            ax.set_xticks(x, categories, rotation=20)
            ax.set(ylabel=ylabel, title=f"{title}, concurrency {c}")
            ax.grid(axis="y", alpha=0.3)
            if plotted:  # below the axes: inside, it would cover the tallest bars
                ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=min(4, len(labels)))
        written.append(_save(fig, out / filename))
    return written
