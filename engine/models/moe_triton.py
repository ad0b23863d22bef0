"""The mixture-of-experts operator on GPUs: ``augur::moe_experts`` as two Triton kernels, with no
host sync, so a mixture-of-experts model's forward can be captured in a CUDA graph.

The host-side version (engine/models/moe.py) reads each expert's row count to cut the sorted rows into
one matrix product per expert: a sync per layer, which a CUDA graph cannot hold, and E launches.
Here everything the kernels need is computed on the device, at shapes fixed by the batch's token
count alone:

- the slots (token, choice) sorted by expert (``order``), each expert's rows counted and its run of
  sorted rows cut into blocks of ``BLOCK_M`` rows; the number of blocks is at most
  ``ceil(T * k / BLOCK_M) + E`` (each expert wastes at most one partial block), so the grid is that
  bound and the programs past the real blocks return at once;
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


def triton_moe_experts(
    x, ids, weights, gate_up, down, gate_up_bias, down_bias, act: str, ops: str, alpha: float = 1.0, limit: float = 0.0
) -> torch.Tensor:
    """``augur::moe_experts`` (engine/models/moe.py) on the kernels above."""
    if act not in ACTS:
        raise ValueError(f"the GPU mixture-of-experts kernel has no activation {act!r} (it has {sorted(ACTS)})")
    T, k = ids.shape
    E, two_i, H = gate_up.shape
    I = two_i // 2  # noqa: E741
    # Row blocks of 16 under the batch-invariant mode (one size whatever the batch) and in decodes;
    # of 64 where the experts average that many rows (a prefill).
    block_m = 16 if ops == "invariant" or T * k < 64 * E else 64
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    order, block_expert, block_start, seg_end = row_blocks(ids, E, block_m)
    nb = block_expert.shape[0]
    upcast = triton_interpreted() and x.dtype != torch.float32
    block_k = 64 if x.dtype != torch.float32 else 32
    h = torch.empty(T * k, I, dtype=x.dtype, device=x.device)
    dummy = x  # (a bias pointer the kernel never reads)
    _gate_up_kernel[(nb, triton.cdiv(I, 64))](
        h, x, gate_up, gate_up_bias if gate_up_bias is not None else dummy, order, block_expert, block_start,
        seg_end, E, k, H, I, x.stride(0), gate_up.stride(0), gate_up.stride(1), h.stride(0), alpha, limit,
        ACT=ACTS[act], HAS_BIAS=gate_up_bias is not None, UPCAST=upcast,
        BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=block_k,
    )  # fmt: skip
    by_slot = torch.empty(T * k, H, dtype=x.dtype, device=x.device)  # written in (token, choice) order
    _down_kernel[(nb, triton.cdiv(H, 64))](
        by_slot, h, down, down_bias if down_bias is not None else dummy, order, block_expert, block_start,
        seg_end, E, H, I, h.stride(0), down.stride(0), down.stride(1), by_slot.stride(0),
        HAS_BIAS=down_bias is not None, UPCAST=upcast, BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=block_k,
    )  # fmt: skip
    out = torch.empty(T, H, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    block = min(1024, triton.next_power_of_2(H))
    _combine_kernel[(T, triton.cdiv(H, block))](out, by_slot, weights.float().contiguous(), H, K=k, BLOCK=block)
    return out


_lib = torch.library.Library("augur", "IMPL")
_lib.impl("moe_experts", triton_moe_experts, "CUDA")
