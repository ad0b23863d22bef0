"""Quantized weights and an FP8 KV cache against the plain checkpoint: speed and memory, one run, on this machine.

``python -m loadtest.bench_quant [--rounds 3] [--json PATH] [--quick]`` builds one random-weight Llama
checkpoint at a small but real-ish shape (hidden 1024, 8 layers, 16 query heads over 4 KV heads, MLP
2816, vocab 8192: 107 M parameters) and serves it six ways, each an engine built as ``augur serve``
builds one here (``--dtype`` as given, ``auto`` by default: bfloat16 where the CPU has bf16 units, else
float32; eager forwards, as loadtest.bench_families measures):

- ``plain``: the checkpoint as saved, in the run's dtype (the baseline);
- ``fp8 checkpoint``: the same weights written as an FP8 checkpoint (``quant_method: fp8``, a scale per
  row, e4m3: the layout AutoFP8 writes), read by its ``quantization_config``: served dequantized, as
  every quantized checkpoint is today (docs/quantization.md);
- ``int4 kernel``: ``--quantization int4`` (grouped 4-bit on PyTorch's int4 matmul kernel): what
  serving a 4-bit checkpoint from its packed bytes would run on a CPU instead of dequantizing at load;
- ``fp8 W8A8``: ``--quantization fp8`` (e4m3 weights with a scale per row, per-token e4m3 activations,
  on ``torch._scaled_mm``): what serving an FP8 checkpoint's own bytes runs;
- ``fp8 KV``: the plain checkpoint with ``--kv-cache-dtype fp8``;
- ``int4 + fp8 KV``: both.

Per way, each round: prefill tokens/s (one 512-token prompt, one output token), decode tokens/s at one
request and at eight (64 tokens each after a 16-token prompt, prefill included), decode tokens/s at
one request after 1,536 tokens of context (where the cache's reads weigh most: 64 tokens' time, the
prompt's prefill taken off as another prompt of that length measures it), and memory: the weights' bytes and the
KV cache's bytes per token. The host drifts by a quarter within minutes, so each round measures every
way once, in a rotated order; a cell is the median over rounds and a ratio the median of the rounds'
own ratios to plain's. Greedy tokens of each way are compared with plain's (the quantized ways are other
models: the count of leading tokens they share is reported, not asserted).

Once per way that changes the weights (and for the FP8 checkpoint under ``--quantization fp8``, served
from its own bytes), in a process of its own: the load's peak anonymous memory
(``RssAnon``, sampled every millisecond while ``load_model`` runs, less what the process held before),
against the loaded model's weight bytes: ``--quantization int4`` / ``fp8`` convert each layer as its
weight arrives (engine/quant/streamed.py), so their peak is the quantized model plus a layer, not the
full-precision model.

With ``--demo`` (the shipped demo target), it also reports the FP8 cache's logit error on a trained
model: teacher-forced logits over held-out prompts with each cache, the largest difference relative
to the largest logit and the share of positions whose top token agrees.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.offline.measure import machine_description, memory_report
from engine.request.sampling_params import SamplingParams
from loadtest.bench_families import Shape, build_checkpoint

SHAPE = Shape(vocab=8192, hidden=1024, layers=8, heads=16, kv_heads=4, head_dim=64, intermediate=2816)
QUICK = Shape(vocab=2048, hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, intermediate=512)
WAYS = {
    "plain": dict(),
    "fp8 checkpoint": dict(checkpoint="fp8"),
    "int4 kernel": dict(quantization="int4"),
    "fp8 W8A8": dict(quantization="fp8"),
    "fp8 KV": dict(kv_cache_dtype="fp8"),
    "int4 + fp8 KV": dict(quantization="int4", kv_cache_dtype="fp8"),
}
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_fp8_checkpoint(src: Path, dst: Path) -> None:
    """``src`` with every decoder linear stored as e4m3 and a float32 scale per row (``weight_scale``,
    the row's largest magnitude over 448), under ``quantization_config: {quant_method: fp8}``."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    out = {}
    for name, t in tensors.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in LINEARS:
            w = t.float()
            scale = w.abs().amax(1, keepdim=True).clamp(min=1e-12) / 448.0
            out[name] = (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
            out[f"{module}.weight_scale"] = scale
        else:
            out[name] = t
    save_file(out, dst / "model.safetensors")
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (dst / "config.json").write_text(json.dumps(config, indent=2))


def engine_for(path: Path, way: dict, max_len: int, dtype: str) -> LLMEngine:
    kw = {k: v for k, v in way.items() if k != "checkpoint"}
    config = EngineConfig(
        model=str(path), device="cpu", dtype=dtype, compile="off", max_num_seqs=8, max_model_len=max_len, **kw
    )
    return LLMEngine(config)


def timed(engine: LLMEngine, prompts: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    return time.perf_counter() - t0, [o.outputs[0].delta_token_ids for o in outs]


def measure(engine: LLMEngine, vocab: int, seed: int, long_ctx: int) -> tuple[dict, list[int]]:
    g = torch.Generator().manual_seed(seed)

    def rand(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    prefill_s, _ = timed(engine, [rand(512)], 1)
    short = [rand(16) for _ in range(8)]
    c1_s, c1_tokens = timed(engine, short[:1], 64)
    c8_s, _ = timed(engine, short, 64)
    # at long context: a decode's time is one prompt's 65 tokens less another's (same length) first one
    first_s, _ = timed(engine, [rand(long_ctx)], 1)
    whole_s, _ = timed(engine, [rand(long_ctx)], 65)
    long_s = max(whole_s - first_s, 1e-9)
    mem = memory_report(engine)
    return {
        "prefill_tok_s": 512 / prefill_s,
        "decode_c1_tok_s": 64 / c1_s,
        "decode_c8_tok_s": 8 * 64 / c8_s,
        f"decode_c1_at_{long_ctx}_tok_s": 64 / long_s,
        "weights_MiB": mem["weights_bytes"] / 2**20,
        "kv_bytes_per_token": engine.runner.kv_bytes_per_token,
    }, c1_tokens[0]


_LOAD_PEAK = """
import sys, threading, time, torch
from pathlib import Path
from engine.runner.loader import load_config, load_model

def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024

path, quantization, dtype = Path(sys.argv[1]), sys.argv[2] or None, getattr(torch, sys.argv[3])
config = load_config(path)
base, peak, done = anon(), [0], []

def sample():
    while not done:
        peak[0] = max(peak[0], anon())
        time.sleep(0.001)

t = threading.Thread(target=sample)
t.start()
model = load_model(path, config, dtype, torch.device("cpu"), 2048, pack=False, quantization=quantization)
done.append(1)
t.join()
held = sum({t.data_ptr(): t.nbytes for t in [*model.parameters(), *model.buffers()]}.values())
print(max(peak[0], anon()) - base, held)
"""


def load_peak(path: Path, quantization: str | None, dtype: torch.dtype) -> tuple[float, float]:
    """(the load's peak anonymous memory, the loaded model's tensors' bytes: parameters and buffers, the
    int4 layers' packed weights and the RoPE tables included), MiB, in a fresh process."""
    out = subprocess.run(
        [sys.executable, "-c", _LOAD_PEAK, str(path), quantization or "", str(dtype).removeprefix("torch.")],
        capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parents[1],
        # glibc's malloc otherwise raises its mmap threshold as large blocks are freed and keeps later
        # ones in its heap: the process's memory would then count freed weights, by chance
        env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"},
    )  # fmt: skip
    peak, held = out.stdout.split()[-2:]
    return int(peak) / 2**20, int(held) / 2**20


def median_cells(rounds: list[dict], base: list[dict], keys: list[str]) -> str:
    """A table row's cells: each key's median over the rounds and the median of the rounds' own
    ratios to ``base``'s (the host drifts: a round's ratio is paired seconds apart)."""
    cells = []
    for k in keys:
        ratio = statistics.median(c[k] / b[k] for c, b in zip(rounds, base, strict=True))
        cells.append(f"{statistics.median(c[k] for c in rounds):.1f} ({ratio:.2f}x)")
    return " | ".join(cells)


def leading_agreement(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def demo_logit_error(prompts_n: int = 8) -> dict | None:
    """The FP8 cache's logits on the shipped demo target against its own cache's, teacher-forced."""
    from transformers import AutoTokenizer

    from engine.assets import shipped_demo
    from engine.offline.measure import demo_prompts
    from engine.runner.loader import load_config, load_model
    from engine.runner.model_runner import ForwardChunk, ModelRunner

    demo = shipped_demo()
    if demo is None:
        return None
    path = demo / "target"
    config = load_config(path)
    ids = [p[:256] for p in demo_prompts(AutoTokenizer.from_pretrained(path), path, prompts_n) or []]
    if not ids:
        return None
    result = {}
    for dtype in (torch.float32, torch.bfloat16):
        logits = {}
        for kvd in ("auto", "fp8"):
            model = load_model(path, config, dtype, torch.device("cpu"), 512, pack=False)
            runner = ModelRunner(model, config, torch.device("cpu"), dtype, 16, num_blocks=32, kv_cache_dtype=kvd)
            rows = []
            for p in ids:
                blocks = list(range(-(-len(p) // 16)))
                chunk = ForwardChunk(token_ids=p, ctx_len=0, block_table=blocks, num_logits=len(p))
                rows.append(runner.forward([chunk]).logits.float())
            logits[kvd] = torch.cat(rows)
        diff = (logits["fp8"] - logits["auto"]).abs()
        top = (logits["fp8"].argmax(-1) == logits["auto"].argmax(-1)).float().mean().item()
        name = str(dtype).removeprefix("torch.")
        result[name] = {
            "max_abs_over_max_logit": (diff.max() / logits["auto"].abs().max()).item(),
            "mean_abs": diff.mean().item(),
            "top1_agreement": top,
            "positions": logits["auto"].shape[0],
        }
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a tiny shape and one round (a smoke test)")
    ap.add_argument("--demo", action="store_true", help="also the FP8 cache's logit error on the demo target")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    shape, rounds, long_ctx = (QUICK, 1, 256) if args.quick else (SHAPE, args.rounds, 1536)
    root = Path(tempfile.mkdtemp(prefix="bench-quant-"))
    base = root / "plain"
    params, _ = build_checkpoint(base, "LlamaForCausalLM", shape)
    write_fp8_checkpoint(base, root / "fp8")
    paths = {"plain": base, "fp8": root / "fp8"}
    cells: dict[str, list[dict]] = {w: [] for w in WAYS}
    agree: dict[str, list[int]] = {w: [] for w in WAYS}
    names = list(WAYS)
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        tokens = {}
        for way in order:
            spec = WAYS[way]
            engine = engine_for(paths[spec.get("checkpoint", "plain")], spec, max(long_ctx, 512) + 128, args.dtype)
            row, tokens[way] = measure(engine, shape.vocab, seed=r, long_ctx=long_ctx)
            cells[way].append(row)
            del engine
            gc.collect()
            print(f"round {r + 1} {way}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()), flush=True)
        for way in names:
            agree[way].append(leading_agreement(tokens[way], tokens["plain"]))

    keys = list(cells["plain"][0])
    print(
        f"\n{machine_description(torch.device('cpu'))}, {torch.get_num_threads()} threads, "
        f"{params / 1e6:.0f} M parameters, {EngineConfig(model='m', dtype=args.dtype).torch_dtype}, {rounds} rounds\n"
    )
    print("| way | " + " | ".join(keys) + " | leading tokens equal to plain's (of 64) |")
    print("|" + " --- |" * (len(keys) + 2))
    for way in names:
        print(f"| {way} | {median_cells(cells[way], cells['plain'], keys)} | {statistics.median(agree[way]):.0f} |")
    dtype = EngineConfig(model="m", dtype=args.dtype).torch_dtype
    peaks = {}
    loads = {way: WAYS[way] for way in ("plain", "fp8 checkpoint", "int4 kernel", "fp8 W8A8")}
    loads["fp8 checkpoint, --quantization fp8"] = dict(checkpoint="fp8", quantization="fp8")  # its own bytes
    for way, spec in loads.items():
        peaks[way] = load_peak(paths[spec.get("checkpoint", "plain")], spec.get("quantization"), dtype)
    print("\n| way | load peak MiB | loaded tensors MiB |\n| --- | --- | --- |")
    for way, (peak, held) in peaks.items():
        print(f"| {way} | {peak:.0f} | {held:.0f} |")
    demo = demo_logit_error() if args.demo else None
    if demo:
        print("\nFP8 cache on the demo target (teacher-forced):", json.dumps(demo, indent=1))
    if args.json:
        out = {"cells": cells, "agree": agree, "demo": demo, "params": params, "load_peak": peaks}
        args.json.write_text(json.dumps(out, indent=1))
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
