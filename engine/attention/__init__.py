"""Paged attention over one flattened batch of new tokens from many sequences, behind one interface.

The runner flattens every scheduled sequence's new tokens (prefill chunks, decode tokens, draft trees)
into one ``[T]`` batch. Each new token's K/V is written to its cache slot; then each sequence's
queries attend to its whole context: the tokens already cached and its new tokens.

Terms:
- *context length* ``ctx_len``: tokens of a sequence already in the cache before this forward.
- *new-token mask*: which of a sequence's new tokens each new token may see. Causal by default; a
  draft tree passes its ancestor mask instead. Cached tokens are always visible.
- *slot*: ``block_id * block_size + offset``, a row of the flat KV pool.

A backend is a metadata builder: from plain lists (one entry per sequence) it builds, once per
forward, the device tensors every layer shares, and that metadata's ``attend`` is what each layer
calls (through :func:`paged_attention`). The model code never knows which backend runs.

- ``sdpa`` (``sdpa.py``): gathers each sequence's K/V and runs ``scaled_dot_product_attention`` with a
  dense padded mask. The CPU path and the reference.
- ``triton`` (``triton_paged.py``): one Triton kernel reads K/V straight from the paged pool, with
  per-sequence tree masks; memory proportional to what is computed. The GPU path; on a CPU its
  kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``), which is how the tests check it.

``auto`` picks ``triton`` on a CUDA device where Triton imports, ``sdpa`` otherwise. Both read a pool
of the model's dtype or of 8-bit floats (``kv_dtype.py``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Protocol

import torch

from engine.attention.common import triton_interpreted

BACKENDS = ("sdpa", "triton")


class AttentionMetadata(Protocol):
    num_seqs: int

    def attend(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor | None,  # [T, Hkv, D]; None: already in the pool (kv_write_slots)
        v: torch.Tensor | None,  # [T, Hkv, D]; None alike
        kv_pool: torch.Tensor,  # [layers, 2, num_slots, Hkv, D]
        layer: int,
        scale: float,
        sliding: bool,
        softcap: float,
        sinks: torch.Tensor | None = None,  # [H] float32
        kv_scales: torch.Tensor | None = None,  # [2, Hkv] float32: an FP8 pool's K and V scales (kv_dtype.py)
    ) -> torch.Tensor: ...  # [T, H * D]

    def kv_write_slots(self, kv_pool: torch.Tensor) -> torch.Tensor | None:
        """[T] int64: the slot of each new token, where the caller may write the new K/V into
        ``kv_pool`` itself (a fused kernel that has them in registers) and then call ``attend`` with
        ``k`` and ``v`` None; None where this backend writes them (it must then be handed them)."""
        ...

    def tie_shapes(self, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        """Declare (``torch._check``) which of the metadata's sizes always equal each other or the batch's
        token count: a compiled forward then takes one symbolic size for each, where every symbolic
        size is an argument its wrapper converts on each call."""
        ...


MetadataBuilder = Callable[..., AttentionMetadata]


def resolve_backend(name: str, device: torch.device) -> str:
    """The backend ``name`` stands for on ``device`` (``auto`` resolved), or a ValueError saying why not."""
    has_triton = importlib.util.find_spec("triton") is not None
    if name == "auto":
        return "triton" if device.type == "cuda" and has_triton else "sdpa"
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be auto or one of {list(BACKENDS)}, got {name!r}")
    if name == "triton":
        if not has_triton:
            raise ValueError("the triton attention backend needs the triton package (pip install triton)")
        if device.type != "cuda" and not triton_interpreted():
            raise ValueError(
                "the triton attention backend needs a CUDA device "
                "(or TRITON_INTERPRET=1, which runs its kernels in Triton's interpreter: slow, for testing)"
            )
    return name


def metadata_builder(name: str) -> MetadataBuilder:
    """The metadata builder of a resolved backend name (Triton is imported only when asked for)."""
    if name == "triton":
        from engine.attention.triton_paged import build_triton_metadata

        return build_triton_metadata
    from engine.attention.sdpa import build_sdpa_metadata

    return build_sdpa_metadata


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor | None,  # [T, Hkv, D]; None: the caller wrote it at meta.kv_write_slots
    v: torch.Tensor | None,  # [T, Hkv, D]; None alike
    kv_pool: torch.Tensor,  # [layers, 2, num_slots, Hkv, D]
    layer: int,
    meta: AttentionMetadata,
    scale: float,
    sliding: bool = False,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,  # [H] float32
    kv_scales: torch.Tensor | None = None,  # [2, Hkv] float32
) -> torch.Tensor:  # [T, H * D]
    """Write the new K/V into ``kv_pool[layer]`` (unless the caller has: ``k`` and ``v`` None, at the
    slots ``meta.kv_write_slots`` gave), then attend each sequence's queries to its context.
    ``sliding`` applies the model's sliding window; ``softcap`` > 0 soft-caps the scores at that value.
    ``sinks``: *attention sinks* (gpt-oss), one learned logit per query head that joins every query's
    softmax as a key with no value: the weights of the real keys sum to less than one, by as much as
    the sink takes. ``kv_scales``: the layer's K and V scales per KV head, where the pool stores 8-bit
    floats (``kv_dtype.py``; None there: 1.0); a pool in the model's dtype ignores them."""
    if sinks is None and kv_scales is None:
        return meta.attend(q, k, v, kv_pool, layer, scale, sliding, softcap)
    return meta.attend(q, k, v, kv_pool, layer, scale, sliding, softcap, sinks, kv_scales)
