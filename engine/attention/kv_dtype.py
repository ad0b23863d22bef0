"""What the KV pool stores: the model's dtype, or 8-bit floats (``--kv-cache-dtype fp8``).

*FP8 KV cache*: each K and V row is stored as ``float8_e4m3fn`` (4 exponent bits, 3 mantissa bits,
largest finite value 448), one byte an element where bfloat16 takes two: the same memory holds twice
the tokens. A stored value is ``round(x / scale)``, saturated at +-448; attention reads ``stored * scale``.
The *scales* are one float per layer, K or V, and KV head (``kv_scales [2, Hkv]`` beside each
attention layer): the checkpoint's, when it was calibrated for an FP8 cache (``self_attn.k_scale`` /
``v_scale``, llm-compressor's ``kv_cache_scheme``; ``k_proj.output_scale`` / ``v_proj.output_scale``,
AutoFP8's), else 1.0, as vLLM and SGLang take them. E4M3 carries about two significant digits, so
attention over an FP8 cache is a close neighbour of the model's, not the model itself (the tolerance
measured is in docs/quantization.md); speculation stays exact against it, because drafts are verified
against the same cache a plain decode reads.

Every backend keeps the pool's bytes as they are and converts where it reads: the reference
(``sdpa.py``) and the C++ CPU kernel dequantize the rows they gather, the Triton kernel the tiles it
loads. Index operations on 8-bit floats are missing on CPUs, so rows move through a ``uint8`` view.
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "fp8")  # EngineConfig.kv_cache_dtype / --kv-cache-dtype
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def pool_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype a KV pool stores for ``--kv-cache-dtype`` (``auto``: the model's own)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return FP8 if kv_cache_dtype == "fp8" else model_dtype


def is_fp8(pool: torch.Tensor) -> bool:
    return pool.dtype == FP8


def raw(pool: torch.Tensor) -> torch.Tensor:
    """``pool`` as bytes where it holds 8-bit floats (indexing works on those), else itself."""
    return pool.view(torch.uint8) if pool.dtype == FP8 else pool


def quantize(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """New rows ``x [T, Hkv, D]`` as FP8 for ``scale [Hkv]`` (None: 1.0), saturated."""
    x = x.float()
    if scale is not None:
        x = x / scale.float()[:, None]
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(stored: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """FP8 rows ``stored [..., Hkv, D]`` as ``dtype``: each value times its head's ``scale [Hkv]``."""
    x = stored.float()
    if scale is not None:
        x = x * scale.float()[:, None]
    return x.to(dtype)


def write_rows(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, scale: torch.Tensor | None) -> None:
    """Write ``x [T, Hkv, D]`` into ``cache [num_slots, Hkv, D]`` at ``slots``, quantized where it is FP8."""
    if cache.dtype == FP8:
        raw(cache).index_copy_(0, slots, raw(quantize(x, scale)))
    else:
        cache.index_copy_(0, slots, x)


def read_rows(cache: torch.Tensor, slots: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``slots`` of ``cache [num_slots, Hkv, D]`` as ``dtype``, dequantized where it is FP8."""
    if cache.dtype == FP8:
        return dequantize(raw(cache).index_select(0, slots).view(FP8), scale, dtype)
    return cache.index_select(0, slots)
