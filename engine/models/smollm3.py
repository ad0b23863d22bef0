"""SmolLM3: Llama with *NoPE layers*, layers whose attention uses no position embedding at all.

``config.no_rope_layers[i]`` says whether layer ``i`` rotates its queries and keys (1: RoPE, as
Llama; 0: NoPE, the raw projections attend, positions known only through the causal mask).
Transformers fills the list when a config leaves it out: every ``no_rope_layer_interval``-th layer
(the 4th, 8th, ...) is NoPE. Its keys go into the paged cache unrotated, and a NoPE layer's attention
never reads the RoPE tables.

Sliding windows follow ``layer_types`` (a layer of type ``"sliding_attention"`` attends to the last
``sliding_window`` positions): that is what transformers' eager and SDPA attention do, by their masks.
(Its flash-attention path also asks ``use_sliding_window``; the default ``layer_types`` mark NoPE
layers as sliding only when ``use_sliding_window`` is set, so the two agree on every config that does
not give ``layer_types`` by hand.)

Biases, the MLP, the norms, weight names and tensor-parallel sharding are Llama's.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention import AttentionMetadata
from engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from engine.parallel import SINGLE, TensorParallel


class SmolLM3Attention(LlamaAttention):
    """Llama's attention, leaving RoPE out where ``use_rope`` is off (a NoPE layer)."""

    def __init__(self, config, layer_idx: int, qkv_bias: bool, o_bias: bool, tp: TensorParallel = SINGLE) -> None:
        super().__init__(config, layer_idx, qkv_bias, o_bias, qk_norm=False, tp=tp)
        self.use_rope = bool(config.no_rope_layers[layer_idx])

    def forward(self, x, cos, sin, kv_pool: torch.Tensor, layer: int, meta: AttentionMetadata) -> torch.Tensor:
        if self.use_rope:
            return super().forward(x, cos, sin, kv_pool, layer, meta)
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        return self.tp.all_reduce(self.o_proj(self.attend(q, k, v, kv_pool, layer, meta)))


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """SmolLM3 causal LM over a paged KV cache: Llama's model with SmolLM3's attention in each layer."""

    def __init__(self, config, max_positions: int | None = None, tp: TensorParallel = SINGLE) -> None:
        flags = getattr(config, "no_rope_layers", None)
        if flags is None or len(flags) != config.num_hidden_layers:
            raise ValueError(
                f"SmolLM3 config needs no_rope_layers with one entry per layer ({config.num_hidden_layers}), "
                f"got {flags!r}"
            )
        super().__init__(config, max_positions, tp)

    def decoder_layer(self, config, i: int, qkv_bias: bool, o_bias: bool, tp: TensorParallel) -> nn.Module:
        attn = SmolLM3Attention(config, i, qkv_bias, o_bias, tp)
        return LlamaDecoderLayer(config, i, qkv_bias, o_bias, False, tp, attn=attn)
