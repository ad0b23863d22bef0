"""``augur bench``: output tokens/s of the engine against Hugging Face ``generate``, in one run.

Both sides decode the same prompts (mixed lengths, random token ids from a fixed seed) to the same
number of output tokens, greedily, in the same process on the same device:

- Augur keeps ``c`` requests in flight with continuous batching (a new one joins as one finishes);
- transformers runs ``generate`` two ways: one request at a time (what a server built on ``generate``
  does: no batching across requests), and on static batches of ``c`` prompts, left-padded, all
  decoding the same number of tokens (its best case at that concurrency: no request waits for a
  longer batch mate, which real traffic with different output lengths would).

With ``--async-scheduling`` Augur also runs with ordinary steps on the same engine, interleaved with its
run-ahead steps ``--repeats`` times each (engine/core/ahead.py; medians): the ``vs ordinary`` ratio.

Speed claims are the printed ratios, measured against those baselines in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.offline.measure import machine_description, make_prompts, memory_report, run_augur, run_hf
from engine.request.sampling_params import SamplingParams


@dataclass
class BenchResult:
    concurrency: int
    output_tokens: int
    augur_tokens_per_s: float
    hf_sequential_tokens_per_s: float | None = None  # generate, one request at a time
    hf_batched_tokens_per_s: float | None = None  # generate on padded static batches of `concurrency`
    ordinary_tokens_per_s: float | None = None  # Augur with ordinary steps (run-ahead measured: --async-scheduling)

    @property
    def ratio_vs_ordinary(self) -> float | None:
        return self.augur_tokens_per_s / self.ordinary_tokens_per_s if self.ordinary_tokens_per_s else None

    @property
    def ratio_vs_sequential(self) -> float | None:
        return self.augur_tokens_per_s / self.hf_sequential_tokens_per_s if self.hf_sequential_tokens_per_s else None

    @property
    def ratio_vs_batched(self) -> float | None:
        return self.augur_tokens_per_s / self.hf_batched_tokens_per_s if self.hf_batched_tokens_per_s else None


def run_bench(cfg: EngineConfig, args: argparse.Namespace) -> int:
    args.concurrency = args.concurrency or [1, 16]
    max_c = max(args.concurrency)
    cfg.max_num_seqs = max(cfg.max_num_seqs, max_c)
    engine = LLMEngine(cfg)
    lo, hi = args.prompt_lens
    prompts = make_prompts(args.num_prompts, lo, hi, len(engine.tokenizer))
    plain = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, speculative=False)
    # Warm up both sides (allocator, kernels, lazy imports) before timing; Augur's memory is read
    # before transformers loads its copy of the model.
    run_augur(engine, prompts[:2], 4, 2, dataclasses.replace(plain, max_tokens=4))
    memory = memory_report(engine)
    hf = None
    if not args.no_hf:
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(engine.model_path, dtype=engine.dtype)
        hf = hf.to(engine.device).eval()
    pad = engine.tokenizer.pad_token_id if engine.tokenizer.pad_token_id is not None else engine.eos_token_ids[0]
    if hf is not None:
        run_hf(hf, prompts[:2], 4, 2, pad, engine.device)

    ahead = engine.ahead

    def augur(c: int, run_ahead: bool):
        # Between two runs nothing is pending: a run ends when its last request has, and a forward ahead
        # of sequences that all ended is dropped.
        engine.ahead = ahead if run_ahead else None
        try:
            return run_augur(engine, prompts, args.max_tokens, c, plain)
        finally:
            engine.ahead = ahead

    results = []
    hf_sequential = None
    for c in sorted(args.concurrency):
        if ahead is None:
            r = run_augur(engine, prompts, args.max_tokens, c, plain)
            row = BenchResult(c, r.tokens, r.tokens_per_s)
        else:  # run-ahead against ordinary steps, interleaved
            runs = [(augur(c, False), augur(c, True)) for _ in range(max(1, args.repeats))]
            r = runs[0][1]
            median = lambda xs: statistics.median(x.tokens_per_s for x in xs)  # noqa: E731
            row = BenchResult(c, r.tokens, median(b for _, b in runs))
            row.ordinary_tokens_per_s = median(a for a, _ in runs)
        if hf is not None:
            if hf_sequential is None:
                t_h, n_h = run_hf(hf, prompts, args.max_tokens, 1, pad, engine.device)
                hf_sequential = n_h / t_h
            row.hf_sequential_tokens_per_s = hf_sequential
            if c == 1:
                row.hf_batched_tokens_per_s = hf_sequential
            else:
                t_h, n_h = run_hf(hf, prompts, args.max_tokens, c, pad, engine.device)
                row.hf_batched_tokens_per_s = n_h / t_h
        results.append(row)

    machine = machine_description(engine.device)
    print(f"augur bench: {engine.model_path} on {engine.device} ({engine.dtype}); {machine}")
    print(f"{args.num_prompts} prompts of {lo}-{hi} tokens, {args.max_tokens} output tokens each, greedy")
    if ahead is not None:
        print(f"augur: run-ahead steps (--async-scheduling) against ordinary steps, {max(1, args.repeats)} round(s)")
    quant = f", {cfg.quantization}" if cfg.quantization else ""
    print(
        f"memory{quant}: weights {memory['weights_bytes'] / 2**20:.1f} MiB, KV pool "
        f"{memory['kv_pool_bytes'] / 2**20:.1f} MiB, peak {memory['peak_bytes'] / 2**20:.1f} MiB ({memory['peak_of']})"
    )

    def fmt(x: float | None, spec: str, suffix: str = "") -> str:
        return "-" if x is None else f"{x:{spec}}{suffix}"

    header = ("concurrency", "augur tok/s", "hf seq tok/s", "hf batch tok/s", "vs seq", "vs batch")
    if ahead is not None:
        header += ("ordinary tok/s", "vs ordinary")
    print("  ".join(f"{h:>14}" for h in header))
    for r in results:
        cells = (
            str(r.concurrency),
            fmt(r.augur_tokens_per_s, ".1f"),
            fmt(r.hf_sequential_tokens_per_s, ".1f"),
            fmt(r.hf_batched_tokens_per_s, ".1f"),
            fmt(r.ratio_vs_sequential, ".2f", "x"),
            fmt(r.ratio_vs_batched, ".2f", "x"),
        )
        if ahead is not None:
            cells += (fmt(r.ordinary_tokens_per_s, ".1f"), fmt(r.ratio_vs_ordinary, ".2f", "x"))
        print("  ".join(f"{c:>14}" for c in cells))
    if args.output:
        report = {
            "model": str(engine.model_path),
            "device": str(engine.device),
            "machine": machine,
            "dtype": str(engine.dtype),
            "num_prompts": args.num_prompts,
            "prompt_lens": [lo, hi],
            "max_tokens": args.max_tokens,
            "quantization": cfg.quantization,
            "memory": memory,
            "results": [
                {
                    **asdict(r),
                    "ratio_vs_sequential": r.ratio_vs_sequential,
                    "ratio_vs_batched": r.ratio_vs_batched,
                    "ratio_vs_ordinary": r.ratio_vs_ordinary,
                }
                for r in results
            ],
        }
        Path(args.output).write_text(json.dumps(report, indent=2))
    return 0
