"""The adapters' two products on a GPU: each row gathers its own adapter (Triton, no host sync).

:class:`engine.lora.layers.LoraLinear` multiplies every row by every slot's ``A`` and masks the other
slots' columns: simple, batch-invariant on the invariant matmul, and cheap for a handful of slots on a
CPU. On CUDA these two kernels do only each row's own share, reading its slot from a device tensor:

- *shrink*: ``h[t] = A_s x[t]`` over the ``P = parts * max_rank`` rows of slot ``s = slot[t]`` of ``a``
  (``[slots * P, in]``), in float32, as partial sums over fixed ranges of ``K_SPLIT`` inputs (one
  program each: a decode's one row spreads its slot's ``A`` over many programs, where one program
  reading all of it took most of a decode step on an H200);
- *expand*: ``delta[t] = B_s h[t]`` over the ``P`` columns of slot ``s`` of ``b`` (``[out, slots * P]``),
  ``h[t]`` the ranges' partial sums added in order.

A row whose slot is -1 (the base model) gets exact zeros and reads no weights. One program handles one
row and a block of outputs, summing over the inputs in a fixed order (the ranges fixed by the layer's
width alone), so a row's result does not depend on the rows beside it or on which adapters they use
(batch-invariant by construction), and the shapes depend on nothing but the row count: a CUDA graph
can capture them (the slots and weights are written in place). They run compiled on CUDA and in
Triton's interpreter on CPU tensors (the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

K_SPLIT = 256  # the inputs one shrink program sums (a multiple of its BLOCK_K)


@triton.jit
def _shrink_kernel(
    h_ptr, x_ptr, a_ptr, slot_ptr, K, P, T, stride_x, stride_a, stride_h,
    BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr, K_SPLIT: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    split = tl.program_id(2)
    p_ok = p < P
    slot = tl.load(slot_ptr + t)
    acc = tl.zeros([BLOCK_P], tl.float32)
    if slot >= 0:
        rows = slot.to(tl.int64) * P + p
        for k0 in range(split * K_SPLIT, split * K_SPLIT + K_SPLIT, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            x = tl.load(x_ptr + t.to(tl.int64) * stride_x + k, mask=k_ok, other=0.0).to(tl.float32)
            a = tl.load(a_ptr + rows[:, None] * stride_a + k[None, :], mask=p_ok[:, None] & k_ok[None, :], other=0.0)
            acc += tl.sum(a.to(tl.float32) * x[None, :], axis=1)
    tl.store(h_ptr + (split.to(tl.int64) * T + t) * stride_h + p, acc, mask=p_ok)


@triton.jit
def _expand_kernel(
    d_ptr, h_ptr, b_ptr, slot_ptr, N, P, T, S, stride_h, stride_b, stride_d,
    BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    slot = tl.load(slot_ptr + t)
    acc = tl.zeros([BLOCK_N], tl.float32)
    if slot >= 0:
        for p0 in range(0, P, BLOCK_P):
            p = p0 + tl.arange(0, BLOCK_P)
            p_ok = p < P
            h = tl.zeros([BLOCK_P], tl.float32)
            for s in range(0, S):  # the shrink's partial sums, in order
                h += tl.load(h_ptr + (s * T + t).to(tl.int64) * stride_h + p, mask=p_ok, other=0.0)
            cols = slot.to(tl.int64) * P + p
            b = tl.load(b_ptr + n[:, None].to(tl.int64) * stride_b + cols[None, :], mask=n_ok[:, None] & p_ok[None, :],
                        other=0.0)  # fmt: skip
            acc += tl.sum(b.to(tl.float32) * h[None, :], axis=1)
    tl.store(d_ptr + t.to(tl.int64) * stride_d + n, acc, mask=n_ok)


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, width: int) -> torch.Tensor:
    """``x [T, in]``'s adapter delta ``[T, out]`` in float32: row ``t`` through slot ``slots[t]``'s ``A`` and
    ``B`` (``width`` = P columns a slot), zeros where the slot is -1."""
    T, K = x.shape
    N = b.shape[0]
    x = x.contiguous()
    S = triton.cdiv(K, K_SPLIT)
    h = torch.empty(S, T, width, dtype=torch.float32, device=x.device)
    delta = torch.empty(T, N, dtype=torch.float32, device=x.device)
    if T == 0:
        return delta
    block_p = min(64, triton.next_power_of_2(width))
    _shrink_kernel[(T, triton.cdiv(width, block_p), S)](
        h, x, a, slots, K, width, T, x.stride(0), a.stride(0), h.stride(1), BLOCK_P=block_p, BLOCK_K=128,
        K_SPLIT=K_SPLIT,
    )  # fmt: skip
    _expand_kernel[(T, triton.cdiv(N, 128))](
        delta, h, b, slots, N, width, T, S, h.stride(1), b.stride(0), delta.stride(0), BLOCK_N=128, BLOCK_P=block_p
    )
    return delta
