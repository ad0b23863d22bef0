"""Where a forward's device time goes, by kernel, at several widths: ``python -m loadtest.profile_gpu``.

The first GPU run (docs/benchmarks-history.md) found a 3-token chain verify costing 1.34x a 1-token decode at
the 8B shape, although at batch 1 both should be bound by reading the same weights. This tool builds a
shape with random weights (``loadtest.bench_gpu.build``), fills ``--context`` tokens of K/V, then runs
``--repeats`` forwards of each width (1 = a decode, k + 1 = a depth-k chain verify) under
``torch.profiler`` and prints each kernel's device time per forward, one column per width (kernels
sorted by their time at the widest): the rows that grow with the width are what a verify pays beyond
a decode. Needs CUDA.
"""

from __future__ import annotations

import argparse
import collections
import json

import torch
from torch.profiler import ProfilerActivity, profile

from engine.runner.model_runner import ForwardChunk
from loadtest.bench_gpu import BLOCK, SHAPES, build, device_name


def kernel_times(runner, chunk: ForwardChunk, repeats: int) -> tuple[dict[str, float], float]:
    """Device microseconds per forward for each kernel name, and the wall milliseconds per forward."""
    batch = runner.prepare([chunk])
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with torch.inference_mode():
        for _ in range(3):
            runner.execute(batch)
        torch.cuda.synchronize()
        start, end = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        with profile(activities=activities) as prof:
            start.record()
            for _ in range(repeats):
                runner.execute(batch)
            end.record()
            torch.cuda.synchronize()
    per_kernel: dict[str, float] = collections.defaultdict(float)
    for avg in prof.key_averages():  # a kernel's own time is its self device time (an op's is its kernels')
        if getattr(avg, "self_device_time_total", 0) > 0:
            per_kernel[avg.key[:90]] += avg.self_device_time_total / repeats  # microseconds
    return dict(per_kernel), start.elapsed_time(end) / repeats


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-3.1-8b", choices=SHAPES)
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--cuda-graphs", choices=["on", "off"], default="on")
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument(
        "--pool-tokens", type=int, default=65536,
        help="K/V pool size: a served pool's (a graph splits each token's keys by the longest context the pool holds)",
    )  # fmt: skip
    ap.add_argument("--output", default=None, help="write the per-kernel figures as JSON")
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    max_positions = args.context + max(args.widths) + 8
    runner, _ = build(args.shape, device, torch.bfloat16, max_positions, "triton", args.cuda_graphs == "on")
    runner.allocate_kv(max(-(-max_positions // BLOCK) + 1, args.pool_tokens // BLOCK))
    table = list(range(runner.num_blocks))
    with torch.inference_mode():
        runner.forward([ForwardChunk([7] * args.context, 0, table, 1)])
    results = {}
    for w in args.widths:
        kernels, wall = kernel_times(runner, ForwardChunk([5] * w, args.context, table, w), args.repeats)
        results[w] = dict(wall_ms=wall, kernels=kernels)
    print(f"{device_name(device)}; {args.shape}; context {args.context}; graphs {args.cuda_graphs}")
    widest = max(args.widths)
    names = sorted(results[widest]["kernels"], key=lambda n: -results[widest]["kernels"][n])
    head = " | ".join(f"w={w} us" for w in args.widths)
    print(f"| kernel | {head} |")
    for n in names[: args.top]:
        print(f"| {n} | " + " | ".join(f"{results[w]['kernels'].get(n, 0.0):.1f}" for w in args.widths) + " |")
    print("| **sum of kernels** | " + " | ".join(f"{sum(results[w]['kernels'].values()):.1f}" for w in args.widths))
    print("| **wall per forward** | " + " | ".join(f"{results[w]['wall_ms'] * 1e3:.1f}" for w in args.widths))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(dict(device=device_name(device), shape=args.shape, results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
