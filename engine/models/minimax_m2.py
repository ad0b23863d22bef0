"""MiniMax-M2, M2.1 and M2.5 (``MiniMaxM2ForCausalLM``, 230B with 10B active): a decoder of full
attention layers, every MLP a mixture of 256 experts, 8 per token.

What differs from the families it borrows from:

- *attention* (as Mistral's, grouped keys and values, no biases): q and k are RMS-normalized over their
  whole projections, ``heads * head_dim`` wide (OLMo 2's attention and norm,
  :class:`~engine.models.olmo2.Olmo2Attention`, the norm rounding to the model's dtype before scaling as
  Llama's norms do), then RoPE turns the first ``rotary_dim`` dimensions of each head (64 of 128:
  Phi-3's partial rotate-half, :func:`~engine.models.phi3.apply_partial_rope`; the released configs say
  ``rotary_dim``, which transformers reads as ``partial_rotary_factor``).
- *the router* is GLM-4.5's and DeepSeek-V3's without groups (:func:`~engine.models.glm4_moe.sigmoid_route`):
  the sigmoid of each expert's logit, the chosen 8 picked by score plus the learned
  ``e_score_correction_bias``, weighted by their scores divided by their sum. No shared expert, no
  scaling factor. The router stays float32, as vLLM keeps it (transformers' MiniMax-M2 routes in the
  model's dtype, so in bfloat16 a near tie between experts may go the other way there).
- *the checkpoints* keep Mixtral's names (``block_sparse_moe``, ``w1`` / ``w3`` / ``w2``), the expert
  bias beside the router (``block_sparse_moe.e_score_correction_bias``); the released ones are FP8
  with 128 x 128 block scales, which engine/quant/checkpoint.py reads (not run here on a released
  checkpoint). Multi-token-prediction modules past the decoder's layers, where a checkpoint carries
  them, are not read.

The earlier MiniMax-Text-01 and M1 (``MiniMaxForCausalLM``) mix in linear "lightning" attention and
are not this class: a config whose ``attn_type_list`` names a layer other than full attention, or
whose router or q/k norm is not the one above, is refused with the field named.

Tensor parallelism splits the heads (each rank's slice of the q/k norms' mean square all-reduced, as
OLMo 2's) and each expert's inner dimension (engine/models/moe.py); the router is replicated.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from engine.models.glm4_moe import GroupedSigmoidMoE, beyond_decoder
from engine.models.llama import LlamaDecoderLayer
from engine.models.mixtral import MixtralForCausalLM
from engine.models.olmo2 import Olmo2Attention, Olmo2RMSNorm, WholeProjectionNorms
from engine.models.phi3 import PartialRotaryTables, apply_partial_rope, check_rotary_dim
from engine.parallel import SINGLE, TensorParallel


class MiniMaxM2Norm(Olmo2RMSNorm):
    """The q/k norm over a whole projection, rounded before it is scaled (transformers' MiniMax-M2)."""

    round_first = True


class MiniMaxM2Attention(Olmo2Attention):
    """OLMo 2's attention (q and k RMS-normalized over their whole projections; no biases in MiniMax-M2's
    configs) with its norms' rounding and partial RoPE."""

    norm = MiniMaxM2Norm
    biased = False

    def turn(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_partial_rope(x, cos, sin)


def check_minimax_m2(config) -> None:
    """Refuse a config that asks for what this class does not compute, naming the field."""
    refused = []
    if any(t != 1 for t in getattr(config, "attn_type_list", None) or []):
        refused.append("attn_type_list (linear 'lightning' attention layers: MiniMax-Text-01 and M1)")
    if getattr(config, "scoring_func", "sigmoid") != "sigmoid":
        refused.append(f"scoring_func {config.scoring_func!r} (the router here is the sigmoid's)")
    if getattr(config, "use_routing_bias", True) is False:
        refused.append("use_routing_bias false (the router here adds e_score_correction_bias)")
    if getattr(config, "use_qk_norm", True) is False or getattr(config, "qk_norm_type", "per_layer") != "per_layer":
        refused.append("use_qk_norm / qk_norm_type (the q/k norm here is over the whole projection: 'per_layer')")
    if getattr(config, "shared_intermediate_size", 0):
        refused.append("shared_intermediate_size (a shared expert)")
    if refused:
        raise ValueError("MiniMaxM2ForCausalLM does not run this config's " + "; ".join(refused))


def moe_shape(config) -> SimpleNamespace:
    """The config in the terms :class:`~engine.models.glm4_moe.GroupedSigmoidMoE` reads."""
    return SimpleNamespace(
        hidden_size=config.hidden_size,
        moe_intermediate_size=config.intermediate_size,
        n_routed_experts=config.num_local_experts,
        num_experts_per_tok=config.num_experts_per_tok,
        norm_topk_prob=True,
        hidden_act=config.hidden_act,
    )


class MiniMaxM2ForCausalLM(WholeProjectionNorms, PartialRotaryTables, MixtralForCausalLM):
    def __init__(self, config, max_positions: int | None = None, tp: TensorParallel = SINGLE) -> None:
        check_minimax_m2(config)
        check_rotary_dim(config, "MiniMax-M2")
        super().__init__(config, max_positions, tp)

    def decoder_layer(self, config, i: int, qkv_bias: bool, o_bias: bool, tp: TensorParallel) -> nn.Module:
        attn = MiniMaxM2Attention(config, i, tp)
        return LlamaDecoderLayer(
            config, i, False, False, False, tp, mlp=GroupedSigmoidMoE(moe_shape(config), tp), attn=attn
        )

    @staticmethod
    def attention_biases(config) -> tuple[bool, bool]:
        return False, False

    def checkpoint_skips(self, name: str) -> bool:
        """Multi-token-prediction modules: past the decoder's layers, or under an ``mtp`` prefix."""
        return beyond_decoder(name, self.config.num_hidden_layers) or name.removeprefix("model.").startswith("mtp")

    def checkpoint_name(self, name: str) -> str:
        """Mixtral's names, and the expert bias (``block_sparse_moe.e_score_correction_bias``, which
        transformers calls ``mlp.e_score_correction_bias``) on the router that holds it here."""
        return (
            super().checkpoint_name(name).replace(".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias")
        )
