"""A target's step under each serving option that changes its kernels, against the bound of the bytes it
reads: ``python -m loadtest.bench_gpu_variants``.

``loadtest.bench_gpu_scale`` measures the plain model. This measures, for one dense shape (random
weights, ``loadtest.bench_gpu.build``, CUDA graphs as served, ``--context`` tokens of K/V in every
sequence), the same forwards as each option serves them:

* ``plain``: bfloat16 weights on the fused kernels (the default);
* ``unfused``: the same weights with the small operators eager (``use_fused_ops(model, False)``): what
  the fused kernels (engine/models/fused.py; a mixture's routing and row layout, engine/models/moe_triton.py)
  save;
* ``invariant``: ``--batch-invariant on`` (engine/models/invariant_cuda.py: one tile shape and a fixed
  split of K for every batch size), whose cost issue 57 asks for;
* ``int4``: ``--quantization int4`` (4-bit weights in groups, engine/quant/int4.py);
* ``fp8``: ``--quantization fp8`` (e4m3 weights and tokens, W8A8 on ``torch._scaled_mm``);
* ``skinny``: every linear layer on ``augur::skinny_linear`` (engine/models/skinny_linear.py) for its
  calls of up to 64 rows, instead of cuBLAS; ``fp8-skinny``: ``fp8``'s layers on the same kernel's
  e4m3 products instead of ``torch._scaled_mm``; ``int4-skinny``: ``int4``'s layers on its 4-bit
  kernel (CUDA) instead of PyTorch's: all opt-in until this has measured them;
* ``lora``: four LoRA adapters of rank 16 on every adaptable layer, a batch's sequences spread over
  them (sequence ``i`` under adapter ``i % 4``), and beside it the same runner's base rows alone
  (``decode_base_ms``);

and each mixture shape (``--moe-shapes``, under each of ``--moe-variants``, plain by default) against
the bound set by the bytes its routed experts
read: at batch B with k of E experts a token, the expected number of distinct experts a layer reads is
``E (1 - (1 - k/E)^B)`` when routing is uniform, as it is for random router weights.

Per option: decode at each of ``--batch-sizes``, a 4-token verify at the first, and a prefill of
``--prefill`` tokens, each against its bound (memory: the bytes read over the copy bandwidth, measured
in the same run; a prefill: compute, two FLOPs a weight a token over a large matrix product's rate).
Each option's figures print as soon as they are measured and ``--output`` is rewritten after each, so
a run cut short by its time limit keeps what it measured. ``--shape tiny`` runs on CPU (the tests do).
"""

from __future__ import annotations

import argparse
import gc
import json
import traceback

import torch
from torch import nn

from engine.lora import LoraSlots
from engine.models import model_class_for
from engine.models.llama import use_fused_ops
from engine.quant.fp8 import quantize_linears_fp8
from engine.quant.int4 import quantize_linears_int4
from engine.runner.model_runner import ForwardChunk
from loadtest.bench_gpu import BLOCK, SHAPES, build, copy_bandwidth, device_name, model_config, sync, time_forward
from loadtest.bench_gpu_scale import fill_pool, linear_flops, matmul_rate, tables

VARIANTS = ("plain", "unfused", "invariant", "int4", "fp8", "skinny", "fp8-skinny", "int4-skinny", "lora")
LORA_ADAPTERS, LORA_RANK = 4, 16


def _lora(model: nn.Module) -> None:
    """Four adapters' slots on every adaptable layer, filled with random A and B (scale folded in)."""
    slots = LoraSlots.attach(model, LORA_ADAPTERS, LORA_RANK, rows=4096)
    g = torch.Generator(device=slots.device).manual_seed(1)
    for layer in slots.layers.values():
        layer.a.normal_(0.0, 0.02, generator=g)
        layer.b.normal_(0.0, 0.02, generator=g)


def _skinny(model: nn.Module) -> None:
    from engine.models.skinny_linear import use_skinny_linear  # (needs Triton)

    use_skinny_linear(model)


PREPARE = {
    "plain": None,
    "unfused": lambda model: use_fused_ops(model, False),
    "invariant": None,
    "int4": quantize_linears_int4,
    "fp8": quantize_linears_fp8,
    "skinny": _skinny,
    "fp8-skinny": lambda model: (quantize_linears_fp8(model), _skinny(model)),
    "int4-skinny": lambda model: (quantize_linears_int4(model), _skinny(model)),
    "lora": _lora,
}


def stored_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes a forward reads of the model's weights and buffers, of which its mixture experts'): an
    untied embedding table is a lookup and left out, and a LoRA layer's slots are counted."""
    total = experts = 0
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if name.endswith("embed_tokens.weight") and model.lm_head is not None:
            continue
        n = t.numel() * t.element_size()
        total += n
        if ".experts_" in name:
            experts += n
    lora = getattr(model, "lora", None)
    if lora is not None:
        total += sum(layer.a.numel() * layer.a.element_size() + layer.b.numel() * layer.b.element_size()
                     for layer in lora.layers.values())  # fmt: skip
    return total, experts


def expert_share(config, rows: int) -> float:
    """The expected fraction of a layer's experts that ``rows`` tokens route to, uniformly at random."""
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if not experts:
        return 1.0
    k = config.num_experts_per_tok
    return 1.0 - (1.0 - k / experts) ** rows


def linear_flops_per_token(shape: str, max_positions: int) -> float:
    """A token's matrix-product FLOPs (``bench_gpu_scale.linear_flops``: the layers', a mixture's routed
    experts only, and the output layer's), counted on the full-precision model built on the meta device:
    a quantized layer does the same products from fewer bytes."""
    config = model_config(shape, max_positions)
    with torch.device("meta"):
        model = model_class_for(config)(config, max_positions)
    return sum(linear_flops(model, getattr(config, "num_experts_per_tok", 0)))


