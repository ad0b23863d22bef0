"""Mixtral (8x7B, 8x22B): Mistral's decoder with every MLP a mixture of ``num_local_experts`` experts,
two per token (``num_experts_per_tok``), the chosen two's router probabilities renormalized to one.

The checkpoints name the block ``block_sparse_moe`` and an expert's projections ``w1`` (gate), ``w3``
(up) and ``w2`` (down); :meth:`MixtralForCausalLM.checkpoint_name` reads them as the Qwen-MoE names
our :class:`~engine.models.moe.SparseMoE` loads.
"""

from __future__ import annotations

from torch import nn

from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from engine.models.moe import MoEWeights, SparseMoE
from engine.parallel import TensorParallel

_EXPERT_NAMES = {".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}


class MixtralForCausalLM(MoEWeights, LlamaForCausalLM):
    def decoder_layer(self, config, i: int, qkv_bias: bool, o_bias: bool, tp: TensorParallel) -> nn.Module:
        moe = SparseMoE(
            config.hidden_size,
            config.intermediate_size,
            config.num_local_experts,
            config.num_experts_per_tok,
            True,
            config.hidden_act,
            tp,
        )
        return LlamaDecoderLayer(config, i, qkv_bias, o_bias, self.qk_norm, tp, mlp=moe)

    def checkpoint_name(self, name: str) -> str:
        name = super().checkpoint_name(name).replace(".block_sparse_moe.", ".mlp.")
        if ".mlp.experts." in name:
            for ours_from, ours in _EXPERT_NAMES.items():
                name = name.replace(ours_from, ours)
        return name
