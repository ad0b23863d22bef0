"""The mixture-of-experts operator on GPUs: ``augur::moe_experts`` as two Triton kernels, with no
host sync, so a mixture-of-experts model's forward can be captured in a CUDA graph.

The host-side version (engine/models/moe.py) reads each expert's row count to cut the sorted rows into
one matrix product per expert: a sync per layer, which a CUDA graph cannot hold, and E launches.
Here everything the kernels need is computed on the device, at shapes fixed by the batch's token
count alone:

- the routing (``augur::moe_route`` under the fused operators): a program a token takes the softmax
  over the router's logits, its k largest and their renormalization, in place of the eager softmax,
  top-k, sum and division;
- the slots (token, choice) sorted by expert (``order``), each expert's rows counted and its run of
  sorted rows cut into blocks of ``BLOCK_M`` rows; the number of blocks is at most
  ``ceil(T * k / BLOCK_M) + E`` (each expert wastes at most one partial block), so the grid is that
  bound and the programs past the real blocks return at once. Up to ``LAYOUT_MAX_SLOTS`` slots (a
  decode's or a verify's) this layout is one program of one kernel; torch's sort, counts, scans and
  searches were about fifteen launches a layer (with the eager routing about 1.3 ms of Qwen3-30B-A3B's
  8.7 ms batch-1 decode, beside 1.8 ms of the experts' products: the fifth GPU run's profile,
  docs/benchmarks-history.md);
- kernel 1, per (block, tile of the inner dimension): the block's tokens' rows of ``x`` gathered
  straight from ``x`` (no copy), times the expert's gate and up rows, the bias, the activation
  (SiLU, tanh-GELU or gpt-oss's clamped SwiGLU) fused; the result [T * k, I] in sorted order;
- kernel 2, per (block, tile of the hidden dimension): times the expert's down projection, the bias,
  each row written back at its (token, choice) slot;
- kernel 3, per (token, tile of the hidden dimension): the token's k outputs times their routing
  weights, summed in its choice order in float32 (at a decode's one token the eager form of this was
  3k + 2 small kernels a layer).

A row's sums run over the inner dimension in fixed tiles whatever the other rows are, and under the
batch-invariant mode the row block is one size for every batch, so a token's output keeps its bits in
any batch. The kernels read each active expert's weights once per block of its rows: a decode step
reads the bytes of the experts its tokens chose, which is the memory bound of a mixture's decode.

On CPU tensors the same kernels run in Triton's interpreter (``TRITON_INTERPRET=1``): the tests
check them there. Registered as the CUDA implementation when imported (the loader imports it for a
mixture-of-experts model on CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.attention.common import triton_interpreted
from engine.models.moe import CLAMPED_SWIGLU

ACTS = {"silu": 0, "swish": 0, "gelu_pytorch_tanh": 1, CLAMPED_SWIGLU: 2}


@triton.jit
def _gate_up_kernel(
    h_ptr, x_ptr, w_ptr, b_ptr, order_ptr, block_expert_ptr, block_start_ptr, seg_end_ptr,
    num_experts, top_k, H, INNER, stride_x, stride_we, stride_wn, stride_h, alpha, limit,
    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    e = tl.load(block_expert_ptr + tl.program_id(0))
    if e < num_experts:
        start = tl.load(block_start_ptr + tl.program_id(0))
        end = tl.load(seg_end_ptr + e)
        rows = start + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        tok = tl.load(order_ptr + rows, mask=row_ok, other=0) // top_k
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < INNER
        w_e = w_ptr + e.to(tl.int64) * stride_we
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, H, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < H
            a = tl.load(x_ptr + tok[:, None] * stride_x + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            wmask = k_ok[:, None] & n_ok[None, :]
            wg = tl.load(w_e + n[None, :] * stride_wn + kk[:, None], mask=wmask, other=0.0)  # [K, N]
            wu = tl.load(w_e + (n[None, :] + INNER) * stride_wn + kk[:, None], mask=wmask, other=0.0)
            if UPCAST:
                a, wg, wu = a.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
            acc_g += tl.dot(a, wg, input_precision="ieee")
            acc_u += tl.dot(a, wu, input_precision="ieee")
        if HAS_BIAS:
            b_e = b_ptr + e.to(tl.int64) * 2 * INNER
            acc_g += tl.load(b_e + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            acc_u += tl.load(b_e + INNER + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if ACT == 0:  # SiLU
            out = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        elif ACT == 1:  # GELU, tanh approximation: 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))
            inner = 0.7978845608028654 * (acc_g + 0.044715 * acc_g * acc_g * acc_g)
            out = 0.5 * acc_g * (2.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)) * acc_u
        else:  # gpt-oss: (up + 1) * gate * sigmoid(alpha * gate), gate <= limit, |up| <= limit
            g = tl.minimum(acc_g, limit)
            u = tl.minimum(tl.maximum(acc_u, -limit), limit)
            out = (u + 1.0) * (g / (1.0 + tl.exp(-alpha * g)))
        tl.store(
            h_ptr + rows[:, None] * stride_h + n[None, :],
            out.to(h_ptr.dtype.element_ty),
            mask=row_ok[:, None] & n_ok[None, :],
        )


@triton.jit
def _down_kernel(
    out_ptr, h_ptr, w_ptr, b_ptr, order_ptr, block_expert_ptr, block_start_ptr, seg_end_ptr,
    num_experts, H, INNER, stride_h, stride_we, stride_wn, stride_o,
    HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    e = tl.load(block_expert_ptr + tl.program_id(0))
    if e < num_experts:
        start = tl.load(block_start_ptr + tl.program_id(0))
        end = tl.load(seg_end_ptr + e)
        rows = start + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < H
        w_e = w_ptr + e.to(tl.int64) * stride_we
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, INNER, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < INNER
            a = tl.load(h_ptr + rows[:, None] * stride_h + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_e + n[None, :] * stride_wn + kk[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if UPCAST:
                a, w = a.to(tl.float32), w.to(tl.float32)
            acc += tl.dot(a, w, input_precision="ieee")
        if HAS_BIAS:
            acc += tl.load(b_ptr + e.to(tl.int64) * H + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        slots = tl.load(order_ptr + rows, mask=row_ok, other=0)  # each sorted row back to its (token, choice)
        tl.store(
            out_ptr + slots[:, None].to(tl.int64) * stride_o + n[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & n_ok[None, :],
        )


@triton.jit
def _combine_kernel(out_ptr, slot_ptr, w_ptr, H, K: tl.constexpr, BLOCK: tl.constexpr):
    """A token's k outputs times its routing weights, summed in its choice order in float32."""
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = n < H
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(K):
        y = tl.load(slot_ptr + (t * K + j) * H + n, mask=ok, other=0.0).to(tl.float32)
        acc += y * tl.load(w_ptr + t * K + j)
    tl.store(out_ptr + t * H + n, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _route_kernel(
    ids_ptr, w_ptr, logits_ptr, stride_l, E,
    K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, RENORM: tl.constexpr, AFTER: tl.constexpr,
):  # fmt: skip
    """One token's routing (``moe.moe_route``): its k experts, largest first (a tie: the lower index)."""
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_PAD)
    ok = e < E
    x = tl.load(logits_ptr + t * stride_l + e, mask=ok, other=float("-inf")).to(tl.float32)
    if AFTER:  # gpt-oss: the k largest logits, then their softmax
        score = x
    else:  # the softmax over every expert, then its k largest
        p = tl.exp(x - tl.max(x, axis=0))
        score = tl.where(ok, p / tl.sum(p, axis=0), -1.0)
    j = tl.arange(0, K_PAD)
    top = tl.zeros([K_PAD], tl.float32)
    for i in tl.static_range(K):
        best = tl.max(score, axis=0)
        pick = tl.min(tl.where(score == best, e, E_PAD), axis=0)
        tl.store(ids_ptr + t * K + i, pick.to(tl.int64))
        top = tl.where(j == i, best, top)
        score = tl.where(e == pick, float("-inf"), score)
    if AFTER:
        p = tl.where(j < K, tl.exp(top - tl.max(tl.where(j < K, top, float("-inf")), axis=0)), 0.0)
        top = p / tl.sum(p, axis=0)
    elif RENORM:
        top = top / tl.sum(top, axis=0)
    tl.store(w_ptr + t * K + j, top, mask=j < K)


