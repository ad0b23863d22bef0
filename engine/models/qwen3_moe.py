"""Qwen's mixture-of-experts models: Qwen3-MoE (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B, Qwen3-235B-A22B)
and Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B).

Each is its dense sibling's decoder (Qwen3: q/k normalized per head; Qwen2: biases on q/k/v) with the
MLP of the *sparse* layers replaced by a :class:`~engine.models.moe.SparseMoE` block: a layer is
sparse unless listed in ``mlp_only_layers``, every ``decoder_sparse_step``-th layer (1: all of them).
Qwen2-MoE's blocks also carry a shared expert (``shared_expert_intermediate_size``).
"""

from __future__ import annotations

from torch import nn

from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from engine.models.moe import MoEWeights, SparseMoE, is_sparse_layer
from engine.parallel import TensorParallel


class Qwen3MoeForCausalLM(MoEWeights, LlamaForCausalLM):
    qk_norm = True
    shared_expert = False

    def decoder_layer(self, config, i: int, qkv_bias: bool, o_bias: bool, tp: TensorParallel) -> nn.Module:
        moe = None
        if is_sparse_layer(config, i):
            moe = SparseMoE(
                config.hidden_size,
                config.moe_intermediate_size,
                config.num_experts,
                config.num_experts_per_tok,
                bool(getattr(config, "norm_topk_prob", False)),
                config.hidden_act,
                tp,
                shared_intermediate=config.shared_expert_intermediate_size if self.shared_expert else 0,
            )
        return LlamaDecoderLayer(config, i, qkv_bias, o_bias, self.qk_norm, tp, mlp=moe)


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    qk_norm = False
    shared_expert = True

    @staticmethod
    def attention_biases(config) -> tuple[bool, bool]:
        return bool(getattr(config, "qkv_bias", True)), False
