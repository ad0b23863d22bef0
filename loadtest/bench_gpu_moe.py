"""A mixture's GPU kernels at its published shape, against the bytes they must read:
``python -m loadtest.bench_gpu_moe``.

At batch 1 a Qwen3-30B-A3B decode ran at 17% of the bound its routed experts' bytes set (the fifth
GPU run, docs/benchmarks.md): the routing's small kernels and the experts' few programs at one row.
For each shape of ``--shapes`` (one layer's router and experts, random bfloat16 weights) and each
token count of ``--tokens``, this times:

* the routing and the slots' layout as the fused operators run them (``augur::moe_route``'s kernel and
  the one-program layout, engine/models/moe_triton.py) and as the eager operators do (softmax, top-k,
  renormalization, torch's sort, counts and scans): the launches the fused ones save;
* the experts (``triton_moe_experts``: gate-up with the activation, down, the weighted sum) at the
  tiles a call runs at (:func:`engine.models.moe_triton.expert_tiles`), and at every tile of the sweep
  (``--block-n``, ``--block-k``, ``--warps``, ``--stages``) with the best;

each as the median of ``--repeats`` replays of a CUDA graph of calls whose tokens route to other
experts call by call (``--l2-bytes`` of expert weights at least), so that no call finds its experts in
the L2 cache, as a decode's layers do not. The experts' figures are given as the bandwidth of the bytes
a call must read (each expert its tokens chose, once) over the device-to-device copy bandwidth
measured in the same run; each tile's largest difference from the default tiles' output is kept
beside it. ``--output`` is rewritten after each shape, so a run cut short keeps what it measured.
``--shapes tiny-moe --device cpu`` runs the kernels in Triton's interpreter (the tests do).
"""

from __future__ import annotations

import argparse
import itertools

import torch

from engine.models.moe import moe_route
from engine.models.moe_triton import (
    ExpertTiles,
    device_row_blocks,
    expert_tiles,
    row_blocks,
    triton_moe_experts,
    triton_moe_route,
)
from loadtest.bench_gpu import SHAPES, copy_bandwidth, device_name, model_config, record_each, timed


def layer_of(shape: str) -> dict:
    """One mixture layer's sizes at ``shape``: experts, k, hidden, inner, renormalization, activation."""
    c = model_config(shape, 4096)
    experts = getattr(c, "num_experts", None) or c.num_local_experts
    gpt_oss = c.architectures[0] == "GptOssForCausalLM"
    inner = c.intermediate_size if gpt_oss else c.moe_intermediate_size
    return dict(experts=experts, k=c.num_experts_per_tok, hidden=c.hidden_size, inner=inner,
                renormalize=bool(getattr(c, "norm_topk_prob", False)), after=gpt_oss,
                act="clamped_swiglu" if gpt_oss else "silu", biases=gpt_oss)  # fmt: skip


def measure_shape(shape: str, args, device: torch.device, bandwidth: float) -> dict:
    L = layer_of(shape)
    E, k, H, I = L["experts"], L["k"], L["hidden"], L["inner"]  # noqa: E741
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    gate_up = torch.randn(E, 2 * I, H, generator=g, device=device).mul_(0.02).to(dtype)
    down = torch.randn(E, H, I, generator=g, device=device).mul_(0.02).to(dtype)
    biases = (torch.zeros(E, 2 * I, device=device, dtype=dtype), torch.zeros(E, H, device=device, dtype=dtype))
    layer = dict(L, gate_up=gate_up, down=down, biases=biases if L["biases"] else (None, None), dtype=dtype)
    expert_bytes = (gate_up[0].numel() + down[0].numel()) * gate_up.element_size()
    out: dict = dict(shape=shape, experts=E, k=k, hidden=H, inner=I, expert_mb=expert_bytes / 1e6, tokens={})
    for T in args.tokens:
        out["tokens"][T] = measure_tokens(shape, T, layer, expert_bytes, args, device, bandwidth, g)
    return out


