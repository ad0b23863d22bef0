"""GLM-4.5, GLM-4.6 and GLM-4.7 (``Glm4MoeForCausalLM``: GLM-4.5-Air's 106B-A12B, GLM-4.5's and
GLM-4.6's 355B-A32B): a Llama-shaped decoder whose MLPs past the first ``first_k_dense_replace``
layers are mixtures of experts routed as DeepSeek-V3 routes them.

What differs from the other mixtures (engine/models/moe.py):

- *the router* scores each expert by the sigmoid of its logit, not a softmax over all of them. Which
  experts a token reads is decided by the scores plus a learned per-expert bias
  (``e_score_correction_bias``, the load balancing the model was trained with), the weights are the
  scores alone: the chosen ones' scores, divided by their sum (``norm_topk_prob``) and multiplied by
  ``routed_scaling_factor``. With ``n_group`` > 1 the experts are in groups, a group's worth the sum
  of its two best biased scores, and a token chooses only among the experts of its ``topk_group``
  best groups. The router's weight and bias stay float32 whatever the model's dtype, as transformers
  and vLLM keep them: its scores are compared to the third decimal to pick 8 of 128 or 160 experts.
- *a shared expert* every token goes through, ``n_shared_experts`` times the routed experts' inner
  size, added without a gate.
- *attention*: q/k/v biases (``attention_bias``), q/k norms per head where ``use_qk_norm`` says so,
  and RoPE on half of each head (``partial_rotary_factor``, rotate-half within those dimensions).
- the checkpoints carry a multi-token-prediction layer past the decoder
  (``model.layers.{num_hidden_layers}...``, ``num_nextn_predict_layers`` of them), which the model's
  forward never runs; it is not read here (``checkpoint_skips``), but as a drafter of its own
  (engine/speculative/methods/nextn.py).

Tensor parallelism splits each expert and the shared expert like a dense MLP; the router is
replicated, so every rank routes alike (engine/models/moe.py).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from engine.models.moe import MoEWeights, SparseMoE, largest
from engine.models.phi3 import PartialRotaryAttention, PartialRotaryTables, check_rotary_dim
from engine.parallel import SINGLE, TensorParallel

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def sigmoid_route(
    logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    groups: int,
    top_groups: int,
    renormalize: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] float32 → (ids [T, k] int64, weights [T, k] float32), the module docstring's
    routing. Ties go to the lower-numbered expert or group (:func:`~engine.models.moe.largest`); every
    operation is per token, so a token routes alike in any batch."""
    scores = torch.sigmoid(logits)
    choice = scores + bias
    if groups > 1:
        T, E = choice.shape
        best_two = largest(choice.view(T, groups, E // groups), 2)[0].sum(dim=-1)  # [T, groups]
        kept = torch.zeros_like(best_two, dtype=torch.bool).scatter_(1, largest(best_two, top_groups)[1], True)
        choice = choice.masked_fill(~kept.repeat_interleave(E // groups, dim=1), float("-inf"))
    ids = largest(choice, top_k)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * scale


def beyond_decoder(name: str, layers: int) -> bool:
    """Whether checkpoint tensor ``name`` is of a layer past the decoder's ``layers`` (a
    multi-token-prediction layer, which the model's forward never runs)."""
    m = _LAYER.match(name)
    return m is not None and int(m.group(1)) >= layers


class SigmoidRouter(nn.Module):
    """The router's product and its expert bias, float32 (``weight`` [E, H], ``e_score_correction_bias``
    [E]: the checkpoint's names under ``mlp.gate``). Not an ``nn.Linear``, so that no packing or
    quantization of the linear layers takes it; under the batch-invariant mode its product runs on
    ``augur::invariant_linear``."""

    invariant = False  # (LlamaForCausalLM.use_invariant_ops sets it)

    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32))

    def _apply(self, fn, recurse: bool = True):
        """A move keeps float32: the model's cast to its dtype happens before the weights load, which
        then arrive in the checkpoint's float32."""
        super()._apply(fn, recurse)
        for p in self.parameters():
            p.data = p.data.float()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(-1, x.shape[-1]).float()
        if self.invariant:
            return torch.ops.augur.invariant_linear(x, self.weight, None)
        return torch.nn.functional.linear(x, self.weight)


class GroupedSigmoidMoE(SparseMoE):
    """A :class:`~engine.models.moe.SparseMoE` routed by :func:`sigmoid_route`, with an ungated shared
    expert."""

    def __init__(self, config, tp: TensorParallel = SINGLE) -> None:
        E, groups = config.n_routed_experts, getattr(config, "n_group", 1) or 1
        if E % groups or not 0 < (getattr(config, "topk_group", 1) or 1) <= groups:
            raise ValueError(f"n_group ({groups}) must divide n_routed_experts ({E}), topk_group be in 1..n_group")
        super().__init__(
            config.hidden_size,
            config.moe_intermediate_size,
            E,
            config.num_experts_per_tok,
            bool(getattr(config, "norm_topk_prob", True)),
            config.hidden_act,
            tp,
            shared_intermediate=config.moe_intermediate_size * (getattr(config, "n_shared_experts", 0) or 0),
            shared_gate=False,
        )
        self.gate = SigmoidRouter(config.hidden_size, E)
        self.groups, self.top_groups = groups, getattr(config, "topk_group", 1) or 1
        self.scale = float(getattr(config, "routed_scaling_factor", 1.0) or 1.0)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.gate(x)
        bias = self.gate.e_score_correction_bias
        return sigmoid_route(logits, bias, self.top_k, self.groups, self.top_groups, self.norm_topk_prob, self.scale)


class DeepseekLayout:
    """The checkpoint layout DeepSeek-V3 set and GLM-4.5 and its kin keep, mixed into a model class:
    the multi-token-prediction layers past the decoder's are not the model's, and the shared expert is
    ``mlp.shared_experts``."""

    def checkpoint_skips(self, name: str) -> bool:
        """The multi-token-prediction layers past the decoder's (see the module docstring)."""
        return beyond_decoder(name, self.config.num_hidden_layers)

    def checkpoint_name(self, name: str) -> str:
        return super().checkpoint_name(name).replace(".mlp.shared_experts.", ".mlp.shared_expert.")


class Glm4MoeForCausalLM(DeepseekLayout, MoEWeights, PartialRotaryTables, LlamaForCausalLM):
    def __init__(self, config, max_positions: int | None = None, tp: TensorParallel = SINGLE) -> None:
        check_rotary_dim(config, "GLM-4.5")
        super().__init__(config, max_positions, tp)

    def decoder_layer(self, config, i: int, qkv_bias: bool, o_bias: bool, tp: TensorParallel) -> nn.Module:
        attn = PartialRotaryAttention(
            config, i, tp, qkv_bias=qkv_bias, qk_norm=bool(getattr(config, "use_qk_norm", False))
        )
        moe = GroupedSigmoidMoE(config, tp) if i >= (getattr(config, "first_k_dense_replace", 0) or 0) else None
        return LlamaDecoderLayer(config, i, qkv_bias, o_bias, False, tp, mlp=moe, attn=attn)

    @staticmethod
    def attention_biases(config) -> tuple[bool, bool]:
        return bool(getattr(config, "attention_bias", False)), False  # (o_proj has none)
