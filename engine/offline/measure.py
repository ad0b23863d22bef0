"""Measuring the engine in-process: prompts, timed runs at a fixed concurrency, Hugging Face ``generate``
as a baseline, memory and the machine's name. Shared by the benchmarks (loadtest/) and the tuner
(``augur tune-layer-skip``); nothing ``augur serve`` loads imports it.
"""

from __future__ import annotations

import json
import os
import platform
import random
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.core.llm_engine import LLMEngine
from engine.request.sampling_params import SamplingParams


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
