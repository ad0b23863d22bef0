"""DeepSeek-V3's architecture (``DeepseekV3ForCausalLM``: DeepSeek-V3, R1, V3.1; Kimi K2.5's language
model, ``KimiK25ForConditionalGeneration`` served as text; Kimi K2's checkpoints name it too, but their
configs need code of their own) and GLM-4.7-Flash
(``Glm4MoeLiteForCausalLM``): multi-head latent attention (MLA) over GLM-4.5's mixture of experts; and
DeepSeek-V2's (``DeepseekV2ForCausalLM``: V2, V2-Lite, Coder-V2), the same attention over a softmax
router limited to the best groups (:class:`GroupLimitedMoE`).

The mixture is :class:`~engine.models.glm4_moe.GroupedSigmoidMoE` (sigmoid scores, an expert bias that
picks, expert groups, a scaled renormalized weight, an ungated shared expert), in every layer from
``first_k_dense_replace`` on (GLM-4.7-Flash: where ``mlp_layer_types`` says ``sparse``). What this file
adds is the attention:

- *queries*: ``q_proj``, or a low-rank pair ``q_b_proj(norm(q_a_proj(x)))`` where ``q_lora_rank`` is
  set; each head's query is ``qk_nope_head_dim`` dimensions without position and ``qk_rope_head_dim``
  rotated ones.
- *keys and values* come from one latent per token, ``c = norm(kv_a_proj_with_mqa(x)[:kv_lora_rank])``,
  and one rotated key part ``k_rot`` shared by every head (the rest of that projection). ``kv_b_proj``
  expands ``c`` into each head's unrotated key and its value.
- *the cache holds the latent, not the heads' keys and values*: the expansion is absorbed into the
  queries and the output. Head ``h``'s score against token ``t`` is
  ``q_nope . (W_UK[h] c_t) + q_rot . k_rot_t = (W_UK[h]^T q_nope) . c_t + q_rot . k_rot_t``, and its
  output ``sum_t a_t W_UV[h] c_t = W_UV[h] (sum_t a_t c_t)``. So attention is multi-query attention
  with one key/value "head" ``[c; k_rot]`` (``kv_lora_rank + qk_rope_head_dim`` wide: 576 for
  DeepSeek-V3) read by every query head: the paged pool, its kernels and its prefix cache serve it
  unchanged, at 1/57 of DeepSeek-V3's per-head keys and values (the pool stores the latent as both K
  and V: twice the latent's own size, which one kernel reading K for V would halve).
- *RoPE* on the rotated part only, in DeepSeek's interleaved pair layout (``rope_interleave``), with
  YaRN scaling where the config has it; the softmax scale is ``qk_head_dim ** -0.5``, times
  ``mscale(factor, mscale_all_dim) ** 2`` under YaRN (as transformers and the released code scale it).

The checkpoints carry a multi-token-prediction layer past the decoder's, read only by
``--speculative-method nextn``. Tensor parallelism splits the heads (``q_b_proj``/``q_proj`` and
``kv_b_proj`` by rows, ``o_proj`` by columns); the latent projections and every rank's cache of the
latent are whole. Under the batch-invariant mode the absorbed products run head by head on
``augur::invariant_linear``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.attention import AttentionMetadata, paged_attention
from engine.models.glm4_moe import DeepseekLayout, GroupedSigmoidMoE
from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM, RMSNorm, apply_rope
from engine.models.moe import MoEWeights, SparseMoE, largest
from engine.models.text_tower import TextTower
from engine.parallel import SINGLE, TensorParallel

LATENT_EPS = 1e-6  # the latents' norms' epsilon in the released code and transformers (not rms_norm_eps)


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def mla_scale(config) -> float:
    """The softmax scale: ``qk_head_dim ** -0.5``, times ``mscale ** 2`` under YaRN's ``mscale_all_dim``."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = getattr(config, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
        m = yarn_mscale(params["factor"], params["mscale_all_dim"])
        scale *= m * m
    return scale


