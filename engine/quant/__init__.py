"""Quantized weights: NF4 (bitsandbytes' 4-bit NormalFloat layout), dequantized in pure PyTorch; int4
(grouped affine) on PyTorch's int4 matmul kernels; FP8 (e4m3 weights and activations) on
``torch._scaled_mm``; checkpoints saved quantized (checkpoint.py)."""

from __future__ import annotations

from engine.quant.int4 import Int4Linear, dequantize_int4, quantize_int4, quantize_linears_int4
from engine.quant.nf4 import NF4Linear, NF4Weight, dequantize_nf4, fuse_nf4, quantize_nf4

QUANTIZATIONS = ("nf4", "int4", "fp8")  # what EngineConfig.quantization / --quantization accept

__all__ = [
    "QUANTIZATIONS", "Int4Linear", "NF4Linear", "NF4Weight", "dequantize_int4", "dequantize_nf4", "fuse_nf4",
    "quantize_int4", "quantize_linears_int4", "quantize_nf4",
]  # fmt: skip
