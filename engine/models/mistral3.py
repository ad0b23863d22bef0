"""Mistral 3: Ministral 3 (``Ministral3ForCausalLM``) and the language model of a
``Mistral3ForConditionalGeneration`` checkpoint (Mistral Small 3.1 / 3.2, Magistral Small, Devstral
Small 2, Ministral 3), served as text.

What differs from Mistral (``engine.models.llama``):

- Ministral 3's queries are scaled by position after RoPE, Llama 4's attention temperature:
  ``q * (1 + beta * log(1 + floor(pos / original_max_position_embeddings)))``, with ``beta`` the
  ``llama_4_scaling_beta`` of its ``rope_parameters`` (YaRN's, in the releases): 1 below the original
  context, then growing by steps. The model keeps the scale of every position beside its RoPE tables;
  a config without ``beta`` (Mistral Small 3.1's text config is a plain Mistral one) scales nothing.
- A ``Mistral3ForConditionalGeneration`` checkpoint's weights carry its language model's prefixes
  beside a Pixtral vision tower and a projector (:class:`~engine.models.text_tower.TextTower`): the
  tower and the projector are skipped, images are not served.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention import AttentionMetadata
from engine.models.llama import LlamaAttention, LlamaDecoderLayer, MistralForCausalLM
from engine.models.text_tower import TextTower
from engine.parallel import SINGLE, TensorParallel


def query_scale(config) -> tuple[float, int] | None:
    """``(beta, original_max_position_embeddings)`` of the config's query scaling, or None without it."""
    params = getattr(config, "rope_parameters", None) or {}
    beta = params.get("llama_4_scaling_beta")
    if not beta:
        return None
    original = params.get("original_max_position_embeddings") or config.max_position_embeddings
    return float(beta), int(original)


class Ministral3Attention(LlamaAttention):
    """Llama's attention (its fused RoPE kernel too) with the queries scaled by their positions' factors
    after RoPE. It takes ``cos`` as ``(cos, scale)``, ``scale [T, 1, 1]`` in the model's dtype (what the
    model's forward hands it: :meth:`Ministral3ForCausalLM.rope_at`)."""

    def forward(self, x, cos, sin, kv_pool: torch.Tensor, layer: int, meta: AttentionMetadata) -> torch.Tensor:
        cos, scale = cos
        q, k, v = self.rotated(x, cos, sin, kv_pool, layer, meta)
        return self.tp.all_reduce(self.o_proj(self.attend(q * scale, k, v, kv_pool, layer, meta)))


class QueryScaled:
    """A mixin before a decoder's class whose attention scales its queries by position where the config
    says so (``scaled``: :func:`query_scale`'s): it keeps each position's factor
    (``rope_query_scale [max_positions]``) and hands the layers ``cos`` as ``(cos, scale)`` (Ministral 3's,
    Mistral 4's)."""

    def __init__(self, config, max_positions: int | None = None, tp: TensorParallel = SINGLE) -> None:
        self.scaled = query_scale(config)  # (before Llama's constructor: decoder_layer reads it)
        super().__init__(config, max_positions, tp)

    def init_buffers(self, max_positions: int) -> None:
        super().init_buffers(max_positions)
        if self.scaled is None or self.embed_tokens.weight.device.type == "meta":
            return
        beta, original = self.scaled
        positions = torch.arange(max_positions, dtype=torch.float32)
        scale = 1 + beta * torch.log(1 + torch.floor(positions / original))
        self.register_buffer("rope_query_scale", scale.to(self.embed_tokens.weight.device), persistent=False)

    def rope_at(self, positions: torch.Tensor, dtype: torch.dtype):
        cos, sin = super().rope_at(positions, dtype)
        if self.scaled is None:
            return cos, sin
        return (cos, self.rope_query_scale[positions].to(dtype)[:, None, None]), sin


class Ministral3ForCausalLM(QueryScaled, MistralForCausalLM):
    """Ministral 3 causal LM over a paged KV cache: Mistral's model, its attention scaling the queries by
    position where the config says so."""

    def decoder_layer(self, config, i: int, qkv_bias: bool, o_bias: bool, tp: TensorParallel) -> nn.Module:
        if self.scaled is None:
            return super().decoder_layer(config, i, qkv_bias, o_bias, tp)
        attn = Ministral3Attention(config, i, qkv_bias, o_bias, qk_norm=False, tp=tp)
        return LlamaDecoderLayer(config, i, qkv_bias, o_bias, False, tp, attn=attn)


class Mistral3TextForCausalLM(TextTower, Ministral3ForCausalLM):
    """The language model of a ``Mistral3ForConditionalGeneration`` checkpoint, served as text only: its
    text config is Mistral's (Mistral Small 3.1 / 3.2) or Ministral 3's (Ministral 3, Devstral Small 2),
    and either is :class:`Ministral3ForCausalLM` (which scales no query without ``beta``)."""

    architecture = "Mistral3ForConditionalGeneration"
