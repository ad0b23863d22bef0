"""Linear layers for a GPU step's few rows: ``augur::skinny_linear``, a Triton kernel for 1 to 64 rows.

At batch 1 an 8B model's decode is the time to read its weights once, and on an H200 the matrix
products are most of it: cuBLAS's kernels at one row took 4.16 ms of a 5.07 ms step, 81% of the copy
bandwidth over the bytes they read (docs/benchmarks-history.md, the fourth GPU run's profile). A
verify's 5 to 64 rows should cost the same bytes, but cuBLAS picks other kernels per row count, and a
60-node tree verify took 1.31x a decode. This kernel streams the weight once for up to 64 rows:

- a program per ``BLOCK_N`` output columns, walking the whole inner dimension in ``BLOCK_K`` steps
  (``num_stages`` of them in flight), the rows padded to ``BLOCK_M`` (16, 32 or 64: the bucket the row
  count falls in) and multiplied on the tensor cores (``tl.dot``); a single row, with
  :attr:`Tiles.dot` off, as products summed over ``BLOCK_K`` on the CUDA cores instead;
- the sums in float32, the bias added in float32, one rounding to the output dtype.

A row's sums never depend on the other rows: the tile shapes are fixed by the layer's shape and the
row bucket, never by how many of the bucket's rows are real, so (tensor cores on for one row too) a
decode row and the same row in a verify of up to 16 rows get the same bits, which cuBLAS does not
promise (the tests check it).

``--quantization fp8``'s layers get the same kernel (:class:`SkinnyFp8Linear`): their e4m3 weights and
per-token e4m3 rows multiplied on the tensor cores, summed exactly in float32 (no fast accumulation),
then scaled per row and column, as ``torch._scaled_mm`` computes them. On the H200 ``_scaled_mm`` read
at 34% of the bound at one row (an FP8 decode took 5.81 ms, a bfloat16 one 5.10): here a call reads
half of bfloat16's bytes, and what it gains is a GPU measurement too.

``--quantization int4``'s layers on CUDA (:class:`SkinnyInt4Linear`) hold their 4-bit integers by rows
instead of in PyTorch's int4 kernel's tiles (re-laid at the switch, from the tile order read at load;
the same bytes), and a call of up to 64 rows dequantizes each group of the weight in registers,
``(q - 8) * scale + zero`` rounded once to bfloat16 as the layer's dense path does, and multiplies it on
the tensor cores (``augur::skinny_int4_linear``): PyTorch's kernel read at a third of the bound at one
row on the H200.

The tile shapes per layer shape are :func:`tiles`; ``python -m loadtest.bench_gpu_skinny`` times the
kernel against cuBLAS (``--dtype fp8``: against ``_scaled_mm``) at the 8B model's layer shapes over a
sweep of them. The kernel is opt-in until a GPU run has measured it: :func:`use_skinny_linear`
switches a model's layers (``loadtest.bench_gpu_scale --skinny on off`` compares whole steps). On CPU
tensors the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``): the tests check it there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

from engine.platform import sm_count, triton_interpreted
from engine.quant.fp8 import Fp8Linear
from engine.quant.int4 import TILE_ROWS, Int4Linear, _pairs

MAX_ROWS = 64  # more rows go to F.linear (a prefill's products are compute-bound: cuBLAS's GEMMs)
ROW_BUCKETS = (16, 32, 64)  # BLOCK_M: a call's rows padded up to the first that holds them

_lib = torch.library.Library("augur", "FRAGMENT")
_lib.define("skinny_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor")
_lib.define("skinny_int4_linear(Tensor x, Tensor nibbles, Tensor scales_and_zeros, int group_size) -> Tensor")
_lib.define(
    "skinny_scaled_linear(Tensor x, Tensor x_scale, Tensor weight, Tensor weight_scale, ScalarType out_dtype) -> Tensor"
)


@dataclass(frozen=True)
class Tiles:
    """One launch's tile shapes and schedule (``tiles`` picks them per layer shape)."""

    block_n: int = 32
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4
    dot: bool = True  # one row too on the tensor cores (padded to 16), or its products summed on the CUDA cores


