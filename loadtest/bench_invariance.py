"""What the batch-invariant mode costs: tokens/s with ``--batch-invariant on`` and ``off``, same run.

``python -m loadtest.bench_invariance [--dtypes bfloat16 float32] [--rounds 3] [--compile on|off]
[--quantization int4|nf4]`` builds the engine ``augur serve`` builds for the shipped demo pair (the draft
model speculating, its forwards compiled as ``--compile auto`` gives it on a CPU) twice, once per mode,
and times greedy requests of the demo's held-out prompts at one and at eight at a time. The modes take
turns round by round, seconds apart (this host's speed drifts by a quarter within minutes); each cell is
the median of the rounds, and the ratio is the median of the rounds' own ratios. Prints a markdown table
for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from engine.assets import shipped_demo
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.request.sampling_params import SamplingParams


def tokens_per_second(eng: LLMEngine, prompts: list[list[int]], concurrency: int, max_tokens: int) -> float:
    """Greedy requests, ``concurrency`` at a time, each kept full until the prompts run out."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    queue = list(prompts)
    tokens, running, n = 0, 0, 0
    t0 = time.perf_counter()
    while queue or eng.has_unfinished_requests():
        while queue and running < concurrency:
            eng.add_request(f"b{n}", queue.pop(0), params)
            running, n = running + 1, n + 1
        for out in eng.step():
            tokens += len(out.outputs[0].delta_token_ids)
            running -= out.finished
    return tokens / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--prompts", type=int, default=16, help="held-out prompts a cell runs (per round)")
    ap.add_argument("--compile", default="auto", choices=["auto", "on", "off"], help="both engines' forwards")
    ap.add_argument("--quantization", default=None, choices=["int4", "nf4"], help="the target's weights, as loaded")
    args = ap.parse_args(argv)
    demo = shipped_demo()
    assert demo is not None, "the shipped demo pair is missing"
    lines = [json.loads(line)["prompt"] for line in (demo / "prompts.jsonl").read_text().splitlines()]
    print(f"torch threads {torch.get_num_threads()}; {args.rounds} rounds; {args.max_tokens} tokens a request; "
          f"compile {args.compile}; quantization {args.quantization}")  # fmt: skip
    print("| dtype | concurrency | invariant on tok/s | off tok/s | on / off |")
    print("| --- | --- | --- | --- | --- |")
    for dtype in args.dtypes:
        engines = {
            mode: LLMEngine(
                EngineConfig(
                    model=str(demo / "target"),
                    draft_model=str(demo / "draft"),
                    device="cpu",
                    dtype=dtype,
                    batch_invariant=mode,
                    compile=args.compile,
                )
            )  # fmt: skip
            for mode in ("on", "off")
        }
        prompts = [engines["on"].tokenizer.encode(p) for p in lines]
        for c in args.concurrency:
            cell = prompts[: max(c, args.prompts if c > 1 else 4)]
            for eng in engines.values():  # warm: shapes seen, compiled graphs specialized
                tokens_per_second(eng, cell[:c], c, 8)
            rates: dict[str, list[float]] = {"on": [], "off": []}
            for _ in range(args.rounds):
                for mode, eng in engines.items():
                    rates[mode].append(tokens_per_second(eng, cell, c, args.max_tokens))
            on, off = statistics.median(rates["on"]), statistics.median(rates["off"])
            ratio = statistics.median(a / b for a, b in zip(rates["on"], rates["off"]))
            print(f"| {dtype} | {c} | {on:.0f} | {off:.0f} | {ratio:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
