"""4-bit NormalFloat (NF4) weights, in bitsandbytes' layout, dequantized in pure PyTorch.

*NF4* (QLoRA, Dettmers et al. 2023) stores each weight as a 4-bit index into a fixed code book of 16
values in [-1, 1] placed at quantiles of a standard normal, so that normally distributed weights use
every code about equally often. Weights are cut into *blocks* of ``blocksize`` consecutive values of
the row-major matrix; each block keeps its *absmax* (largest magnitude) and stores
``round_to_code(w / absmax)``. Dequantized: ``code[index] * absmax``.

*Nested* (double) quantization compresses the absmax statistics themselves: subtract their mean
(the *offset*), then quantize them to 8 bits with bitsandbytes' signed dynamic map in blocks of 256,
each with its own float32 absmax. It takes the statistics from 32 to ~8.1 bits per block of 64 weights
(0.5 → 0.127 bits per weight).

The byte layout is bitsandbytes' so that its checkpoints load as they are and ours would load there:
two indices per uint8, the first element of a pair in the high nibble; absmax in float32; an odd
element count padded with the code of 0.0.

:class:`NF4Linear` keeps the packed weight and its statistics and rebuilds the full-precision matrix
on every call (vectorised lookups, no kernel of its own) before a plain ``F.linear``: it saves memory,
not time. It is not an ``nn.Linear``, so CPU prepacking (``engine.models.packed``) leaves it alone.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

DEFAULT_BLOCKSIZE = 64
NESTED_BLOCKSIZE = 256
BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)  # the ones bitsandbytes accepts

# The 16 NF4 values (bitsandbytes' ``get_4bit_type("nf4")``, QLoRA appendix E), sorted.
NF4_CODE = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
ZERO_INDEX = NF4_CODE.index(0.0)


def nf4_code(device: torch.device | str | None = None) -> torch.Tensor:  # [16] float32
    return torch.tensor(NF4_CODE, dtype=torch.float32, device=device)


@functools.cache
def _dynamic_map() -> tuple[float, ...]:
    # Signed, 7 exponent bits, 8 bits in all: for each decade 10^-6 .. 10^0, 2^e evenly spaced
    # magnitudes (midpoints of a linspace over [0.1, 1]), both signs; plus 0 and 1: 256 values.
    values = [0.0, 1.0]
    for e in range(7):
        edges = torch.linspace(0.1, 1.0, 2**e + 1, dtype=torch.float32)
        mids = (edges[:-1] + edges[1:]) / 2.0 * 10.0 ** (e - 6)
        values += mids.tolist() + (-mids).tolist()
    return tuple(sorted(values))


def dynamic_map(device: torch.device | str | None = None) -> torch.Tensor:  # [256] float32
    """bitsandbytes' signed 8-bit dynamic quantization map (``create_dynamic_map()``), which it uses
    for nested statistics: dense near 0, log-spaced over six decades."""
    return torch.tensor(_dynamic_map(), dtype=torch.float32, device=device)


@dataclass
class NF4Weight:
    """One NF4-quantized matrix, field for field what bitsandbytes serializes."""

    packed: torch.Tensor  # uint8 [ceil(numel / 2)]: two 4-bit indices per byte, first in the high nibble
    absmax: torch.Tensor  # float32 [blocks]; uint8 [blocks] (dynamic-map indices) when nested
    shape: tuple[int, int]  # [out_features, in_features]
    blocksize: int = DEFAULT_BLOCKSIZE
    nested_absmax: torch.Tensor | None = None  # float32 [ceil(blocks / nested_blocksize)]
    nested_code: torch.Tensor | None = None  # float32 [256]
    nested_offset: torch.Tensor | None = None  # float32 [] (one mean) or [nested blocks] (after fusing)
    nested_blocksize: int = NESTED_BLOCKSIZE

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def nested(self) -> bool:
        return self.nested_absmax is not None

    def block_absmax(self) -> torch.Tensor:  # float32 [blocks]
        """The per-block absmax, decoded from the nested statistics if need be (exactly as bitsandbytes
        does: ``code[q] * nested_absmax + offset`` in float32)."""
        if not self.nested:
            return self.absmax.float()
        values = self.nested_code[self.absmax.int()]
        offset = self.nested_offset if self.nested_offset.dim() else self.nested_offset.expand(1)
        return _scale_blocks(values, self.nested_absmax, self.nested_blocksize, offset)

    def flat(self) -> NF4Weight:
        """The same weight with float32 absmax (lossless: the nested statistics decoded)."""
        if not self.nested:
            return self
        return NF4Weight(self.packed, self.block_absmax(), self.shape, self.blocksize)


def _scale_blocks(
    values: torch.Tensor,  # [n] float32
    scales: torch.Tensor,  # [ceil(n / blocksize)]
    blocksize: int,
    offsets: torch.Tensor | None = None,  # [ceil(n / blocksize)] or [1]
) -> torch.Tensor:  # [n] float32: values * their block's scale (+ its offset); the last block may be short
    n = values.numel()
    full = n - n % blocksize
    nb = full // blocksize
    out = values[:full].view(nb, blocksize) * scales[:nb, None]
    if offsets is not None:
        out = out + (offsets[:nb, None] if offsets.numel() > 1 else offsets)
    out = out.view(-1)
    if full < n:
        tail = values[full:] * scales[-1]
        if offsets is not None:
            tail = tail + offsets[-1]
        out = torch.cat((out, tail))
    return out


def _blockwise_codes(
    values: torch.Tensor, code: torch.Tensor, blocksize: int
) -> tuple[torch.Tensor, torch.Tensor]:  # (int64 [n] nearest-code indices, float32 [blocks] absmax)
    """Scale each block by its absmax and round to the nearest value of the sorted ``code`` (a value
    exactly between two codes takes the lower one, as bitsandbytes' reference kernel does)."""
    flat = values.reshape(-1).float()
    n = flat.numel()
    blocks = math.ceil(n / blocksize)
    padded = F.pad(flat, (0, blocks * blocksize - n)).view(blocks, blocksize)  # zeros change no absmax
    absmax = padded.abs().amax(dim=1)
    scaled = (padded * (1.0 / absmax.clamp(min=1e-38))[:, None]).clamp(-1.0, 1.0)
    midpoints = (code[:-1] + code[1:]) / 2
    return torch.bucketize(scaled.view(-1), midpoints), absmax


def quantize_nf4(
    weight: torch.Tensor,  # [out, in], any float dtype
    blocksize: int = DEFAULT_BLOCKSIZE,
    nested: bool = False,
) -> NF4Weight:
    """Quantize a matrix to NF4, optionally with nested statistics (bitsandbytes' ``quantize_4bit``
    with ``quant_type="nf4"`` and ``compress_statistics=nested``)."""
    if blocksize not in BLOCKSIZES:
        raise ValueError(f"NF4 blocksize must be one of {BLOCKSIZES}, got {blocksize}")
    if weight.dim() != 2:
        raise ValueError(f"NF4 quantizes matrices, got shape {tuple(weight.shape)}")
    n = weight.numel()
    idx, absmax = _blockwise_codes(weight, nf4_code(weight.device), blocksize)
    idx = idx[: n + n % 2].to(torch.uint8)  # an odd count keeps one padding zero (code index 7)
    packed = (idx[0::2] << 4) | idx[1::2]
    q = NF4Weight(packed, absmax, (weight.shape[0], weight.shape[1]), blocksize)
    if nested:
        offset = absmax.mean()
        code = dynamic_map(weight.device)
        qabsmax, nested_absmax = _blockwise_codes(absmax - offset, code, NESTED_BLOCKSIZE)
        q = replace(
            q,
            absmax=qabsmax[: absmax.numel()].to(torch.uint8),
            nested_absmax=nested_absmax,
            nested_code=code,
            nested_offset=offset,
        )
    return q


@functools.cache
def _pair_table_values() -> torch.Tensor:  # [256, 2] float32: byte → (code[high nibble], code[low nibble])
    code = nf4_code("cpu")  # explicit: a first call under ``torch.device("meta")`` must not cache meta tensors
    byte = torch.arange(256, device="cpu")
    return torch.stack((code[byte >> 4], code[byte & 15]), dim=1)


def dequantize_nf4(q: NF4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # [out, in]
    """Rebuild the matrix: the products are taken in float32 and rounded once to ``dtype``, as
    bitsandbytes does, so its outputs and ours agree bit for bit."""
    table = _pair_table_values().to(q.packed.device)
    return _dequantize(q.packed, q.block_absmax(), table, q.shape, q.blocksize, dtype)


def _dequantize(
    packed: torch.Tensor,  # uint8 [ceil(n / 2)]
    absmax: torch.Tensor,  # float32 [blocks]
    table: torch.Tensor,  # float32 [256, 2]
    shape: Sequence[int],
    blocksize: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    n = shape[0] * shape[1]
    values = table.index_select(0, packed.int()).view(-1)[:n]  # one gather decodes both nibbles of a byte
    return _scale_blocks(values, absmax, blocksize).to(dtype).view(shape[0], shape[1])


def fuse_nf4(parts: Sequence[NF4Weight]) -> NF4Weight:
    """Stack quantized matrices along their rows (q/k/v → qkv, gate/up → gate_up) without touching a
    4-bit value: a row-major matrix stacked on rows is its parts' flat values end to end, so where
    every part fills whole blocks the packed bytes and statistics simply concatenate. Nested
    statistics concatenate too (each nested block keeping its part's offset) where every part but
    the last fills whole nested blocks; otherwise they are decoded to float32 absmax, still exact.
    Parts that end mid-block (never in real models: their sizes are multiples of 64) are
    dequantized, stacked and quantized again, which is not lossless."""
    if len(parts) == 1:
        return parts[0]
    in_features = parts[0].shape[1]
    if any(p.shape[1] != in_features for p in parts):
        raise ValueError(f"cannot fuse NF4 matrices of different widths: {[p.shape for p in parts]}")
    rows = sum(p.shape[0] for p in parts)
    bs = parts[0].blocksize
    if any(p.blocksize != bs or p.numel % bs for p in parts):
        w = torch.cat([dequantize_nf4(p) for p in parts])
        return quantize_nf4(w, bs, nested=all(p.nested for p in parts))
    packed = torch.cat([p.packed for p in parts])
    nbs = parts[0].nested_blocksize
    aligned = all(p.nested and p.nested_blocksize == nbs for p in parts) and all(
        (p.numel // bs) % nbs == 0 for p in parts[:-1]
    )
    if not aligned:
        absmax = torch.cat([p.flat().absmax for p in parts])
        return NF4Weight(packed, absmax, (rows, in_features), bs)
    offsets = [p.nested_offset.reshape(-1).expand(p.nested_absmax.numel()) for p in parts]
    return NF4Weight(
        packed,
        torch.cat([p.absmax for p in parts]),
        (rows, in_features),
        bs,
        nested_absmax=torch.cat([p.nested_absmax for p in parts]),
        nested_code=parts[0].nested_code,
        nested_offset=torch.cat(offsets),
        nested_blocksize=nbs,
    )


# -- bitsandbytes' serialized layout -------------------------------------------------------------------
# A quantized ``<module>.weight`` is saved (``QuantState.as_dict(packed=True)``) as these tensors, each
# named ``<module>.weight.<suffix>`` beside the packed ``<module>.weight`` itself (uint8 [ceil(n/2), 1]).
QUANT_STATE_PREFIX = "quant_state.bitsandbytes__"  # + quant type: uint8 bytes of a JSON object
BNB_SUFFIXES = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")


def bnb_quantization_kind(quantization_config: dict | None) -> str | None:
    """``"nf4"`` for a config.json ``quantization_config`` of 4-bit NF4 bitsandbytes weights, None for
    no quantization; any other scheme (fp4, 8-bit, another method) is an error naming it."""
    if not quantization_config:
        return None
    qc = dict(quantization_config)
    method = qc.get("quant_method", "bitsandbytes")  # configs from before quant_method existed were bnb's
    if method != "bitsandbytes":  # (the formats engine/quant/checkpoint.py reads never come here)
        raise ValueError(
            f"quantization method {method!r} is not supported (supported: bitsandbytes NF4, gptq, awq, "
            "compressed-tensors, fp8, and gpt-oss's mxfp4)"
        )
    if qc.get("load_in_8bit") or qc.get("_load_in_8bit"):
        raise ValueError("8-bit bitsandbytes (LLM.int8) checkpoints are not supported; Augur loads 4-bit NF4 only")
    if not (qc.get("load_in_4bit") or qc.get("_load_in_4bit")):
        raise ValueError("a bitsandbytes quantization_config without load_in_4bit is not supported")
    kind = qc.get("bnb_4bit_quant_type", "fp4")  # transformers' default
    if kind != "nf4":
        raise ValueError(f"bitsandbytes 4-bit quant type {kind!r} is not supported; Augur loads nf4 only")
    return "nf4"


def nf4_from_bnb(name: str, tensors: dict[str, torch.Tensor]) -> NF4Weight:
    """One weight from its bitsandbytes tensors: ``tensors`` maps ``"weight"`` and the suffixes after
    ``<name>.weight.`` (``absmax``, ``quant_map``, ``nested_*``, ``quant_state.bitsandbytes__nf4``) to
    the checkpoint's tensors. Errors name the module."""
    states = [k for k in tensors if k.startswith("quant_state.")]
    if len(states) != 1:
        raise ValueError(f"{name}: expected one weight.quant_state.bitsandbytes__<type> tensor, found {states}")
    kind = states[0].removeprefix(QUANT_STATE_PREFIX)
    if kind != "nf4":
        raise ValueError(f"{name}: bitsandbytes quant type {kind!r} is not supported; Augur loads nf4 only")
    info = json.loads(bytes(tensors[states[0]].cpu().to(torch.uint8).tolist()).decode("utf-8"))
    for key in ("weight", "absmax", "quant_map"):
        if key not in tensors:
            raise ValueError(f"{name}: missing tensor weight{'' if key == 'weight' else '.' + key}")
    if info.get("quant_type") != "nf4":
        raise ValueError(f"{name}: quant_state says quant_type {info.get('quant_type')!r}, expected nf4")
    shape, blocksize = info.get("shape"), info.get("blocksize")
    if not shape or len(shape) != 2 or blocksize not in BLOCKSIZES:
        raise ValueError(f"{name}: quant_state has shape {shape} and blocksize {blocksize}: not an NF4 matrix")
    code = tensors["quant_map"].float().reshape(-1).cpu()
    if code.shape != (16,) or not torch.allclose(code, nf4_code(), atol=1e-6):
        raise ValueError(f"{name}: weight.quant_map is not the NF4 code book")
    packed = tensors["weight"]
    packed = (packed if packed.dtype == torch.uint8 else packed.contiguous().view(torch.uint8)).reshape(-1)
    q = NF4Weight(packed, tensors["absmax"].reshape(-1), (int(shape[0]), int(shape[1])), int(blocksize))
    blocks = math.ceil(q.numel / q.blocksize)
    if packed.numel() != math.ceil(q.numel / 2) or q.absmax.numel() != blocks:
        raise ValueError(
            f"{name}: {packed.numel()} packed bytes and {q.absmax.numel()} absmax for a {tuple(shape)} matrix "
            f"in blocks of {blocksize} (expected {math.ceil(q.numel / 2)} and {blocks})"
        )
    if "nested_absmax" not in tensors:
        return replace(q, absmax=q.absmax.float())
    nested_blocksize = int(info.get("nested_blocksize", NESTED_BLOCKSIZE))
    nested_absmax = tensors["nested_absmax"].float().reshape(-1)
    if "nested_quant_map" not in tensors or "nested_offset" not in info:
        raise ValueError(f"{name}: nested statistics without nested_quant_map or nested_offset")
    if q.absmax.dtype != torch.uint8 or nested_absmax.numel() != math.ceil(blocks / nested_blocksize):
        raise ValueError(f"{name}: nested statistics do not match {blocks} blocks of {nested_blocksize}")
    return replace(
        q,
        nested_absmax=nested_absmax,
        nested_code=tensors["nested_quant_map"].float().reshape(-1),
        nested_offset=torch.tensor(float(info["nested_offset"]), device=packed.device),
        nested_blocksize=nested_blocksize,
    )


_FLOAT32_BUFFERS = ("absmax", "nested_absmax", "nested_offset", "nested_code", "table")


class NF4Linear(nn.Module):
    """A linear layer over an NF4 weight: ``F.linear(x, dequantize(weight).to(x.dtype), bias)``.

    Buffers (they follow ``.to(device)``): ``weight`` uint8 [ceil(out*in/2)], ``absmax`` float32
    [blocks] or uint8 [blocks] when nested, then ``nested_absmax``, ``nested_offset`` (float32, per
    nested block) and ``nested_code`` [256]; ``table`` [256, 2] decodes a byte to its two values.
    ``bias`` is a parameter so that checkpoint loaders fill it like any other (fused q/k/v biases).
    ``invariant``: the product on ``augur::invariant_linear`` (the batch-invariant mode)."""

    invariant = False

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.blocksize = DEFAULT_BLOCKSIZE
        self.nested_blocksize = NESTED_BLOCKSIZE
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        for name in ("weight", "absmax", "nested_absmax", "nested_offset", "nested_code"):
            self.register_buffer(name, None)
        self.register_buffer("table", _pair_table_values().clone(), persistent=False)

    @classmethod
    def from_weight(cls, q: NF4Weight, bias: torch.Tensor | None = None) -> NF4Linear:
        layer = cls(q.shape[1], q.shape[0], bias=bias is not None)
        layer.set_weight(q)
        if bias is not None:
            layer.bias.data = bias.detach().clone()
        return layer

    def set_weight(self, q: NF4Weight) -> None:
        if tuple(q.shape) != (self.out_features, self.in_features):
            raise ValueError(f"NF4 weight of shape {q.shape} for a {self.out_features}x{self.in_features} linear")
        device = q.packed.device
        self.weight = q.packed.reshape(-1).contiguous()
        self.absmax = q.absmax.reshape(-1).contiguous()
        self.blocksize, self.nested_blocksize = q.blocksize, q.nested_blocksize
        if q.nested:
            self.nested_absmax = q.nested_absmax.float().reshape(-1)
            self.nested_offset = q.nested_offset.float().reshape(-1).to(device)
            self.nested_code = q.nested_code.float().to(device)
        else:
            self.nested_absmax = self.nested_offset = self.nested_code = None
        self.table = _pair_table_values().to(device)

    def quantized_weight(self) -> NF4Weight:
        return NF4Weight(
            self.weight,
            self.absmax,
            (self.out_features, self.in_features),
            self.blocksize,
            self.nested_absmax,
            self.nested_code,
            self.nested_offset,
            self.nested_blocksize,
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # [out, in]
        shape = (self.out_features, self.in_features)
        absmax = self.quantized_weight().block_absmax()
        return _dequantize(self.weight, absmax, self.table, shape, self.blocksize, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        weight = self.dequantize(x.dtype)
        if self.invariant:  # the operator engine.models.invariant registers (the mode's loader imports it)
            y = torch.ops.augur.invariant_linear(x.reshape(-1, self.in_features), weight, bias)
            return y.view(*x.shape[:-1], self.out_features)
        return F.linear(x, weight, bias)

    def _apply(self, fn, recurse: bool = True):
        # The statistics and the code table stay float32 whatever the model is cast to: a
        # ``.to(bfloat16)`` would round every absmax. They follow device moves only.
        kept = {n: t for n in _FLOAT32_BUFFERS if (t := self._buffers.get(n)) is not None}
        super()._apply(fn, recurse)
        for n, t in kept.items():
            if t.dtype == torch.float32:
                self._buffers[n] = t.to(fn(t[:0]).device)
        return self

    def extra_repr(self) -> str:
        nested = ", nested" if self.nested_absmax is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, blocksize={self.blocksize}{nested}"
