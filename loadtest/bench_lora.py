"""LoRA adapters against the base model alone: decode speed, one run, on this machine.

``python -m loadtest.bench_lora [--rounds 3] [--rank 16] [--json PATH] [--quick]`` builds the random
Llama checkpoint loadtest.bench_quant measures (hidden 1024, 8 layers, 16 query heads over 4 KV heads,
MLP 2816, vocab 8192: 107 M parameters) and four random rank-``--rank`` adapters in PEFT's layout (every
attention and MLP projection), and times three engines built as ``augur serve`` builds them here
(``--dtype auto``; eager forwards, which is what a server with adapters runs):

- ``base``: the checkpoint alone, no adapters (the baseline);
- ``base, adapters loaded``: the engine with the four adapters in its slots, every request on the base;
- ``four adapters mixed``: the same engine, request i on adapter i mod 4.

Per way, each round: decode tokens/s at one request (the first adapter alone under the mixed way)
and at eight (64 tokens each after a 16-token prompt, prefill included), and the prefill of one
512-token prompt. The host drifts by a quarter within minutes, so each round measures every way once,
in a rotated order; a cell is the median over rounds and a ratio the median of the rounds' own ratios
to ``base``.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.offline.measure import machine_description
from engine.request.sampling_params import SamplingParams
from loadtest.bench_families import build_checkpoint
from loadtest.bench_quant import QUICK, SHAPE, median_cells

PROJECTIONS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def write_adapter(path: Path, shape, rank: int, seed: int) -> None:
    """A random LoRA adapter of every projection, as PEFT saves one (A and B both non-zero)."""
    g = torch.Generator().manual_seed(seed)
    head = shape.head_dim
    dims = {
        "q_proj": (shape.hidden, shape.heads * head), "k_proj": (shape.hidden, shape.kv_heads * head),
        "v_proj": (shape.hidden, shape.kv_heads * head), "o_proj": (shape.heads * head, shape.hidden),
        "gate_proj": (shape.hidden, shape.intermediate), "up_proj": (shape.hidden, shape.intermediate),
        "down_proj": (shape.intermediate, shape.hidden),
    }  # fmt: skip
    tensors = {}
    for layer in range(shape.layers):
        for block, names in PROJECTIONS.items():
            for name in names:
                fan_in, fan_out = dims[name]
                stem = f"base_model.model.model.layers.{layer}.{block}.{name}"
                tensors[f"{stem}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in**0.5
                tensors[f"{stem}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.01
    path.mkdir(parents=True)
    save_file(tensors, path / "adapter_model.safetensors")
    config = {
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
        "target_modules": [n for names in PROJECTIONS.values() for n in names],
    }  # fmt: skip
    (path / "adapter_config.json").write_text(json.dumps(config))


def engine_for(path: Path, adapters: dict[str, str], rank: int, dtype: str) -> LLMEngine:
    config = EngineConfig(
        model=str(path), device="cpu", dtype=dtype, compile="off", max_num_seqs=8, max_model_len=1024,
        lora_modules=adapters, max_loras=max(len(adapters), 1), max_lora_rank=rank,
    )  # fmt: skip
    return LLMEngine(config)


def timed(engine: LLMEngine, prompts: list[list[int]], tokens: int, loras: list[str | None]) -> float:
    t0 = time.perf_counter()
    for i, (p, lora) in enumerate(zip(prompts, loras, strict=True)):
        engine.add_request(f"b{time.monotonic_ns()}-{i}", p, SamplingParams(temperature=0.0, max_tokens=tokens,
                                                                             ignore_eos=True, lora=lora))  # fmt: skip
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - t0


def measure(engine: LLMEngine, vocab: int, seed: int, names: list[str | None]) -> dict:
    g = torch.Generator().manual_seed(seed)

    def rand(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    loras = [names[i % len(names)] for i in range(8)]
    prefill = timed(engine, [rand(512)], 1, loras[:1])
    c1 = timed(engine, [rand(16)], 64, loras[:1])
    c8 = timed(engine, [rand(16) for _ in range(8)], 64, loras)
    return {"prefill_tok_s": 512 / prefill, "decode_c1_tok_s": 64 / c1, "decode_c8_tok_s": 8 * 64 / c8}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="a tiny shape and one round (a smoke test)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    shape, rounds = (QUICK, 1) if args.quick else (SHAPE, args.rounds)
    root = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    params, _ = build_checkpoint(root / "base", "LlamaForCausalLM", shape)
    adapters = {}
    for i in range(4):
        write_adapter(root / f"a{i}", shape, args.rank, seed=i)
        adapters[f"a{i}"] = str(root / f"a{i}")
    ways = {
        "base": ({}, [None]),
        "base, adapters loaded": (adapters, [None]),
        "four adapters mixed": (adapters, list(adapters)),
    }
    cells: dict[str, list[dict]] = {w: [] for w in ways}
    names = list(ways)
    for r in range(rounds):
        for way in names[r % len(names) :] + names[: r % len(names)]:
            loaded, requests = ways[way]
            engine = engine_for(root / "base", loaded, args.rank, args.dtype)
            row = measure(engine, shape.vocab, seed=r, names=requests)
            cells[way].append(row)
            del engine
            gc.collect()
            print(f"round {r + 1} {way}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()), flush=True)
    keys = list(cells["base"][0])
    print(
        f"\n{machine_description(torch.device('cpu'))}, {torch.get_num_threads()} threads, {params / 1e6:.0f} M "
        f"parameters, rank {args.rank}, {EngineConfig(model='m', dtype=args.dtype).torch_dtype}, {rounds} rounds\n"
    )
    print("| way | " + " | ".join(keys) + " |")
    print("|" + " --- |" * (len(keys) + 1))
    for way in names:
        print(f"| {way} | {median_cells(cells[way], cells['base'], keys)} |")
    if args.json:
        args.json.write_text(json.dumps({"cells": cells, "params": params, "rank": args.rank}, indent=1))
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
