"""IBM Granite 3 (``GraniteForCausalLM``): Llama's decoder with four scalar multipliers from its config.

What differs from ``engine.models.llama``:

- ``embedding_multiplier``: the token embeddings are scaled by it before the first layer;
- ``attention_multiplier``: the attention scores' scale, in place of ``head_dim ** -0.5``;
- ``residual_multiplier``: each sublayer's output is scaled by it before it is added to the residual
  stream, ``x + r * attn(norm(x))`` and ``x + r * mlp(norm(x))``;
- ``logits_scaling``: the logits are divided by it.

Each product rounds to the model's dtype where transformers' does (the embeddings and the sublayers'
outputs); the logits are divided in float32, after the LM head (transformers divides its bfloat16
logits). Biases (``attention_bias``, ``mlp_bias``), the norms, weight names and tensor-parallel
sharding are Llama's. The Granite 4 models are other architectures (``GraniteMoeHybridForCausalLM``,
with Mamba-2 layers) and are not served.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from engine.parallel import SINGLE, TensorParallel


class GraniteDecoderLayer(LlamaDecoderLayer):
    """Llama's layer with each sublayer's output scaled by ``residual_multiplier`` before the sum."""

    def __init__(self, config, layer_idx: int, qkv_bias: bool, o_bias: bool, tp: TensorParallel) -> None:
        super().__init__(config, layer_idx, qkv_bias, o_bias, False, tp)
        self.residual_multiplier = float(config.residual_multiplier)
        self.self_attn.scale = float(config.attention_multiplier)

    def forward(self, x, cos, sin, kv_pool, layer, meta, attn: bool = True, mlp: bool = True) -> torch.Tensor:
        r = self.residual_multiplier
        if self.fused and attn and mlp:
            a = self.self_attn(self.input_layernorm(x), cos, sin, kv_pool, layer, meta) * r
            norm = self.post_attention_layernorm
            h, x = torch.ops.augur.fused_add_rms_norm(x, a, norm.weight, norm.eps, norm.unit_offset)
            return x + self.mlp(h) * r
        if attn:
            x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_pool, layer, meta) * r
        if mlp:
            x = x + self.mlp(self.post_attention_layernorm(x)) * r
        return x


class GraniteForCausalLM(LlamaForCausalLM):
    """Granite 3 causal LM over a paged KV cache: Llama's model with Granite's layers, its embeddings
    scaled by ``embedding_multiplier`` and its logits divided by ``logits_scaling``."""

    def __init__(self, config, max_positions: int | None = None, tp: TensorParallel = SINGLE) -> None:
        super().__init__(config, max_positions, tp)
        self.embedding_multiplier = float(config.embedding_multiplier)
        self.logits_scaling = float(config.logits_scaling)

    def decoder_layer(self, config, i: int, qkv_bias: bool, o_bias: bool, tp: TensorParallel) -> nn.Module:
        return GraniteDecoderLayer(config, i, qkv_bias, o_bias, tp)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) * self.embedding_multiplier

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.logits_scaling
