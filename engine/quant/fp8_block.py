"""Block-scaled FP8 weights (128 x 128, DeepSeek-V3's and Qwen3's ``-FP8``) served from their bytes.

A weight ``[N, K]`` is e4m3 values with one float32 multiplier per block of ``bn x bk`` (``scale
[ceil(N / bn), ceil(K / bk)]``): its scales vary along a row, so a per-row FP8 product
(engine/quant/fp8.py) cannot hold it. :class:`Fp8BlockLinear` multiplies it weight-only (W8A16): one
Triton kernel loads each weight tile as 8-bit floats, converts it in registers (exactly: every e4m3
value is a bfloat16), multiplies it by the activations' tile and adds the product times the tile's
block scale into a float32 accumulator. The activations keep their dtype, so the result is the
checkpoint's dequantized product (the weights never rounded to the model's dtype), from half of
bfloat16's bytes. A ``K`` tile never straddles two scale blocks (the tile divides ``bk``), so a tile
has one scale per row.

Where it runs: CUDA (the kernel compiled), and CPU tensors under ``TRITON_INTERPRET=1`` (the tests).
Elsewhere, and under the batch-invariant mode, the same product is computed from the weight
dequantized per call (on ``augur::invariant_linear`` in that mode: one order per output, whatever
the rows beside it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

from engine.platform import triton_interpreted


@triton.jit
def _block_fp8_kernel(
    y_ptr, x_ptr, w_ptr, s_ptr, M, N, K, stride_xm, stride_wn, stride_ym, stride_sn,
    SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = m < M, n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        x = tl.load(
            x_ptr + m[:, None].to(tl.int64) * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0
        )
        w = tl.load(
            w_ptr + n[:, None].to(tl.int64) * stride_wn + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0
        )
        w = w.to(x.dtype)
        if UPCAST:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        s = tl.load(s_ptr + (n // SCALE_N) * stride_sn + k0 // SCALE_K, mask=n_ok, other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION) * s[None, :]
    tl.store(y_ptr + m[:, None].to(tl.int64) * stride_ym + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])  # fmt: skip


def block_fp8_matmul(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """``x [M, K] @ (weight * scale spread over its blocks)^T`` → ``[M, N]`` in ``x``'s dtype, on the kernel."""
    M, K = x.shape
    N = weight.shape[0]
    bn, bk = block
    block_k = next(b for b in (128, 64, 32, 16) if bk % b == 0)
    block_m = 16 if M <= 16 else 64
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    x = x.contiguous()
    upcast = triton_interpreted() and x.dtype != torch.float32
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, 64))
    _block_fp8_kernel[grid](
        y, x, weight, scale, M, N, K, x.stride(0), weight.stride(0), y.stride(0), scale.stride(0),
        SCALE_N=bn, SCALE_K=bk, BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=block_k,
        PRECISION="ieee" if x.dtype == torch.float32 or upcast else "tf32", UPCAST=upcast,
    )  # fmt: skip
    return y


def dequantize_blocks(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The weight in float32: each value times its block's scale."""
    N, K = weight.shape
    spread = scale.float().repeat_interleave(block[0], 0)[:N].repeat_interleave(block[1], 1)[:, :K]
    return weight.float() * spread


def kernel_serves(device: torch.device) -> bool:
    return device.type == "cuda" or (device.type == "cpu" and triton_interpreted())


class Fp8BlockLinear(nn.Module):
    """A linear layer of block-scaled e4m3 weights, multiplied weight-only on :func:`block_fp8_matmul`."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], bias) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.block = tuple(block)
        self.register_buffer("weight", weight.contiguous())  # [N, K] e4m3
        self.register_buffer("weight_scale", scale.float().contiguous())  # [ceil(N / bn), ceil(K / bk)]
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.invariant = False  # on augur::invariant_linear (the batch-invariant mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.invariant:
            w = dequantize_blocks(self.weight, self.weight_scale, self.block)
            y = torch.ops.augur.invariant_linear(flat.float(), w, None).to(x.dtype)
        elif kernel_serves(x.device):
            y = block_fp8_matmul(flat, self.weight, self.weight_scale, self.block)
        else:
            y = F.linear(flat.float(), dequantize_blocks(self.weight, self.weight_scale, self.block)).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 weights, {self.block} blocks"