@triton.jit
def _layout_kernel(
    order_ptr, block_expert_ptr, block_start_ptr, seg_end_ptr, ids_ptr, S, E, NB,
    BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """:func:`row_blocks` in one program, walking the slots in chunks: each expert's count, the scans,
    and the stable sort by expert (a slot's place: its expert's first row plus the slots of that expert
    before it), each a comparison of a chunk against the experts or against itself."""
    e = tl.arange(0, E_PAD)
    e_ok = e < E
    c = tl.arange(0, CHUNK)
    counts = tl.zeros([E_PAD], tl.int32)
    for s0 in range(0, S, CHUNK):
        idv = tl.load(ids_ptr + s0 + c, mask=s0 + c < S, other=-1)
        counts += tl.sum((idv[None, :] == e[:, None]).to(tl.int32), axis=1)
    seg_end = tl.cumsum(counts, axis=0)
    seg_start = seg_end - counts
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    blocks_end = tl.cumsum(blocks, axis=0)
    blocks_start = blocks_end - blocks
    tl.store(seg_end_ptr + e, seg_end, mask=e_ok)
    # A slot's place in the stable sort: its expert's first row, plus the earlier slots of that expert
    # (those of the chunks before, counted in ``seen``, and those before it in its own chunk).
    seen = tl.zeros([E_PAD], tl.int32)
    for s0 in range(0, S, CHUNK):
        s = s0 + c
        idv = tl.load(ids_ptr + s, mask=s < S, other=-1)
        hit = idv[:, None] == e[None, :]  # [CHUNK, E_PAD]
        place = tl.sum(tl.where(hit, (seg_start + seen)[None, :], 0), axis=1)
        earlier = (idv[None, :] == idv[:, None]) & (c[None, :] < c[:, None])  # [CHUNK, CHUNK]
        place += tl.sum(earlier.to(tl.int32), axis=1)
        tl.store(order_ptr + place, s.to(tl.int64), mask=s < S)
        seen += tl.sum(hit.to(tl.int32), axis=0)
    # Each row block's expert (the experts whose blocks end at or before it: E when past them all) and
    # first sorted row.
    for b0 in range(0, NB, CHUNK):
        b = b0 + c
        be = tl.sum(((blocks_end[None, :] <= b[:, None]) & e_ok[None, :]).to(tl.int32), axis=1)
        mine = e[None, :] == tl.minimum(be, E - 1)[:, None]
        first = tl.sum(tl.where(mine, seg_start[None, :], 0), axis=1)
        skip = tl.sum(tl.where(mine, blocks_start[None, :], 0), axis=1)
        tl.store(block_expert_ptr + b, be, mask=b < NB)
        tl.store(block_start_ptr + b, first + (b - skip) * BLOCK_M, mask=b < NB)


def triton_moe_route(logits: torch.Tensor, top_k: int, renormalize: bool, softmax_after_topk: bool):
    """``augur::moe_route`` (engine/models/moe.py) in one kernel: a program a token."""
    T, E = logits.shape
    ids = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    if T:
        logits = logits if logits.stride(-1) == 1 else logits.contiguous()
        _route_kernel[(T,)](
            ids, weights, logits, logits.stride(0), E, K=top_k, K_PAD=triton.next_power_of_2(top_k),
            E_PAD=triton.next_power_of_2(E), RENORM=renormalize, AFTER=softmax_after_topk,
            num_warps=1 if E <= 256 else 4,
        )  # fmt: skip
    return ids, weights


LAYOUT_MAX_SLOTS = 1024  # most slots (tokens x k) row_blocks lays out in one program (more: torch's sort and scans)


def device_row_blocks(ids: torch.Tensor, num_experts: int, block_m: int):
    """:func:`row_blocks` as one kernel launch (in place of about fifteen small ones), for up to
    ``LAYOUT_MAX_SLOTS`` slots: the same four tensors, the same values."""
    flat = ids.reshape(-1)
    S = flat.numel()
    nb = triton.cdiv(S, block_m) + num_experts
    order = torch.empty(S, dtype=torch.int64, device=ids.device)
    block_expert = torch.empty(nb, dtype=torch.int32, device=ids.device)
    block_start = torch.empty(nb, dtype=torch.int32, device=ids.device)
    seg_end = torch.empty(num_experts, dtype=torch.int32, device=ids.device)
    _layout_kernel[(1,)](
        order, block_expert, block_start, seg_end, flat.contiguous(), S, num_experts, nb,
        BLOCK_M=block_m, E_PAD=triton.next_power_of_2(num_experts), CHUNK=32, num_warps=4,
    )  # fmt: skip
    return order, block_expert, block_start, seg_end


def row_blocks(ids: torch.Tensor, num_experts: int, block_m: int):
    """The slots sorted by expert and cut into row blocks, on the device at fixed shapes: (order [S],
    block_expert [NB] int32 (``num_experts``: no block), block_start [NB] int32 (its first sorted
    row), seg_end [E] int32 (past each expert's last sorted row)), S = T * k, NB = ceil(S / block_m) + E."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    seg_end = torch.cumsum(counts, 0)
    blocks = (counts + block_m - 1) // block_m
    blocks_end = torch.cumsum(blocks, 0)
    nb = triton.cdiv(flat.numel(), block_m) + num_experts
    b = torch.arange(nb, device=ids.device)
    block_expert = torch.searchsorted(blocks_end, b, right=True)
    e = block_expert.clamp(max=num_experts - 1)
    block_start = (seg_end - counts)[e] + (b - (blocks_end - blocks)[e]) * block_m
    return order, block_expert.to(torch.int32), block_start.to(torch.int32), seg_end.to(torch.int32)


@dataclass(frozen=True)
class ExpertTiles:
    """How the experts' two kernels cut their work: rows a block (``block_m``, also the layout's), output
    columns a program (``block_n``), the inner step (``block_k``), and each launch's warps and software
    pipeline stages. ``loadtest.bench_gpu_moe`` times a sweep of them at the published shapes."""

    block_m: int
    block_n: int = 64
    block_k: int = 64
    warps: int = 4
    stages: int = 3


def expert_tiles(tokens: int, top_k: int, num_experts: int, dtype: torch.dtype, ops: str) -> ExpertTiles:
    """The tiles a call runs at: row blocks of 16 under the batch-invariant mode (one size whatever the
    batch) and in decodes, of 64 where the experts average that many rows (a prefill); the inner step
    one size for every batch (a row's sums run over it in order)."""
    block_m = 16 if ops == "invariant" or tokens * top_k < 64 * num_experts else 64
    return ExpertTiles(block_m, block_k=64 if dtype != torch.float32 else 32)


def triton_moe_experts(
    x, ids, weights, gate_up, down, gate_up_bias, down_bias, act: str, ops: str, alpha: float = 1.0, limit: float = 0.0,
    tiles: ExpertTiles | None = None,
) -> torch.Tensor:  # fmt: skip
    """``augur::moe_experts`` (engine/models/moe.py) on the kernels above; ``tiles``: other than
    :func:`expert_tiles`' (the benchmark's sweep)."""
    if act not in ACTS:
        raise ValueError(f"the GPU mixture-of-experts kernel has no activation {act!r} (it has {sorted(ACTS)})")
    T, k = ids.shape
    E, two_i, H = gate_up.shape
    I = two_i // 2  # noqa: E741
    t = tiles or expert_tiles(T, k, E, x.dtype, ops)
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    lay_out = device_row_blocks if T * k <= LAYOUT_MAX_SLOTS else row_blocks
    order, block_expert, block_start, seg_end = lay_out(ids, E, t.block_m)
    nb = block_expert.shape[0]
    upcast = triton_interpreted() and x.dtype != torch.float32
    h = torch.empty(T * k, I, dtype=x.dtype, device=x.device)
    dummy = x  # (a bias pointer the kernel never reads)
    launch = dict(BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, num_warps=t.warps, num_stages=t.stages)
    _gate_up_kernel[(nb, triton.cdiv(I, t.block_n))](
        h, x, gate_up, gate_up_bias if gate_up_bias is not None else dummy, order, block_expert, block_start,
        seg_end, E, k, H, I, x.stride(0), gate_up.stride(0), gate_up.stride(1), h.stride(0), alpha, limit,
        ACT=ACTS[act], HAS_BIAS=gate_up_bias is not None, UPCAST=upcast, **launch,
    )  # fmt: skip
    by_slot = torch.empty(T * k, H, dtype=x.dtype, device=x.device)  # written in (token, choice) order
    _down_kernel[(nb, triton.cdiv(H, t.block_n))](
        by_slot, h, down, down_bias if down_bias is not None else dummy, order, block_expert, block_start,
        seg_end, E, H, I, h.stride(0), down.stride(0), down.stride(1), by_slot.stride(0),
        HAS_BIAS=down_bias is not None, UPCAST=upcast, **launch,
    )  # fmt: skip
    out = torch.empty(T, H, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    block = min(1024, triton.next_power_of_2(H))
    _combine_kernel[(T, triton.cdiv(H, block))](out, by_slot, weights.float().contiguous(), H, K=k, BLOCK=block)
    return out


_lib = torch.library.Library("augur", "IMPL")
_lib.impl("moe_experts", triton_moe_experts, "CUDA")
_lib.impl("moe_route", triton_moe_route, "CUDA")
