"""MXFP4 weights as gpt-oss checkpoints ship its experts: read into full precision at load.

MXFP4 (the OCP microscaling format): blocks of 32 values share one power-of-two scale; each value is
a 4-bit float, E2M1 (a sign, two exponent bits, one mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their
negatives). A checkpoint stores a weight [..., out, in] as ``*_blocks`` [..., out, in / 32, 16] uint8,
two values a byte (the low nibble first), and ``*_scales`` [..., out, in / 32] uint8, the scale's
exponent biased by 127 (E8M0). Every such value is exact in bfloat16, so the weights dequantized
here are the checkpoint's, not an approximation of them.
"""

from __future__ import annotations

import torch

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values per scale


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """blocks [..., out, G, 16] uint8 and scales [..., out, G] uint8 → the weight [..., out, G * 32]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
            "(want [..., G, 16] and [..., G])"
        )
    lut = torch.tensor(E2M1, dtype=dtype, device=blocks.device)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)  # [..., G, 16, 2]
    values = values.flatten(-2)  # [..., G, 32]: low nibble, high nibble, next byte...
    exponents = scales.to(torch.int32) - 127
    return torch.ldexp(values, exponents.unsqueeze(-1)).to(dtype).flatten(-2)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse, for tests and tools: weight [..., out, in] (in a multiple of 32) → (blocks,
    scales), each block's scale the power of two that brings its largest magnitude to at most 6 and
    each value rounded to the nearest E2M1 value."""
    *lead, out, inp = weight.shape
    if inp % BLOCK:
        raise ValueError(f"MXFP4 needs the input dimension to be a multiple of {BLOCK}, got {inp}")
    w = weight.float().reshape(*lead, out, inp // BLOCK, BLOCK)
    top = w.abs().amax(dim=-1).clamp(min=2.0**-126)
    exp = torch.ceil(torch.log2(top / 6.0)).clamp(-127, 127)
    scaled = w / torch.pow(2.0, exp).unsqueeze(-1)
    lut = torch.tensor(E2M1[:8])
    code = (scaled.abs().unsqueeze(-1) - lut).abs().argmin(dim=-1) + 8 * (scaled < 0).long()
    code = code.to(torch.uint8).reshape(*lead, out, inp // BLOCK, BLOCK // 2, 2)
    blocks = code[..., 0] | (code[..., 1] << 4)
    return blocks, (exp + 127).to(torch.uint8)
