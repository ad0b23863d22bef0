"""The batch-invariant operators' CUDA kernels (Triton): ``augur::invariant_linear``, ``invariant_rms_norm``
and ``invariant_act_mul`` for CUDA tensors, registered when the batch-invariant mode loads a model on a
GPU (engine/runner/loader.py).

The promise (docs/speculative.md, "The promise") is that a row's result never depends on the rows
beside it. cuBLAS breaks it in a linear layer: it picks a kernel, its tiles and its split of the inner
dimension by the shape of the call, so a decode's one row, a verify's five and a prefill chunk's
hundreds reduce the same dot product in different orders. Here every call of a layer takes one kernel
with one configuration, whatever its rows:

- a program computes a ``BLOCK_M x BLOCK_N`` tile of the output, walking the inner dimension in
  ``BLOCK_K`` steps in order, accumulating in float32 with ``tl.dot``. A row's products meet only its
  own row's (the matrix units never mix rows), and rows past the batch are loaded as zeros, so a row
  computes the same sums in a tile of one real row as in a tile of sixty-four;
- a layer whose output tiles would leave the GPU idle at one row splits the inner dimension into
  ``S`` fixed ranges, chosen from the layer's shape and the GPU's size only (never from the rows), and
  a second kernel adds the ranges' float32 partial sums in order (:func:`k_splits`).

RMSNorm and the MLP's activation take the fused kernels (engine/models/fused.py), one program a row or
an element at a time; attention takes the triton backend's kernel with one program size and no key
split (``build_triton_metadata(invariant=True)``). The rest of a forward is element by element.
The tiles are fixed per dtype, so a row's bits are fixed per (GPU, dtype): a CPU's invariant kernels
(engine/models/invariant.py) give other bits, as any two devices do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.attention.common import triton_interpreted
from engine.models.fused import FUSED_ACTIVATIONS, fused_act_mul, fused_rms_norm
from engine.models.invariant import ACTIVATIONS
from engine.platform import sm_count

_lib = torch.library.Library("augur", "IMPL")

BLOCK_M, BLOCK_N = 64, 64
MIN_K_PER_SPLIT = 512  # the shortest inner range a split takes


def _block_k(dtype: torch.dtype) -> int:
    return 32 if dtype == torch.float32 else 64


@triton.jit
def _matmul_kernel(
    out_ptr, part_ptr, x_ptr, w_ptr, b_ptr, M, N, K, stride_xm, stride_wn, k_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):  # in order: the same sums for a row whatever the rows beside it
        rk = k + tl.arange(0, BLOCK_K)
        k_ok = rk < k_hi
        a = tl.load(x_ptr + rm.to(tl.int64)[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)  # fmt: skip
        b = tl.load(w_ptr + rn.to(tl.int64)[None, :] * stride_wn + rk[:, None], mask=n_ok[None, :] & k_ok[:, None],
                    other=0.0)  # fmt: skip
        if UPCAST:  # Triton's interpreter multiplies 16-bit floats wrongly
            a, b = a.to(tl.float32), b.to(tl.float32)
        if IEEE or UPCAST:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    offs = rm.to(tl.int64)[:, None] * N + rn[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    if SPLIT:  # this range's partial sums; _reduce_kernel adds the ranges in order
        tl.store(part_ptr + split.to(tl.int64) * M * N + offs, acc, mask=ok)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _reduce_kernel(out_ptr, part_ptr, b_ptr, MN, N, S, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(0, S):
        acc += tl.load(part_ptr + s * MN + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _sm_count(device: torch.device) -> int:
    return sm_count(device) if device.type == "cuda" else 4  # Triton's interpreter (the tests): any fixed figure


def k_splits(n: int, k: int, device: torch.device) -> int:
    """Inner-dimension ranges of a layer with ``n`` outputs over ``k`` inputs: enough programs at one row
    to fill the GPU about twice, each range at least :data:`MIN_K_PER_SPLIT` long. A function of the
    layer and the device only: every call of the layer splits alike."""
    tiles = triton.cdiv(n, BLOCK_N)
    want = triton.cdiv(2 * _sm_count(device), tiles)
    return max(1, min(want, k // MIN_K_PER_SPLIT))


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     splits: int | None = None) -> torch.Tensor:  # fmt: skip
    """x [M, K] @ weight[N, K].T (+ bias) → [M, N] in x's dtype, every row reduced alike whatever M.
    ``splits``: force the inner ranges (the tests); default :func:`k_splits`."""
    M, K = x.shape
    N = weight.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    bk = _block_k(x.dtype)
    S = splits or k_splits(N, K, x.device)
    per = triton.cdiv(triton.cdiv(K, S), bk) * bk
    S = triton.cdiv(K, per)
    part = torch.empty(S, M, N, dtype=torch.float32, device=x.device) if S > 1 else out
    b = bias if bias is not None else out
    _matmul_kernel[(triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N), S)](
        out, part, x, weight, b, M, N, K, x.stride(0), weight.stride(0), per,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=bk, SPLIT=S > 1, HAS_BIAS=bias is not None,
        IEEE=x.dtype == torch.float32, UPCAST=triton_interpreted() and x.dtype != torch.float32, num_warps=4,
    )  # fmt: skip
    if S > 1:
        block = 1024
        _reduce_kernel[(triton.cdiv(M * N, block),)](out, part, b, M * N, N, S, BLOCK=block, HAS_BIAS=bias is not None)
    return out


def invariant_act_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    if act in FUSED_ACTIVATIONS:
        return fused_act_mul(gate_up, act)
    gate, up = gate_up.chunk(2, dim=-1)  # element by element: invariant as it is
    return ACTIVATIONS[act](gate) * up


_lib.impl("invariant_linear", lambda x, weight, bias=None: invariant_linear(x, weight, bias), "CUDA")
_lib.impl("invariant_rms_norm", fused_rms_norm, "CUDA")
_lib.impl("invariant_act_mul", invariant_act_mul, "CUDA")
