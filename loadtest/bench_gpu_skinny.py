"""The few-rows linear kernel against cuBLAS at a model's layer shapes: ``python -m loadtest.bench_gpu_skinny``.

``augur::skinny_linear`` (engine/models/skinny_linear.py) streams a weight once for up to 64 rows.
Whether it beats cuBLAS where a decode spends its time is a measurement. For each distinct linear
layer of ``--shape`` (qkv, o, gate-up, down and the LM head; random bfloat16 weights) and each row
count of ``--rows``, this times:

* ``F.linear`` (cuBLAS), or with ``--dtype fp8`` (``--quantization fp8``'s layer: e4m3 weights with a
  scale per row, rows quantized per token) ``torch._scaled_mm``, or with ``--dtype int4``
  (``--quantization int4``'s layer, 4-bit integers in groups) PyTorch's int4 kernel;
* the kernel at the tiles it would launch (:func:`engine.models.skinny_linear.tiles`);
* at the row counts of ``--sweep-rows``, every tile shape of the sweep (``--block-n``, ``--block-k``,
  ``--stages``, ``--warps``; at one row, on the tensor cores and on the CUDA cores), and the best;

each as the median of ``--repeats`` replays of a CUDA graph of calls that cycle through enough copies
of the weight (``--l2-bytes`` at least) that no call finds its weight in the L2 cache, as a decode's
layers do not. Each figure is given as the bandwidth of the bytes the call must move (weight, rows
in and out) over the device-to-device copy bandwidth measured in the same run; the largest
difference from ``F.linear``'s result is kept beside it. ``--output`` is rewritten after each layer,
so a run cut short keeps what it measured. ``--shape tiny --device cpu`` runs the kernel in Triton's
interpreter (``TRITON_INTERPRET=1``; the tests do).
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from loadtest.bench_gpu import SHAPES, copy_bandwidth, device_name, model_config, record_each, timed


def layer_shapes(name: str) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each linear layer of ``name``'s shape."""
    c = model_config(name, 4096)
    heads, kv = c.num_attention_heads, c.num_key_value_heads or c.num_attention_heads
    hd = getattr(c, "head_dim", None) or c.hidden_size // heads
    return {
        "qkv": ((heads + 2 * kv) * hd, c.hidden_size),
        "o": (c.hidden_size, heads * hd),
        "gate_up": (2 * c.intermediate_size, c.hidden_size),
        "down": (c.hidden_size, c.intermediate_size),
        "lm_head": (c.vocab_size, c.hidden_size),
    }


def operands(n: int, k: int, m: int, args, device: torch.device, g: torch.Generator, copies: int):
    """(x, weights, baseline(x, w), kernel(x, w, tiles), bytes a call moves) for ``args.dtype``: 16-bit
    weights against ``F.linear``; ``fp8``, e4m3 weights with a scale per row and rows quantized per
    token (``--quantization fp8``'s layer) against ``torch._scaled_mm``; ``int4``: :func:`int4_operands`."""
    from engine.models.skinny_linear import skinny_linear
    from engine.quant.fp8 import Fp8Linear, quantize_rows

    dense = torch.bfloat16 if args.dtype in ("fp8", "int4") else getattr(torch, args.dtype)
    x = torch.randn(m, k, device=device, dtype=dense, generator=g)
    weights = [torch.empty(n, k, device=device, dtype=dense).normal_(0.0, 0.02, generator=g) for _ in range(copies)]
    if args.dtype == "int4":
        return (x, *int4_operands(weights, m, device))
    if args.dtype != "fp8":
        moved = (n * k + m * (k + n)) * 2
        return x, weights, F.linear, lambda x, w, t: skinny_linear(x, w, None, t), moved
    weights = [quantize_rows(w) for w in weights]  # (e4m3 [n, k], float32 [n])
    xq, sx = Fp8Linear.tokens(x)

    def baseline(x, w):
        return torch._scaled_mm(x[0], w[0].t(), x[1], w[1].view(1, -1), out_dtype=torch.bfloat16)

    def kernel(x, w, t):
        return skinny_linear(x[0], w[0], None, t, scales=(x[1].view(-1), w[1]), out_dtype=torch.bfloat16)

    return (xq, sx), weights, baseline, kernel, n * k + m * k + m * n * 2


def int4_operands(weights: list[torch.Tensor], m: int, device: torch.device):
    """``--dtype int4`` (``--quantization int4``'s layer): each weight as PyTorch's int4 kernel takes it
    (the baseline) and by rows for the few-rows kernel (which has one tile shape)."""
    from engine.models.skinny_linear import pack_rows, skinny_int4_linear
    from engine.quant.int4 import COMPUTE_DTYPE, Int4Linear, group_size_for, quantize_int4

    n, k = weights[0].shape
    group = group_size_for(k, n)
    layers = []
    for w in weights:
        q, scale, lo = quantize_int4(w, group)
        layer = Int4Linear(k, n, group, None)
        layer.set_weight(q, scale, lo, device)
        layers.append((layer, pack_rows(q)))

    def baseline(x, lw):
        layer = lw[0]
        mm = torch.ops.aten._weight_int4pack_mm if x.is_cuda else torch.ops.aten._weight_int4pack_mm_for_cpu
        return mm(x.to(COMPUTE_DTYPE), layer.packed, layer.group_size, layer.scales_and_zeros)

    def kernel(x, lw, t):
        return skinny_int4_linear(x, lw[1], lw[0].scales_and_zeros, group)

    moved = n * k // 2 + (k // group) * n * 4 + 2 * m * (k + n)
    return layers, baseline, kernel, moved


