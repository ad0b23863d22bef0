"""EXAONE 4.0 (``Exaone4ForCausalLM``: EXAONE-4.0-32B, EXAONE-4.0-1.2B): OLMo 2's layer shape with Qwen 3's
attention, and global layers without position embedding.

What differs from Llama's:

- each sublayer's output is normalized before it joins the residual (post-norms, OLMo 2's layer shape:
  engine/models/olmo2.py), with Llama's RMSNorm;
- q and k are RMS-normalized per head before RoPE (Qwen 3's norms, replicated under ``-tp``);
- where the config has sliding-window layers (``layer_types``: three sliding to one full in the 32B
  model), the full-attention layers turn nothing (NoPE: positions only through the causal mask) and the
  sliding ones turn RoPE; a config without a sliding window (the 1.2B model) turns RoPE in every layer.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention import AttentionMetadata
from engine.models.llama import LlamaAttention, LlamaForCausalLM, RMSNorm
from engine.models.olmo2 import Olmo2DecoderLayer
from engine.parallel import SINGLE, TensorParallel


class Exaone4Attention(LlamaAttention):
    """Llama's attention with per-head q/k norms, leaving RoPE out of a full-attention layer of a model
    that has sliding ones (``use_rope`` off)."""

    def __init__(self, config, layer_idx: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__(config, layer_idx, qkv_bias=False, o_bias=False, qk_norm=True, tp=tp)
        types = getattr(config, "layer_types", None)
        self.use_rope = config.sliding_window is None or types is None or types[layer_idx] == "sliding_attention"

    def forward(self, x, cos, sin, kv_pool: torch.Tensor, layer: int, meta: AttentionMetadata) -> torch.Tensor:
        if self.use_rope:
            return super().forward(x, cos, sin, kv_pool, layer, meta)
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.view(T, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(T, self.num_kv_heads, self.head_dim))
        v = v.view(T, self.num_kv_heads, self.head_dim)
        return self.tp.all_reduce(self.o_proj(self.attend(q, k, v, kv_pool, layer, meta)))


class Exaone4ForCausalLM(LlamaForCausalLM):
    """EXAONE 4.0 causal LM over a paged KV cache: Llama's model with EXAONE 4's layers (each layer's
    sliding window follows ``layer_types``, as in Llama's attention)."""

    def decoder_layer(self, config, i: int, qkv_bias: bool, o_bias: bool, tp: TensorParallel) -> nn.Module:
        return Olmo2DecoderLayer(config, i, tp, attn=Exaone4Attention(config, i, tp), norm=RMSNorm)