class Expansion(nn.Module):
    """``kv_b_proj``'s weight ``[heads x (qk_nope + v), kv_lora_rank]``, this rank's heads: not an
    ``nn.Linear``, since it is only ever applied absorbed (no packing or quantization takes it)."""

    def __init__(self, rows: int, rank: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, rank))


class MlaAttention(nn.Module):
    """Multi-head latent attention, absorbed (the module docstring): the pool's one KV "head" per token
    is ``[c; k_rot]``."""

    invariant = False  # (LlamaForCausalLM.use_invariant_ops sets it)
    # The Triton paged kernel's tiles do not fit one 576-wide KV head read by up to 128 query heads (its
    # shared memory at DeepSeek-V3's shape is past an H200's): on a GPU the runner takes the sdpa backend.
    triton_paged = False

    def __init__(self, config, layer_idx: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        h, bias = config.hidden_size, bool(getattr(config, "attention_bias", False))
        self.nope, self.rot, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.rank = config.kv_lora_rank
        self.num_heads = tp.split(config.num_attention_heads, "attention heads")  # this rank's
        q_rows = self.num_heads * (self.nope + self.rot)
        if config.q_lora_rank:
            self.q_a_proj = nn.Linear(h, config.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, LATENT_EPS)
            self.q_b_proj = nn.Linear(config.q_lora_rank, q_rows, bias=False)
        else:
            self.q_proj = nn.Linear(h, q_rows, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.rank + self.rot, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_EPS)
        self.kv_b_proj = Expansion(self.num_heads * (self.nope + self.v_dim), self.rank)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, h, bias=bias)
        self.interleaved = bool(getattr(config, "rope_interleave", True))
        self.scale = mla_scale(config)
        # The pool's shape and what the runner reads off an attention layer
        self.head_dim = self.rank + self.rot
        self.num_kv_heads, self.first_kv_head, self.total_kv_heads = 1, 0, 1  # (whole on every rank)
        self.q_size = self.num_heads * self.v_dim  # this rank's attention output, o_proj's input
        self.sliding, self.softcap, self.sinks = False, 0.0, None
        self.register_buffer("kv_scales", None, persistent=False)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on ``x [T, heads, rot]``; interleaved pairs are first laid out as two halves (queries and
        keys alike, so their products are unchanged)."""
        if self.interleaved:
            x = x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
        return apply_rope(x, cos, sin)

    def absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_UK [heads, qk_nope, rank]`` and ``W_UV [heads, v, rank]``, views of ``kv_b_proj``."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.rank)
        return w[:, : self.nope], w[:, self.nope :]

    def forward(self, x, cos, sin, kv_pool: torch.Tensor, layer: int, meta: AttentionMetadata) -> torch.Tensor:
        return self.attend_latent(*self.project(x, cos, sin), kv_pool, layer, meta)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(``query [T, heads, rank + rot]``, the absorbed queries; ``kv [T, 1, rank + rot]``, each token's
        latent, its key and its value) of ``x``."""
        T = x.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if hasattr(self, "q_b_proj") else self.q_proj(x)
        q_nope, q_rot = q.view(T, self.num_heads, -1).split([self.nope, self.rot], -1)
        c, k_rot = self.kv_a_proj_with_mqa(x).split([self.rank, self.rot], -1)
        latent = torch.cat([self.kv_a_layernorm(c), self.rope(k_rot.unsqueeze(1), cos, sin).squeeze(1)], -1)
        w_uk = self.absorbed()[0]
        q_lat = self._per_head(q_nope, self.w_uk_t) if self.invariant else torch.einsum("thn,hnr->thr", q_nope, w_uk)
        return torch.cat([q_lat, self.rope(q_rot, cos, sin)], -1), latent.unsqueeze(1)

    def attend_latent(self, query: torch.Tensor, kv: torch.Tensor, kv_pool: torch.Tensor, layer: int,
                      meta: AttentionMetadata) -> torch.Tensor:  # fmt: skip
        """The attention of :meth:`project`'s queries over the cached latents, expanded and projected out."""
        T = query.shape[0]
        out = paged_attention(query, kv, kv, kv_pool, layer, meta, self.scale, kv_scales=self.kv_scales).view(
            T, self.num_heads, self.head_dim
        )[..., : self.rank]
        w_uv = self.absorbed()[1]
        o = self._per_head(out, w_uv) if self.invariant else torch.einsum("thr,hvr->thv", out, w_uv)
        return self.tp.all_reduce(self.o_proj(o.reshape(T, -1)))

    @staticmethod
    def _per_head(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``x [T, heads, K] -> [T, heads, N]`` by ``w [heads, N, K]``, one head at a time on the
        batch-invariant product (a row's sums in the same order at any T)."""
        heads = [torch.ops.augur.invariant_linear(x[:, i].contiguous(), w[i], None) for i in range(len(w))]
        return torch.stack(heads, 1)

    def keep_absorbed(self) -> None:
        """For :meth:`_per_head`, once the weights have loaded: ``W_UK`` transposed, each head's
        contiguous (``W_UV``'s heads are already), so that no forward copies them."""
        self.register_buffer("w_uk_t", self.absorbed()[0].transpose(1, 2).contiguous(), persistent=False)

    def set_kv_scale(self, which: str, scale: torch.Tensor) -> None:
        """A checkpoint's FP8 KV-cache scale. The pool holds the one latent ``[c; k_rot]`` as both K and V,
        where a checkpoint calibrated on transformers' cache scales ``c`` by its K scale and ``k_rot`` by
        its V scale: both copies take the larger, so that neither part saturates."""
        scale = scale.detach().float().flatten()
        if scale.numel() != 1:
            raise ValueError(f"a {which} scale of the latent KV cache has {scale.numel()} values: one expected")
        if self.kv_scales is None:
            self.kv_scales = scale.expand(2, 1).clone()
        self.kv_scales = torch.maximum(self.kv_scales, scale)

    def checkpoint_slice(self, name: str, r: int) -> tuple[int, int, int] | str | None:
        """What of this attention's checkpoint tensor ``name`` (after ``self_attn.``) rank ``r`` holds."""
        if name in ("q_proj.weight", "q_b_proj.weight", "kv_b_proj.weight"):
            rows = self.get_submodule(name.removesuffix(".weight")).weight.shape[0]
            return 0, r * rows, rows
        if name == "o_proj.weight":
            return 1, r * self.q_size, self.q_size
        if name == "o_proj.bias":
            return None if r == 0 else "zeros"
        return None  # the latent's projections and norms: whole


class DeepseekV3ForCausalLM(DeepseekLayout, MoEWeights, LlamaForCausalLM):
    _fused = {".gate_proj.": (".gate_up_proj.", 0), ".up_proj.": (".gate_up_proj.", 1)}  # (q_proj is no q/k/v piece)

    moe_class: type[SparseMoE] = GroupedSigmoidMoE  # the mixture of the sparse layers

    def decoder_layer(self, config, i: int, qkv_bias: bool, o_bias: bool, tp: TensorParallel) -> nn.Module:
        moe = self.moe_class(config, tp) if self.sparse(config, i) else None
        return LlamaDecoderLayer(config, i, False, False, False, tp, mlp=moe, attn=self.latent_attention(config, i, tp))

    def latent_attention(self, config, i: int, tp: TensorParallel) -> MlaAttention:
        """Layer ``i``'s attention (Mistral 4 scales its queries)."""
        return MlaAttention(config, i, tp)

    def use_invariant_ops(self) -> None:
        super().use_invariant_ops()
        for module in self.modules():
            if isinstance(module, MlaAttention):
                module.keep_absorbed()

    @staticmethod
    def sparse(config, i: int) -> bool:
        kinds = getattr(config, "mlp_layer_types", None)
        if kinds:  # (a prediction layer past them, served by nextn, is a mixture)
            return i >= len(kinds) or kinds[i] == "sparse"
        return i >= (getattr(config, "first_k_dense_replace", 0) or 0)

    def checkpoint_slice(self, name: str) -> tuple[int, int, int] | str | None:
        if self.tp.size == 1:
            return None
        layer, sep, rest = self.checkpoint_name(name).partition(".self_attn.")
        if sep:
            return self.get_submodule(layer).self_attn.checkpoint_slice(rest, self.tp.rank)
        return super().checkpoint_slice(name)


class Glm4MoeLiteForCausalLM(DeepseekV3ForCausalLM):
    """GLM-4.7-Flash: DeepSeek-V3's architecture (its mixture layers where ``mlp_layer_types`` says)."""


class KimiK25TextForCausalLM(TextTower, DeepseekV3ForCausalLM):
    """The language model of a Kimi K2.5 checkpoint (``KimiK25ForConditionalGeneration``; transformers
    names its class ``Kimi_K25ForConditionalGeneration``), DeepSeek-V3's architecture, served as text
    only: its MoonViT vision tower and its projector (``mm_projector``) are not read. Transformers 5 saves
    the decoder's layers as ``language_model.model.blocks.N`` (its renaming of the vision tower's blocks
    runs backwards over every name); the released checkpoints' ``layers`` are read, and ``blocks`` too."""

    architecture = "KimiK25ForConditionalGeneration"
    _skipped_prefixes = (*TextTower._skipped_prefixes, "mm_projector.", "model.mm_projector.")

    def text_name(self, name: str) -> str | None:
        text = super().text_name(name)
        return text.replace("model.blocks.", "model.layers.", 1) if text and text.startswith("model.blocks.") else text


class GroupLimitedMoE(SparseMoE):
    """DeepSeek-V2's mixture: the softmax over every expert, its ``k`` largest (under
    ``topk_method: group_limited_greedy`` only among the experts of the ``topk_group`` groups whose best
    expert scores highest), not renormalized, times ``routed_scaling_factor``; an ungated shared expert."""

    def __init__(self, config, tp: TensorParallel = SINGLE) -> None:
        E = config.n_routed_experts
        super().__init__(
            config.hidden_size, config.moe_intermediate_size, E, config.num_experts_per_tok, False, config.hidden_act,
            tp, shared_intermediate=config.moe_intermediate_size * (config.n_shared_experts or 0), shared_gate=False,
        )  # fmt: skip
        method = getattr(config, "topk_method", "greedy") or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"DeepSeek-V2's topk_method {method!r} is not supported (greedy, group_limited_greedy)")
        self.groups = (config.n_group or 1) if method == "group_limited_greedy" else 1
        if E % self.groups or not 0 < (config.topk_group or 1) <= self.groups:
            raise ValueError(f"n_group ({self.groups}) must divide n_routed_experts ({E}), topk_group be in 1..n_group")
        self.top_groups = config.topk_group or 1
        self.scale = float(config.routed_scaling_factor or 1.0)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        if self.groups > 1:  # (masked to 0, as the released code masks them: no kept expert scores 0)
            best = probs.view(-1, self.groups, self.num_experts // self.groups).amax(-1)
            kept = torch.zeros_like(best, dtype=torch.bool).scatter_(1, largest(best, self.top_groups)[1], True)
            probs = probs.masked_fill(~kept.repeat_interleave(self.num_experts // self.groups, dim=1), 0.0)
        weights, ids = largest(probs, self.top_k)
        return ids, weights * self.scale


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V2 and V2-Lite (and DeepSeek-Coder-V2): latent attention (V2-Lite's queries full-rank)
    over :class:`GroupLimitedMoE`."""

    moe_class = GroupLimitedMoE
