"""``augur bench``: output tokens/s of the engine against Hugging Face ``generate``, in one run.

Both sides decode the same prompts (mixed lengths, random token ids from a fixed seed) to the same
number of output tokens, greedily, in the same process on the same device:

- Augur keeps ``c`` requests in flight with continuous batching (a new one joins as one finishes);
- transformers runs ``generate`` two ways: one request at a time (what a server built on ``generate``
  does: no batching across requests), and on static batches of ``c`` prompts, left-padded, all
  decoding the same number of tokens (its best case at that concurrency: no request waits for a
  longer batch mate, which real traffic with different output lengths would).

Speed claims are the printed ratios, measured against those baselines in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import resource
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.request.sampling_params import SamplingParams


@dataclass
class BenchResult:
    concurrency: int
    output_tokens: int
    augur_tokens_per_s: float
    hf_sequential_tokens_per_s: float | None = None  # generate, one request at a time
    hf_batched_tokens_per_s: float | None = None  # generate on padded static batches of `concurrency`

    @property
    def ratio_vs_sequential(self) -> float | None:
        return self.augur_tokens_per_s / self.hf_sequential_tokens_per_s if self.hf_sequential_tokens_per_s else None

    @property
    def ratio_vs_batched(self) -> float | None:
        return self.augur_tokens_per_s / self.hf_batched_tokens_per_s if self.hf_batched_tokens_per_s else None


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@dataclass
class RunStats:
    seconds: float
    tokens: int
    verify_steps: int  # per-request target forwards that produced tokens, summed
    engine_steps: int  # batched target forwards

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def mean_acceptance_length(self) -> float:
        return self.tokens / self.verify_steps if self.verify_steps else 0.0


def run_augur(
    engine: LLMEngine,
    prompts: list[list[int]],
    max_tokens: int,
    concurrency: int,
    params: SamplingParams | None = None,
) -> RunStats:
    """Keep ``concurrency`` requests in flight until every prompt is done."""
    params = params or SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    pending = list(enumerate(prompts))
    in_flight = 0
    produced = steps = 0
    steps0 = engine.num_steps
    start = time.perf_counter()
    while pending or in_flight:
        while pending and in_flight < concurrency:
            i, p = pending.pop(0)
            engine.add_request(f"bench-{concurrency}-{i}-{time.monotonic_ns()}", p, params)
            in_flight += 1
        for out in engine.step():
            produced += sum(len(c.delta_token_ids) for c in out.outputs)
            if out.finished:
                in_flight -= 1
                steps += out.stats.num_decode_steps
    return RunStats(time.perf_counter() - start, produced, steps, engine.num_steps - steps0)


def run_hf(model, prompts: list[list[int]], max_tokens: int, batch: int, pad_id: int, device) -> tuple[float, int]:
    produced = 0
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        group = prompts[i : i + batch]
        width = max(len(p) for p in group)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in group], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group], device=device)
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=pad_id,
            )
        produced += (out.shape[1] - width) * len(group)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, produced


def memory_report(engine: LLMEngine) -> dict:
    """Bytes of the target's weights (parameters and buffers: packed quantized weights included), of
    the KV pool (a proposer's own cache too), and the peak so far: CUDA memory allocated on a GPU, the
    process's peak resident set on a CPU (which also counts the Python runtime and libraries)."""
    model = engine.runner.model
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    caches = [engine.runner.kv_cache] + (
        [engine.proposer.runner.kv_cache] if hasattr(engine.proposer, "runner") else []
    )
    kv = sum(c.numel() * c.element_size() for c in caches)
    if engine.device.type == "cuda":
        peak, of = torch.cuda.max_memory_allocated(engine.device), "CUDA allocated"
    else:
        peak, of = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process RSS"
    return {"weights_bytes": weights, "kv_pool_bytes": kv, "peak_bytes": peak, "peak_of": of}


def machine_description(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} CPU threads, torch {torch.__version__}"


def demo_prompts(tokenizer, model_path: Path, n: int) -> list[list[int]] | None:
    """The demo pair's held-out code prefixes, when the model is the demo target."""
    f = Path(model_path).parent / "prompts.jsonl"
    if not f.is_file():
        return None
    texts = [json.loads(line)["prompt"] for line in f.read_text().splitlines() if line.strip()]
    return [tokenizer.encode(t) for t in texts[:n]] if texts else None


def run_bench(cfg: EngineConfig, args: argparse.Namespace) -> int:
    if getattr(args, "speculative", False):
        from loadtest.bench_speculative import run_spec_bench

        return run_spec_bench(cfg, args)
    if getattr(args, "methods", None):
        from loadtest.bench_methods import run_methods_bench

        return run_methods_bench(cfg, args)
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

    results = []
    hf_sequential = None
    for c in sorted(args.concurrency):
        r = run_augur(engine, prompts, args.max_tokens, c, plain)
        row = BenchResult(c, r.tokens, r.tokens_per_s)
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
    quant = f", {cfg.quantization}" if cfg.quantization else ""
    print(
        f"memory{quant}: weights {memory['weights_bytes'] / 2**20:.1f} MiB, KV pool "
        f"{memory['kv_pool_bytes'] / 2**20:.1f} MiB, peak {memory['peak_bytes'] / 2**20:.1f} MiB ({memory['peak_of']})"
    )

    def fmt(x: float | None, spec: str, suffix: str = "") -> str:
        return "-" if x is None else f"{x:{spec}}{suffix}"

    header = ("concurrency", "augur tok/s", "hf seq tok/s", "hf batch tok/s", "vs seq", "vs batch")
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
                {**asdict(r), "ratio_vs_sequential": r.ratio_vs_sequential, "ratio_vs_batched": r.ratio_vs_batched}
                for r in results
            ],
        }
        Path(args.output).write_text(json.dumps(report, indent=2))
    return 0