def measure_tokens(shape, T: int, layer: dict, expert_bytes: int, args, device, bandwidth: float, g) -> dict:
    """One token count's routing and experts (see the module docstring)."""
    E, k, H, dtype = layer["experts"], layer["k"], layer["hidden"], layer["dtype"]
    renormalize, after = layer["renormalize"], layer["after"]
    block_m = expert_tiles(T, k, E, dtype, "fused").block_m
    # Enough calls that their experts overflow L2; each token k distinct experts, uniformly.
    calls = max(1, min(64, -(-args.l2_bytes // (min(E, T * k) * expert_bytes))))
    xs = [torch.randn(T, H, generator=g, device=device).to(dtype) for _ in range(calls)]
    logits = [torch.randn(T, E, generator=g, device=device).to(dtype) for _ in range(calls)]
    routes = [moe_route(lg, k, renormalize, after) for lg in logits]
    distinct = sum(int(ids.unique().numel()) for ids, _ in routes) / calls
    moved = distinct * expert_bytes + 2 * T * H * layer["gate_up"].element_size()

    def experts(t: ExpertTiles | None, i: int) -> torch.Tensor:
        ids, w = routes[i]
        weights = (layer["gate_up"], layer["down"], *layer["biases"])
        return triton_moe_experts(xs[i], ids, w, *weights, layer["act"], "fused", 1.702, 7.0, tiles=t)

    def eager_routing(i: int):
        return row_blocks(moe_route(logits[i], k, renormalize, after)[0], E, block_m)

    def fused_routing(i: int):
        return device_row_blocks(triton_moe_route(logits[i], k, renormalize, after)[0], E, block_m)

    row: dict = dict(calls=calls, distinct_experts=distinct, bytes_mb=moved / 1e6)
    for name, fn in (("routing_eager", eager_routing), ("routing_fused", fused_routing)):
        row[f"{name}_us"] = timed([lambda i=i, fn=fn: fn(i) for i in range(calls)], device, args.repeats) * 1e6
    default = expert_tiles(T, k, E, dtype, "fused")
    want = experts(default, 0)
    seconds = timed([lambda i=i: experts(None, i) for i in range(calls)], device, args.repeats)
    row["default"] = dict(tiles=vars(default), us=seconds * 1e6, of_copy=moved / seconds / bandwidth)
    print(f"{shape} T={T}: routing eager {row['routing_eager_us']:.1f} us, fused {row['routing_fused_us']:.1f} us; "
          f"experts {seconds * 1e6:.1f} us ({row['default']['of_copy']:.0%} of copy)", flush=True)  # fmt: skip
    sweep = []
    for bn, bk, warps, stages in itertools.product(args.block_n, args.block_k, args.warps, args.stages):
        t = ExpertTiles(block_m, bn, bk, warps, stages)
        try:
            diff = float((experts(t, 0).float() - want.float()).abs().max())
            s = timed([lambda i=i, t=t: experts(t, i) for i in range(calls)], device, args.repeats)
        except Exception as exc:  # a tile the compiler refuses (shared memory): noted, the sweep goes on
            sweep.append(dict(tiles=vars(t), error=f"{type(exc).__name__}: {exc}"[:200]))
            continue
        sweep.append(dict(tiles=vars(t), us=s * 1e6, of_copy=moved / s / bandwidth, max_diff=diff))
    row["sweep"] = sweep
    timed_ones = [r for r in sweep if "us" in r]
    if timed_ones:
        row["best"] = best = min(timed_ones, key=lambda r: r["us"])
        print(f"  best {best['tiles']}: {best['us']:.1f} us ({best['of_copy']:.0%} of copy)", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["qwen3-30b-a3b", "gpt-oss-20b"], choices=SHAPES)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32], help="tokens a call routes")
    ap.add_argument("--block-n", type=int, nargs="+", default=[16, 32, 64, 128])
    ap.add_argument("--block-k", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--warps", type=int, nargs="+", default=[4])
    ap.add_argument("--stages", type=int, nargs="+", default=[3, 5])
    ap.add_argument("--l2-bytes", type=int, default=256 << 20, help="expert weights read per timed graph, at least")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--output", default=None, help="write the results as JSON (after each shape)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    bandwidth = copy_bandwidth(device, 1 << 30 if device.type == "cuda" else 1 << 26)
    print(f"device: {device_name(device)}; copy {bandwidth / 1e9:.0f} GB/s", flush=True)
    report: dict = dict(device=device_name(device), torch=torch.__version__, copy_bandwidth_gb_s=bandwidth / 1e9,
                        shapes={}, errors=[])  # fmt: skip
    runs = [(shape, lambda shape=shape: measure_shape(shape, args, device, bandwidth)) for shape in args.shapes]
    record_each(report, "shapes", runs, args.output, device)
    if report["errors"]:
        print("errors: " + "; ".join(report["errors"]))
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