def tiles(out_features: int, in_features: int, sms: int = 132) -> Tiles:
    """The tiles for a weight of ``out_features`` x ``in_features`` on a GPU of ``sms`` multiprocessors:
    the widest column block (16 to 64) that still gives every multiprocessor two programs, so that no
    multiprocessor waits on a last, lone wave; 256 columns of the inner dimension a step (a 64 KiB
    weight tile at 64 x 256 bfloat16), four in flight."""
    block_n = 64
    while block_n > 16 and triton.cdiv(out_features, block_n) < 2 * sms:
        block_n //= 2
    return Tiles(block_n=block_n, block_k=min(256, triton.next_power_of_2(in_features)))


@triton.jit
def _skinny_kernel(
    out_ptr, x_ptr, w_ptr, b_ptr, sx_ptr, sw_ptr, M, N, K, x_stride, w_stride, out_stride,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    SCALED: tl.constexpr, DOT: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    col_ok = cols < N
    row_ok = rows < M
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * w_stride + ks[None, :]  # [BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * x_stride + ks[None, :]  # [BLOCK_M, BLOCK_K]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs, mask=col_ok[:, None], other=0.0)
            x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
        else:
            k_ok = k0 + ks < K
            w = tl.load(w_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if DOT and not UPCAST:  # (e4m3 products summed exactly in float32 too: no fast accumulation)
            acc += tl.dot(x, tl.trans(w), input_precision="ieee", max_num_imprecise_acc=0)
        elif DOT:  # Triton's interpreter: its dot of 16-bit floats is wrong, and numpy's of float32 sums a
            # row in an order that depends on its place in the block; float32 holds the products exactly
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        else:  # one row (BLOCK_M 1): its products over this step's columns, summed in float32
            acc += tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=1)[None, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if SCALED:  # e4m3 rows and weights: a scale per row of x and one per output column
        sx = tl.load(sx_ptr + rows, mask=row_ok, other=0.0)
        sw = tl.load(sw_ptr + cols, mask=col_ok, other=0.0)
        acc = acc * sx[:, None] * sw[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows[:, None].to(tl.int64) * out_stride + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _int4_kernel(
    out_ptr, x_ptr, w_ptr, sz_ptr, M, N, K, x_stride, w_stride, out_stride,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """One group of inputs a step: a row's bytes hold inputs 2j (low nibble) and 2j + 1 (high), each
    ``(q - 8) * scale + zero`` in float32, rounded once to bfloat16, as ``Int4Linear.dequantized``."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    half = tl.arange(0, GROUP // 2)
    col_ok = cols < N
    row_ok = rows < M
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * w_stride + half[None, :]  # [BLOCK_N, GROUP / 2] bytes
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * x_stride + 2 * half[None, :]  # the even inputs
    sz_ptrs = sz_ptr + cols.to(tl.int64) * 2  # [K / GROUP, N, 2]: scale, zero
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, K, GROUP):
        byte = tl.load(w_ptrs, mask=col_ok[:, None], other=0).to(tl.int32)
        scale = tl.load(sz_ptrs, mask=col_ok, other=0.0).to(tl.float32)[:, None]
        zero = tl.load(sz_ptrs + 1, mask=col_ok, other=0.0).to(tl.float32)[:, None]
        w_lo = ((byte & 15).to(tl.float32) - 8.0) * scale + zero
        w_hi = ((byte >> 4).to(tl.float32) - 8.0) * scale + zero
        x_lo = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
        x_hi = tl.load(x_ptrs + 1, mask=row_ok[:, None], other=0.0)
        if UPCAST:  # Triton's interpreter (see _skinny_kernel), the weights left in float32
            acc += tl.sum(x_lo.to(tl.float32)[:, None, :] * w_lo[None, :, :], axis=2)
            acc += tl.sum(x_hi.to(tl.float32)[:, None, :] * w_hi[None, :, :], axis=2)
        else:
            acc += tl.dot(x_lo, tl.trans(w_lo.to(x_lo.dtype)), input_precision="ieee")
            acc += tl.dot(x_hi, tl.trans(w_hi.to(x_hi.dtype)), input_precision="ieee")
        w_ptrs += GROUP // 2
        x_ptrs += GROUP
        sz_ptrs += 2 * N
    out = out_ptr + rows[:, None].to(tl.int64) * out_stride + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def row_bucket(rows: int) -> int:
    return next(b for b in ROW_BUCKETS if b >= rows)


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    tile: Tiles | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` of [rows, in_features], rows at most :data:`MAX_ROWS`, on
    the kernel (``tile``: its tiles, else :func:`tiles`' for the weight's shape). With ``scales``, ``x``
    and ``weight`` are e4m3 and ``scales`` is (float32 [rows] per row of x, float32 [out_features] per
    row of the weight): the product is ``(x * sx) @ (weight * sw)^T``, as ``torch._scaled_mm`` computes
    it, in ``out_dtype``."""
    M, K = x.shape
    N = weight.shape[0]
    if M > MAX_ROWS:
        raise ValueError(f"skinny_linear takes at most {MAX_ROWS} rows, got {M}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if weight.stride(-1) != 1:
        raise ValueError("skinny_linear needs a weight with unit stride along its inner dimension")
    out = torch.empty(M, N, dtype=out_dtype or x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    t = tile or tiles(N, K, multiprocessors(x.device))
    dot = t.dot or M > 1
    block_m = row_bucket(M) if dot else 1
    _skinny_kernel[(triton.cdiv(N, t.block_n),)](
        out, x, weight, bias if bias is not None else out, *(scales or (out, out)), M, N, K, x.stride(0),
        weight.stride(0), out.stride(0), BLOCK_M=block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
        HAS_BIAS=bias is not None, SCALED=scales is not None, DOT=dot,
        EVEN_K=K % t.block_k == 0, UPCAST=triton_interpreted() and x.dtype != torch.float32,
        num_warps=t.num_warps, num_stages=t.num_stages,
    )  # fmt: skip
    return out


def skinny_int4_linear(x: torch.Tensor, nibbles: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int):
    """``x [rows, K]`` (bfloat16, rows at most :data:`MAX_ROWS`) times a 4-bit weight stored by rows:
    ``nibbles [N, K/2]`` uint8 (input 2j in the low nibble, 2j + 1 in the high), ``scales_and_zeros
    [K/g, N, 2]`` bfloat16 (``Int4Linear``'s): ``(q - 8) * scale + zero`` per group of ``group_size``."""
    M, K = x.shape
    N = nibbles.shape[0]
    if M > MAX_ROWS:
        raise ValueError(f"skinny_int4_linear takes at most {MAX_ROWS} rows, got {M}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = x.new_empty(M, N)
    if M and N:
        t = tiles(N, K, multiprocessors(x.device))
        _int4_kernel[(triton.cdiv(N, t.block_n),)](
            out, x, nibbles, scales_and_zeros, M, N, K, x.stride(0), nibbles.stride(0), out.stride(0),
            GROUP=group_size, BLOCK_M=row_bucket(M), BLOCK_N=t.block_n, UPCAST=triton_interpreted(),
            num_warps=t.num_warps, num_stages=t.num_stages,
        )  # fmt: skip
    return out


def multiprocessors(device: torch.device) -> int:
    """What :func:`tiles` sizes the grid by: the GPU's count, or in Triton's interpreter an H100's, so
    that the CPU tests launch what a GPU would."""
    return sm_count(device) if device.type == "cuda" else 132


def _skinny_impl(x, weight, bias=None):
    return skinny_linear(x, weight, bias)


def _scaled_impl(x, x_scale, weight, weight_scale, out_dtype):
    return skinny_linear(x, weight, scales=(x_scale, weight_scale), out_dtype=out_dtype)


_lib.impl("skinny_linear", _skinny_impl, "CompositeExplicitAutograd")
torch.library.register_fake(
    "augur::skinny_linear", lambda x, weight, bias=None: x.new_empty(x.shape[0], weight.shape[0]), lib=_lib
)
_lib.impl("skinny_int4_linear", skinny_int4_linear, "CompositeExplicitAutograd")
torch.library.register_fake(
    "augur::skinny_int4_linear", lambda x, nib, sz, g: x.new_empty(x.shape[0], nib.shape[0]), lib=_lib
)
_lib.impl("skinny_scaled_linear", _scaled_impl, "CompositeExplicitAutograd")
torch.library.register_fake(
    "augur::skinny_scaled_linear",
    lambda x, xs, w, ws, out_dtype: torch.empty(x.shape[0], w.shape[0], dtype=out_dtype, device=x.device),
    lib=_lib,
)


class SkinnyLinear(nn.Linear):
    """An ``nn.Linear`` whose forwards of up to :data:`MAX_ROWS` rows run ``augur::skinny_linear``; more
    rows run ``F.linear``. Same parameters, same state dict: :func:`use_skinny_linear` switches a layer
    by its class alone, so whatever reads or wraps the layer (LoRA, tensor parallelism) is unaffected."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] > MAX_ROWS:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.augur.skinny_linear(flat, self.weight, self.bias).view(*x.shape[:-1], self.out_features)


class SkinnyFp8Linear(Fp8Linear):
    """An :class:`~engine.quant.fp8.Fp8Linear` (W8A8: e4m3 weights with a scale per row, activations
    quantized per token) whose calls of up to :data:`MAX_ROWS` rows multiply on
    ``augur::skinny_scaled_linear`` instead of ``torch._scaled_mm``: the same quantized operands and
    scales, products summed exactly in float32 in another order. More rows, and the batch-invariant
    mode, run the layer as it was."""

    def product(self, xq: torch.Tensor, sx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.invariant or xq.shape[0] > MAX_ROWS:
            return super().product(xq, sx, dtype)
        out = torch.bfloat16 if xq.is_cuda else dtype  # as the layer's _scaled_mm returns it
        return torch.ops.augur.skinny_scaled_linear(xq, sx.view(-1), self.weight, self.weight_scale.view(-1), out)


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """``q [N, K]`` (0..15) → ``[N, K/2]`` uint8 as ``augur::skinny_int4_linear`` reads it: input 2j in
    a byte's low nibble, 2j + 1 in its high."""
    return ((q[:, 1::2] << 4) | q[:, ::2]).to(torch.uint8).contiguous()


def _tile_pack(q: torch.Tensor, inner_k_tiles: int) -> torch.Tensor:
    """``q [N, K]`` (0..15) packed for PyTorch's CUDA int4 kernel (a test substitutes a packer of its own)."""
    return torch._convert_weight_to_int4pack(_pairs(q), inner_k_tiles)


class SkinnyInt4Linear(Int4Linear):
    """An :class:`~engine.quant.int4.Int4Linear` on CUDA whose weight is held by rows (``packed``: ``[N,
    K/2]`` uint8, two inputs a byte; the same bytes as the kernel's tiles, re-laid at the switch) and
    whose calls of up to :data:`MAX_ROWS` rows run ``augur::skinny_int4_linear``; more rows multiply
    by :meth:`dequantized` on the dense GEMM, as an ``Int4Linear`` does from ``DENSE_ROWS``. PyTorch's
    int4 kernel (whose time at one row is a third of the bound on an H200) is not called."""

    def product(self, flat: torch.Tensor) -> torch.Tensor:
        if flat.shape[0] > MAX_ROWS:
            return F.linear(flat, self.dequantized())
        return torch.ops.augur.skinny_int4_linear(flat, self.packed, self.scales_and_zeros, self.group_size)

    def integers(self) -> torch.Tensor:  # (from the bytes by rows)
        return torch.stack((self.packed & 15, self.packed >> 4), dim=-1).reshape(self.out_features, self.in_features)

    def to_rows(self) -> None:
        """From the kernel's tiles (an ``Int4Linear`` with a readable ``order``) to bytes by rows."""
        self.packed = pack_rows(Int4Linear.integers(self))

    def to_tiles(self) -> None:
        self.packed = _tile_pack(self.integers(), self.order.numel() // TILE_ROWS // 16)


_SWITCHED = {nn.Linear: SkinnyLinear, Fp8Linear: SkinnyFp8Linear, Int4Linear: SkinnyInt4Linear}
_BACK = {skinny: plain for plain, skinny in _SWITCHED.items()}


def _switchable(module: nn.Module) -> bool:
    kind = type(module)
    if kind is Int4Linear:  # its integers readable from the kernel's tiles, and not the invariant mode's
        return module.order is not None and not module.invariant
    return kind is Fp8Linear or (kind is nn.Linear and module.weight.dtype in (torch.bfloat16, torch.float16))


def use_skinny_linear(model: nn.Module, on: bool = True) -> int:
    """Switch ``model``'s plain ``nn.Linear`` layers (bfloat16 or float16 weights) to :class:`SkinnyLinear`,
    its FP8 layers to :class:`SkinnyFp8Linear` and its int4 layers on CUDA to :class:`SkinnyInt4Linear`
    (``on``), or back; the number switched. Other quantized and packed layers are other classes and stay."""
    count = 0
    for module in model.modules():
        kind = type(module)
        if on and kind in _SWITCHED and _switchable(module):
            module.__class__ = _SWITCHED[kind]
            if kind is Int4Linear:
                module.to_rows()
            count += 1
        elif not on and kind in _BACK:
            if kind is SkinnyInt4Linear:
                module.to_tiles()
            module.__class__ = _BACK[kind]
            count += 1
    return count