def measure(shape: str, variant: str, args, device, dtype, bandwidth: float, rate: float) -> dict:
    max_positions = max(args.context + 16, args.prefill + 8)
    blocks_each = -(-(args.context + 16) // BLOCK)
    B_max = max(args.batch_sizes)
    prepare = PREPARE[variant]
    graphs = args.cuda_graphs == "on"
    invariant = variant == "invariant"
    runner, config = build(shape, device, dtype, max_positions, "auto", graphs, prepare, invariant=invariant)
    runner.cuda_graph_max_seqs = B_max if runner.cuda_graph_max_seqs else 0
    runner.allocate_kv(max(B_max * blocks_each, -(-args.prefill // BLOCK)) + 1)
    fill_pool(runner)
    weights, experts = stored_bytes(runner.model)
    flops = linear_flops_per_token(shape, max_positions)
    adapter = (lambda i: i % LORA_ADAPTERS) if variant == "lora" else (lambda i: -1)
    out = dict(shape=shape, variant=variant, weights_gb=weights / 1e9, experts_gb=experts / 1e9, cuda_graphs=graphs,
               kv_bytes_per_token=runner.kv_bytes_per_token,
               params_b=sum(p.numel() for p in runner.model.parameters()) / 1e9, decode={})  # fmt: skip
    if variant == "lora":  # the base model's rows alone on the same runner: what the adapters add
        out["decode_base_ms"] = {B: time_forward(runner, [ForwardChunk([5], args.context, t, 1) for t in tables(
            B, blocks_each)], args.repeats) * 1e3 for B in args.batch_sizes}  # fmt: skip
    for B in args.batch_sizes:
        chunks = [ForwardChunk([5], args.context, t, 1, lora=adapter(i)) for i, t in enumerate(tables(B, blocks_each))]
        step = time_forward(runner, chunks, args.repeats)
        read = weights - experts * (1.0 - expert_share(config, B)) + B * args.context * runner.kv_bytes_per_token
        memory = read / bandwidth
        out["decode"][B] = dict(ms=step * 1e3, tokens_per_s=B / step, memory_bound_ms=memory * 1e3,
                                fraction_of_bound=memory / step)  # fmt: skip
        print(f"{shape} {variant}: batch {B} decode {step * 1e3:.2f} ms ({B / step:.0f} tok/s), memory bound "
              f"{memory * 1e3:.2f} ms ({memory / step:.0%})", flush=True)  # fmt: skip
    first = tables(1, blocks_each)[0]
    verify = time_forward(runner, [ForwardChunk([5] * 4, args.context, first, 4, lora=adapter(0))], args.repeats)
    out["verify4_ms"] = verify * 1e3
    out["verify4_vs_decode"] = verify / (out["decode"][args.batch_sizes[0]]["ms"] / 1e3)
    if args.prefill:
        ids = [(7 * i) % 1000 + 3 for i in range(args.prefill)]
        chunk = ForwardChunk(ids, 0, list(range(-(-args.prefill // BLOCK))), 1, lora=adapter(0))
        t = time_forward(runner, [chunk], max(3, args.repeats // 4))
        bound = args.prefill * flops / rate
        out["prefill"] = dict(tokens=args.prefill, ms=t * 1e3, compute_bound_ms=bound * 1e3,
                              fraction_of_bound=bound / t)  # fmt: skip
        print(f"{shape} {variant}: 4-token verify {out['verify4_vs_decode']:.2f}x a decode; prefill {args.prefill} "
              f"tokens {t * 1e3:.1f} ms ({bound / t:.0%} of the compute bound)", flush=True)  # fmt: skip
    del runner
    gc.collect()  # (a runner's graphs hold their memory pool until its cycles are collected)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-3.1-8b", choices=SHAPES, help="the dense shape the options run on")
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--moe-shapes", nargs="*", default=["qwen3-30b-a3b", "gpt-oss-20b"], choices=SHAPES)
    ap.add_argument("--moe-variants", nargs="+", default=["plain"], choices=VARIANTS, help="each mixture's options")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--context", type=int, default=1024, help="tokens already in each sequence's cache")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prefill", type=int, default=2048, help="tokens of the prefill measured (0: none)")
    ap.add_argument("--cuda-graphs", choices=["on", "off"], default="on")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--output", default=None, help="write the results as JSON (rewritten after each option)")
    args = ap.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    bandwidth = copy_bandwidth(device, 1 << 30 if device.type == "cuda" else 1 << 26)
    rate = matmul_rate(device, dtype)
    report: dict = dict(device=device_name(device), dtype=args.dtype, context=args.context, torch=torch.__version__,
                        copy_bandwidth_gb_s=bandwidth / 1e9, matmul_tflops=rate / 1e12,
                        results=[], errors=[])  # fmt: skip
    print(f"device: {report['device']}; copy {bandwidth / 1e9:.0f} GB/s; matmul {rate / 1e12:.1f} TFLOP/s; "
          f"{args.dtype}; context {args.context}", flush=True)  # fmt: skip
    runs = [(args.shape, v) for v in args.variants] + [(s, v) for s in args.moe_shapes for v in args.moe_variants]
    for shape, variant in runs:
        try:
            report["results"].append(measure(shape, variant, args, device, dtype, bandwidth, rate))
        except Exception as exc:  # one failing option must not lose the others' figures
            traceback.print_exc()
            report["errors"].append(f"{shape} {variant}: {type(exc).__name__}: {exc}")
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if args.output:
            with open(args.output, "w") as f:
                json.dump(report, f, indent=1)
        sync(device)
    if report["errors"]:
        print("errors: " + "; ".join(report["errors"]))
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
