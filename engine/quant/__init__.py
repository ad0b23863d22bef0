"""Quantized weights: NF4 (bitsandbytes' 4-bit NormalFloat layout), dequantized in pure PyTorch."""

from __future__ import annotations

from engine.quant.nf4 import NF4Linear, NF4Weight, dequantize_nf4, fuse_nf4, quantize_nf4

QUANTIZATIONS = ("nf4",)  # what EngineConfig.quantization / --quantization accept

__all__ = ["QUANTIZATIONS", "NF4Linear", "NF4Weight", "dequantize_nf4", "fuse_nf4", "quantize_nf4"]
