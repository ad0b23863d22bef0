"""Mistral 4 (``Mistral4ForCausalLM``: Mistral Small 4, 119B with 128 experts) and the language model of a
``Mistral3ForConditionalGeneration`` checkpoint whose text config is Mistral 4's, served as text.

Mistral 4 is DeepSeek-V3's decoder (engine/models/deepseek_v3.py: latent attention with low-rank
queries, interleaved RoPE with YaRN and its softmax scale, a mixture with an ungated shared expert in
the layers from ``first_k_dense_replace`` on) with two changes:

- *the router* (:class:`SoftmaxGroupedMoE`) takes a softmax over every expert, not a sigmoid, and has
  no expert bias. With ``n_group`` > 1 a group is worth the sum of its two best probabilities (as
  DeepSeek-V3's groups, not DeepSeek-V2's best one) and a token chooses among the experts of its
  ``topk_group`` best groups. The chosen probabilities are renormalized where ``norm_topk_prob`` says
  so and multiplied by ``routed_scaling_factor``. The router's product runs in float32.
- *the queries* are scaled by position after RoPE, Llama 4's attention temperature, as Ministral 3's are
  (engine/models/mistral3.py, ``llama_4_scaling_beta``). Absorbed, the query is its latent part and its
  rotated part: scaling both is scaling the query transformers scales.

Its checkpoints store each layer's experts stacked (:class:`~engine.models.moe.StackedExperts`), as
transformers loads and saves them. Its config gives a head's whole width as ``head_dim``
(``qk_nope_head_dim + qk_rope_head_dim``) and RoPE's part as ``partial_rotary_factor``, which YaRN's
tables (the releases') honour: they are the rotated part's width, as DeepSeek-V3's. A config with
default RoPE is refused (transformers' tables would be the whole head's). The FP8 release's layout
(per-tensor ``weight_scale_inv``, a scale beside each stack of experts) is read: engine/quant/checkpoint.py
and :class:`~engine.models.moe.StackedExperts`.
"""

from __future__ import annotations

import torch

from engine.models.deepseek_v3 import DeepseekV3ForCausalLM, MlaAttention
from engine.models.mistral3 import QueryScaled
from engine.models.moe import SparseMoE, StackedExperts, largest
from engine.models.text_tower import TextTower
from engine.parallel import SINGLE, TensorParallel


class SoftmaxGroupedMoE(SparseMoE):
    """Mistral 4's mixture (the module docstring): a softmax router limited to the best groups by their
    two best probabilities, renormalized and scaled; an ungated shared expert."""

    def __init__(self, config, tp: TensorParallel = SINGLE) -> None:
        E, groups = config.n_routed_experts, config.n_group or 1
        if E % groups or not 0 < (config.topk_group or 1) <= groups:
            raise ValueError(f"n_group ({groups}) must divide n_routed_experts ({E}), topk_group be in 1..n_group")
        super().__init__(
            config.hidden_size, config.moe_intermediate_size, E, config.num_experts_per_tok,
            bool(config.norm_topk_prob), config.hidden_act, tp,
            shared_intermediate=config.moe_intermediate_size * (config.n_shared_experts or 0), shared_gate=False,
        )  # fmt: skip
        self.groups, self.top_groups = groups, config.topk_group or 1
        self.scale = float(config.routed_scaling_factor or 1.0)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        if self.groups > 1:  # (masked to 0, as transformers masks them: no kept expert's probability is 0)
            T, E = probs.shape
            best_two = largest(probs.view(T, self.groups, E // self.groups), 2)[0].sum(dim=-1)  # [T, groups]
            kept = torch.zeros_like(best_two, dtype=torch.bool).scatter_(1, largest(best_two, self.top_groups)[1], True)
            probs = probs.masked_fill(~kept.repeat_interleave(E // self.groups, dim=1), 0.0)
        weights, ids = largest(probs, self.top_k)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * self.scale


class ScaledMlaAttention(MlaAttention):
    """Latent attention whose queries are scaled by position after RoPE; it takes ``cos`` as
    ``(cos, scale)``, ``scale [T, 1, 1]`` (:class:`~engine.models.mistral3.QueryScaled`)."""

    def forward(self, x, cos, sin, kv_pool: torch.Tensor, layer: int, meta) -> torch.Tensor:
        cos, scale = cos
        query, kv = self.project(x, cos, sin)
        return self.attend_latent(query * scale, kv, kv_pool, layer, meta)


class Mistral4ForCausalLM(QueryScaled, StackedExperts, DeepseekV3ForCausalLM):
    """Mistral 4 causal LM over a paged KV cache: DeepSeek-V3's model with Mistral 4's router and scaled
    queries (where the config gives ``llama_4_scaling_beta``)."""

    moe_class = SoftmaxGroupedMoE

    def __init__(self, config, max_positions: int | None = None, tp: TensorParallel = SINGLE) -> None:
        rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
        if rope == "default":  # (transformers' tables would be the whole head's width, not the rotated part's)
            raise ValueError("Mistral 4 with default RoPE is not supported: its releases turn by YaRN (rope_type yarn)")
        super().__init__(config, max_positions, tp)

    def latent_attention(self, config, i: int, tp: TensorParallel) -> MlaAttention:
        return (ScaledMlaAttention if self.scaled else MlaAttention)(config, i, tp)


class Mistral4TextForCausalLM(TextTower, Mistral4ForCausalLM):
    """The language model of a ``Mistral3ForConditionalGeneration`` checkpoint whose text config is Mistral
    4's (Mistral Small 4), served as text only: its Pixtral vision tower and projector are not read."""

    architecture = "Mistral3ForConditionalGeneration"
