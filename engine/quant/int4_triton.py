"""4-bit weights times bfloat16 activations on a GPU (W4A16), in one Triton kernel of ours.

PyTorch's own int4 kernel (``aten._weight_int4pack_mm``, tinygemm) is built for a decode's few rows: on an
H200 at the Llama-3.1-8B shape a 2,048-token prefill took 991 ms on it against 63 ms in bfloat16, and 8
rows cost twice one. This kernel takes every row count: a program computes a ``BLOCK_M x BLOCK_N`` tile
of the output, walking the inputs in ``BLOCK_K`` steps; each step loads the tile's weights as 4-bit
pairs, dequantizes them in registers (``(q - 8) * scale + zero``, the group's statistics, rounded to
bfloat16) and multiplies on the matrix units, accumulating in float32. A few rows (a decode, a verify)
leave most of the GPU idle in one pass over the inputs, so there the inputs are cut into ``S`` fixed
ranges (from the layer's shape and the GPU's size, never from the rows) and a second kernel adds the
ranges' float32 partial sums in order.

The weights are stored as ``pairs [N, K / 2]`` bytes, column ``2j`` in the high nibble of byte ``j``
and ``2j + 1`` in the low one, beside the layer's ``scales_and_zeros [K / G, N, 2]``. It runs compiled
on CUDA and in Triton's interpreter on CPU tensors (the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.platform import triton_interpreted

BLOCK_K = 64  # inputs a step (32 pairs: the matrix units' smallest inner size is 16)
MIN_K_PER_SPLIT = 512
FEW_ROWS = 16  # up to this many rows: tiles of 16 rows, the inputs split in ranges


@triton.jit
def _int4_kernel(
    out_ptr, part_ptr, x_ptr, q_ptr, sz_ptr, M, N, K, G, stride_xm, stride_q, stride_g, k_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    j = tl.arange(0, BLOCK_K // 2)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        even = k0 + 2 * j  # the inputs of the step's even columns; pair j holds columns even[j], even[j] + 1
        k_ok = even < k_hi
        w_ok = k_ok[:, None] & n_ok[None, :]
        pairs = tl.load(q_ptr + rn[None, :].to(tl.int64) * stride_q + (even // 2)[:, None], mask=w_ok, other=0)
        stats = sz_ptr + (even // G)[:, None].to(tl.int64) * stride_g + rn[None, :] * 2
        scale = tl.load(stats, mask=w_ok, other=0.0).to(tl.float32)
        zero = tl.load(stats + 1, mask=w_ok, other=0.0).to(tl.float32)
        w_even = ((pairs >> 4).to(tl.float32) - 8.0) * scale + zero  # [BLOCK_K / 2, BLOCK_N]
        w_odd = ((pairs & 0xF).to(tl.float32) - 8.0) * scale + zero
        x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm
        x_ok = m_ok[:, None] & k_ok[None, :]
        x_even = tl.load(x_rows + even[None, :], mask=x_ok, other=0.0)
        x_odd = tl.load(x_rows + even[None, :] + 1, mask=x_ok, other=0.0)
        if UPCAST:  # (Triton's interpreter multiplies 16-bit floats only through float32)
            w_even = w_even.to(x_ptr.dtype.element_ty).to(tl.float32)
            w_odd = w_odd.to(x_ptr.dtype.element_ty).to(tl.float32)
            acc = tl.dot(x_even.to(tl.float32), w_even, acc)
            acc = tl.dot(x_odd.to(tl.float32), w_odd, acc)
        else:
            acc = tl.dot(x_even, w_even.to(x_ptr.dtype.element_ty), acc)
            acc = tl.dot(x_odd, w_odd.to(x_ptr.dtype.element_ty), acc)
    ok = m_ok[:, None] & n_ok[None, :]
    if SPLIT:
        tl.store(part_ptr + (split * M + rm[:, None]).to(tl.int64) * N + rn[None, :], acc, mask=ok)
    else:
        tl.store(out_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _sum_splits_kernel(out_ptr, part_ptr, MN, S, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < MN
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(0, S):  # in order
        acc += tl.load(part_ptr + s * MN + i, mask=ok, other=0.0)
    tl.store(out_ptr + i, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def pack_pairs(q: torch.Tensor) -> torch.Tensor:
    """``q [N, K]`` (0..15) → ``[N, K / 2]`` bytes, the even column in the high nibble."""
    return ((q[:, ::2].to(torch.uint8) << 4) | q[:, 1::2].to(torch.uint8)).contiguous()


def int4_matmul(x: torch.Tensor, pairs: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """``x [M, K]`` (bfloat16) times the 4-bit weight ``[N, K]`` transposed → ``[M, N]`` in x's dtype."""
    M, K = x.shape
    N = pairs.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    few = M <= FEW_ROWS
    block_m, block_n = (16, 64) if few else (64, 64)
    S = 1
    if few:  # enough programs to fill the GPU about twice, each range at least MIN_K_PER_SPLIT long
        S = max(1, min(triton.cdiv(2 * _sm_count(x.device), triton.cdiv(N, block_n)), K // MIN_K_PER_SPLIT))
    per = triton.cdiv(triton.cdiv(K, S), BLOCK_K) * BLOCK_K
    S = triton.cdiv(K, per)
    part = torch.empty(S, M, N, dtype=torch.float32, device=x.device) if S > 1 else out
    _int4_kernel[(triton.cdiv(M, block_m), triton.cdiv(N, block_n), S)](
        out, part, x, pairs, scales_and_zeros, M, N, K, group_size, x.stride(0), pairs.stride(0),
        scales_and_zeros.stride(0), per, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K, SPLIT=S > 1,
        UPCAST=triton_interpreted(),
    )  # fmt: skip
    if S > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(M * N, block),)](out, part, M * N, S, BLOCK=block)
    return out