def measure_layer(n: int, k: int, args, device: torch.device, bandwidth: float) -> dict:
    from engine.models.skinny_linear import Tiles, multiprocessors, tiles

    g = torch.Generator(device=device).manual_seed(n + k)
    weight_bytes = n * k * {"fp8": 1, "int4": 0.5}.get(args.dtype, 2)
    copies = max(1, int(-(-args.l2_bytes // weight_bytes))) if device.type == "cuda" else 1
    chosen = tiles(n, k, multiprocessors(device))
    row = dict(out_features=n, in_features=k, weight_mb=weight_bytes / 1e6, copies=copies, tiles=vars(chosen),
               by_rows={})  # fmt: skip
    for m in args.rows:
        x, weights, baseline, kernel, moved = operands(n, k, m, args, device, g, copies)

        def of_copy(seconds: float, moved=moved) -> float:
            return moved / seconds / bandwidth

        def time_calls(fn, x=x, weights=weights) -> float:  # fn(x, w) for each copy of the weight in turn
            return timed([lambda w=w: fn(x, w) for w in weights], device, args.repeats)

        want = baseline(x, weights[0])
        cublas = time_calls(baseline)
        mine = time_calls(lambda x, w, kernel=kernel: kernel(x, w, chosen))
        diff = float((kernel(x, weights[0], chosen).float() - want.float()).abs().max())
        r = dict(cublas_us=cublas * 1e6, cublas_of_copy=of_copy(cublas), kernel_us=mine * 1e6,
                 kernel_of_copy=of_copy(mine), max_abs_diff=diff)  # fmt: skip
        if m in args.sweep_rows and args.dtype != "int4":  # (int4's kernel has one tile shape)
            sweep = []
            dots = (True, False) if m == 1 else (True,)
            grid = itertools.product(args.block_n, args.block_k, args.stages, args.warps, dots)
            for bn, bk, stages, warps, dot in grid:
                t = Tiles(block_n=bn, block_k=min(bk, k), num_warps=warps, num_stages=stages, dot=dot)
                try:
                    s = time_calls(lambda x, w, t=t, kernel=kernel: kernel(x, w, t))
                except Exception as exc:  # a tile shape the device cannot hold (shared memory): noted, skipped
                    sweep.append(dict(tiles=vars(t), error=f"{type(exc).__name__}: {str(exc)[:120]}"))
                    continue
                sweep.append(dict(tiles=vars(t), us=s * 1e6, of_copy=of_copy(s)))
            done = [s for s in sweep if "us" in s]
            r["sweep"] = sweep
            r["best"] = min(done, key=lambda s: s["us"]) if done else None
        row["by_rows"][m] = r
        best = r.get("best")
        print(f"  {n} x {k}, {m} rows: baseline {r['cublas_us']:.1f} us ({r['cublas_of_copy']:.0%} of copy), kernel "
              f"{r['kernel_us']:.1f} us ({r['kernel_of_copy']:.0%})"
              + (f", best of sweep {best['us']:.1f} us ({best['of_copy']:.0%}) at {best['tiles']}" if best else "")
              + f"; max |diff| {diff:.3g}", flush=True)  # fmt: skip
    return row


def run(args) -> dict:
    device = torch.device(args.device)
    bandwidth = copy_bandwidth(device, 1 << 30 if device.type == "cuda" else 1 << 26)
    print(f"device: {device_name(device)}; copy {bandwidth / 1e9:.0f} GB/s; {args.shape}; {args.dtype}", flush=True)
    report: dict = dict(device=device_name(device), shape=args.shape, dtype=args.dtype, torch=torch.__version__,
                        copy_bandwidth_gb_s=bandwidth / 1e9, layers={}, errors=[])  # fmt: skip
    layers = layer_shapes(args.shape).items()
    runs = [(name, lambda n=n, k=k: measure_layer(n, k, args, device, bandwidth)) for name, (n, k) in layers]
    return record_each(report, "layers", runs, args.output, device)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-3.1-8b", choices=SHAPES)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "fp8", "int4"],
                    help="the weights: 16-bit against F.linear; fp8 (W8A8, per-row and per-token scales) against "
                    "torch._scaled_mm; int4 (4-bit groups) against PyTorch's int4 kernel")  # fmt: skip
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--sweep-rows", type=int, nargs="*", default=[1, 16, 64], help="row counts that sweep tiles")
    ap.add_argument("--block-n", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--block-k", type=int, nargs="+", default=[128, 256, 512])
    ap.add_argument("--stages", type=int, nargs="+", default=[3, 5])
    ap.add_argument("--warps", type=int, nargs="+", default=[4])
    ap.add_argument("--l2-bytes", type=int, default=256 << 20, help="weights cycled per timed graph, at least")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--output", default=None, help="write the results as JSON (after each layer)")
    args = ap.parse_args(argv)
    report = run(args)
    if report["errors"]:
        print("errors: " + "; ".join(report["errors"]))
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
