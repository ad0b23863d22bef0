"""Gemma 4: Gemma 3's local : global decoder grown in four directions, on the same flattened batch and
paged KV cache.

What differs from ``engine.models.gemma3``:
- *two attention shapes*: global (full-attention) layers have their own head dim (``global_head_dim``,
  512 in the releases, against 256 for the local ones), and where ``attention_k_eq_v`` is set their
  own, fewer KV heads (``num_global_key_value_heads``) and no value projection: the values are the
  key projection's output, before the key's norm and RoPE. transformers resolves each layer's shape in
  ``config.per_layer_config``; this reads it there;
- global layers turn only a quarter of each head (*proportional* RoPE: the other frequencies are zero,
  so those dims pass unturned) with a base of 1 000 000; local ones all of it with 10 000;
- q and k are RMS-normalized per head (scale ``weight``, not Gemma's ``1 + weight``) and so are the
  values (no scale); scores are not scaled (the norms fix q's and k's size);
- *KV sharing* (the small "E" models: ``num_kv_shared_layers``): the last layers compute no K/V of
  their own and attend to the K/V of the last earlier layer of their type (the *producer*);
- *per-layer embeddings* (PLE, the "E" models: ``hidden_size_per_layer_input``): a second table gives
  each token a small vector per layer, mixed with a projection of the token's embedding; each layer
  gates its output with its vector and adds the result to the residual;
- a *mixture of experts* beside the dense MLP (the 26B-A4B: ``enable_moe_block``): the router reads the
  residual (normalized without scale, times a learned scale and ``hidden ** -0.5``), picks the top k
  of its softmax, renormalizes and weighs each expert by a learned ``per_expert_scale``; the experts
  read the residual under a norm of their own; both outputs are normalized and summed;
- every layer's output is multiplied by a learned ``layer_scalar``; KV-shared layers may have an MLP of
  twice the inner size (``use_double_wide_mlp``).

**The KV pool.** Augur's pool is one tensor ``[layers, K/V, slots, KV heads, head dim]``. Gemma 4's
layers differ in KV heads and head dim, so the pool holds a row for each layer that makes K/V (none
for shared layers: a shared layer reads its producer's row) and each slot holds the widest layer's K/V
(``kv_width`` = KV heads x head dim). A layer reads its row as heads of its own head dim
(``kv_pool.view(..., kv_width // head_dim, head_dim)``: the same memory, contiguous), its K/V heads
repeated to fill them (each query head then reads a copy of the KV head it would have read: the same
attention). On the releases a slot is the local layers' K/V (31B: 16 x 256; the global layers' 4 x 512
fill it twice) or the global layers' (E2B: 512 wide; the local layers' 256 fill it twice): the
repetition costs those layers up to twice the KV memory and reads of a tighter layout.

A shared layer hands its producer's K/V (as the producer wrote them in this forward) to the attention,
which writes them again into the producer's row (the same values at the same slots) and attends. A
layer-skipping draft that skips a producer's attention skips its sharers' too.

Two classes: :class:`Gemma4ForCausalLM` (text checkpoints) and :class:`Gemma4TextForCausalLM`, the
language model of a ``Gemma4ForConditionalGeneration`` checkpoint served as text only (the vision and
audio towers and their embedders are skipped). Bidirectional configs (``use_bidirectional_attention:
all``) are refused.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from types import SimpleNamespace

import torch
from torch import nn

from engine.attention import paged_attention
from engine.models.gemma2 import Gemma2ForCausalLM, ScaledEmbedding
from engine.models.invariant import activation
from engine.models.layer_rope import GLOBAL, LOCAL, LayerTypeRope, check_layer_types, rope_tables
from engine.models.llama import LlamaAttention, LlamaMLP, RMSNorm, apply_rope, layer_slice
from engine.models.moe import MoEWeights, SparseMoE, StackedExperts, moe_route
from engine.models.text_tower import TextTower
from engine.parallel import SINGLE, TensorParallel

_LAYER = re.compile(r"^layers\.(\d+)\.")
_SHARED_KV = re.compile(r"\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.")  # what a sharing layer does not read


class Gemma4RMSNorm(RMSNorm):
    """RMSNorm computed and scaled in float32, rounded once (transformers' Gemma 4 norm: scale
    ``weight``, not Gemma's ``1 + weight``). ``scaled=False``: no weight (the values' norm, the
    router's): a scale of one."""

    def __init__(self, dim: int, eps: float, scaled: bool = True) -> None:
        super().__init__(dim, eps)
        self.scaled = scaled
        if not scaled:
            del self.weight  # (no buffer of ones either: a model built on the meta device would lose it)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalized in float32 (on the batch-invariant or the fused operator where the model runs on
        # them, with a unit scale), then scaled in float32 and rounded once: transformers' order, where
        # those operators would round before they scale.
        xf = x.float()
        if self.invariant:
            y = torch.ops.augur.invariant_rms_norm(xf, xf.new_ones(x.shape[-1]), self.eps, False)
        elif self.fused:
            y = torch.ops.augur.fused_rms_norm(xf, xf.new_ones(x.shape[-1]), self.eps, False)
        else:
            y = torch.nn.functional.rms_norm(xf, (x.shape[-1],), eps=self.eps)
        return (y * self.weight.float()).to(x.dtype) if self.scaled else y.to(x.dtype)


class Gemma4Attention(LlamaAttention):
    """One layer's attention in its own shape (``config.per_layer_config``); see the module docstring
    for the pool's layout (``kv_row``, ``kv_repeat``) and sharing (``shares`` / ``stores``)."""

    def __init__(self, config, layer_idx: int, tp: TensorParallel = SINGLE) -> None:
        own = config.per_layer_config[layer_idx]
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(own, layer_idx, qkv_bias=bias, o_bias=bias, qk_norm=False, tp=tp)
        mode = config.kv_sharing_modes[layer_idx]
        self.layer_type = config.layer_types[layer_idx]
        self.shares = mode == "reuse"  # attends to its producer's K/V, computes none
        self.stores = mode == "store"  # a producer: hands its K/V to the layers sharing them
        self.k_is_v = bool(config.attention_k_eq_v) and self.layer_type == GLOBAL  # (the checkpoint has no v_proj)
        self.scale = 1.0
        eps = config.rms_norm_eps
        self.q_norm = Gemma4RMSNorm(self.head_dim, eps)
        if self.shares:  # q only
            self.qkv_proj = nn.Linear(config.hidden_size, self.q_size, bias=bias)
            self.k_norm = None
        else:
            self.k_norm = Gemma4RMSNorm(self.head_dim, eps)
        self.v_norm = Gemma4RMSNorm(self.head_dim, eps, scaled=False)
        self.kv_row = layer_idx  # the pool row it reads and writes (set by the model)
        self.kv_repeat = 1  # copies of each KV head in the pool's view of its row (set by the model)

    def forward(self, x, cos, sin, kv_pool: torch.Tensor, layer: int, meta, shared: dict) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        q = self.q_norm(qkv[:, : self.q_size].view(T, self.num_heads, self.head_dim))
        q = apply_rope(q, cos, sin)
        if self.shares:
            k, v, kv_scales = shared[self.layer_type]
        else:
            k, v = qkv[:, self.q_size :].view(T, 2 * self.num_kv_heads, self.head_dim).chunk(2, dim=1)
            k, v = apply_rope(self.k_norm(k), cos, sin), self.v_norm(v)
            kv_scales = self.kv_scales
            if self.kv_repeat > 1:
                k, v = k.repeat_interleave(self.kv_repeat, 1), v.repeat_interleave(self.kv_repeat, 1)
                kv_scales = None if kv_scales is None else kv_scales.repeat_interleave(self.kv_repeat, 1)
            if self.stores:
                shared[self.layer_type] = k, v, kv_scales
        pool = kv_pool
        if kv_pool.shape[-1] != self.head_dim:  # the row read in heads of this layer's head dim
            pool = kv_pool.view(*kv_pool.shape[:3], -1, self.head_dim)
        out = paged_attention(q, k, v, pool, self.kv_row, meta, self.scale, sliding=self.sliding, kv_scales=kv_scales)
        return self.tp.all_reduce(self.o_proj(out))


class Gemma4MoE(SparseMoE):
    """The mixture beside a layer's dense MLP: routed on the residual (:meth:`route`), the experts run
    on their own normalized input. Parameters beyond :class:`SparseMoE`'s: ``router_scale`` [H] and
    ``per_expert_scale`` [E]."""

    def __init__(self, config, tp: TensorParallel = SINGLE) -> None:
        h = config.hidden_size
        super().__init__(
            h, config.moe_intermediate_size, config.num_experts, config.top_k_experts, True,
            config.hidden_activation, tp,
        )  # fmt: skip
        self.router_norm = Gemma4RMSNorm(h, config.rms_norm_eps, scaled=False)
        self.router_scale = nn.Parameter(torch.ones(h))
        self.per_expert_scale = nn.Parameter(torch.ones(config.num_experts))
        self.root = h**-0.5

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.gate(self.router_norm(x) * self.router_scale * self.root)
        route = torch.ops.augur.moe_route if self.fused else moe_route
        ids, weights = route(logits, self.top_k, True, False)
        return ids, weights * self.per_expert_scale[ids]

    def forward(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # noqa: D102 (routed on residual)
        ids, weights = self.route(residual)
        out = torch.ops.augur.moe_experts(
            x, ids, weights, self.experts_gate_up, self.experts_down, None, None, self.act_name, self.ops
        )
        return self.tp.all_reduce(out)


class Gemma4DecoderLayer(nn.Module):
    """Gemma's four norms around attention and the MLP (and the mixture beside it, where the layer has
    one), the per-layer embedding's gate after them, the whole scaled by ``layer_scalar``."""

    def __init__(self, config, layer_idx: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.local = config.layer_types[layer_idx] == LOCAL
        self.self_attn = Gemma4Attention(config, layer_idx, tp)
        wide = 2 if config.use_double_wide_mlp and self.self_attn.shares else 1
        shape = SimpleNamespace(hidden_size=h, intermediate_size=wide * config.intermediate_size)
        self.mlp = LlamaMLP(shape, bias=False, act=config.hidden_activation, tp=tp)  # GeGLU (tanh GELU)
        self.input_layernorm = Gemma4RMSNorm(h, eps)
        self.post_attention_layernorm = Gemma4RMSNorm(h, eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(h, eps)
        self.post_feedforward_layernorm = Gemma4RMSNorm(h, eps)
        self.moe: Gemma4MoE | None = None
        if config.enable_moe_block:
            self.moe = Gemma4MoE(config, tp)
            self.post_feedforward_layernorm_1 = Gemma4RMSNorm(h, eps)
            self.pre_feedforward_layernorm_2 = Gemma4RMSNorm(h, eps)
            self.post_feedforward_layernorm_2 = Gemma4RMSNorm(h, eps)
        self.per_layer = int(config.hidden_size_per_layer_input or 0)
        if self.per_layer:
            self.act = activation(config.hidden_activation)
            self.per_layer_input_gate = nn.Linear(h, self.per_layer, bias=False)
            self.per_layer_projection = nn.Linear(self.per_layer, h, bias=False)
            self.post_per_layer_input_norm = Gemma4RMSNorm(h, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1))  # (a buffer in transformers; a checkpoint carries it)

    def forward(
        self, x, cos, sin, kv_pool, layer, meta, attn: bool = True, mlp: bool = True, per_layer=None, shared=None
    ) -> torch.Tensor:
        if attn and (not self.self_attn.shares or self.self_attn.layer_type in shared):
            a = self.self_attn(self.input_layernorm(x), cos, sin, kv_pool, layer, meta, shared)
            x = x + self.post_attention_layernorm(a)
        if mlp:
            h = self.mlp(self.pre_feedforward_layernorm(x))
            if self.moe is not None:
                routed = self.moe(x, self.pre_feedforward_layernorm_2(x))
                h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(routed)
            x = x + self.post_feedforward_layernorm(h)
        if self.per_layer:
            gated = self.act(self.per_layer_input_gate(x)) * per_layer
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return x * self.layer_scalar


class Gemma4ForCausalLM(StackedExperts, MoEWeights, LayerTypeRope, Gemma2ForCausalLM):
    """Gemma 4 causal LM over a paged KV cache (see the module docstring). Weights load as Gemma 3's,
    with: a global layer's ``k_proj`` also filling the value rows where keys are values; no K/V
    weights for shared layers (dropped if a checkpoint carries them); the mixture's router
    (``router.proj`` / ``router.scale`` / ``router.per_expert_scale``) and stacked experts
    (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]) into :class:`Gemma4MoE`."""

    def __init__(self, config, max_positions: int | None = None, tp: TensorParallel = SINGLE) -> None:
        super().__init__(config, max_positions, tp)
        h, eps = config.hidden_size, config.rms_norm_eps
        self.norm = Gemma4RMSNorm(h, eps)
        self.per_layer = int(config.hidden_size_per_layer_input or 0)
        if self.per_layer:
            L, P = config.num_hidden_layers, self.per_layer
            self.embed_tokens_per_layer = ScaledEmbedding(config.vocab_size_per_layer_input, L * P, scale=P**0.5)
            self.per_layer_model_projection = nn.Linear(h, L * P, bias=False)
            self.per_layer_projection_norm = Gemma4RMSNorm(P, eps)
        self._kv_shape = self._lay_out_pool()

    @staticmethod
    def check_config(config) -> None:
        if getattr(config, "use_bidirectional_attention", None) == "all":
            raise ValueError(
                "Gemma 4 with use_bidirectional_attention 'all' is an encoder (every token attends to later ones), "
                "not a causal LM: Augur cannot serve it"
            )
        check_layer_types(config, "Gemma 4")
        ple = int(getattr(config, "hidden_size_per_layer_input", 0) or 0)
        if ple and config.vocab_size_per_layer_input < config.vocab_size:
            raise ValueError(
                f"Gemma 4's per-layer embedding table has {config.vocab_size_per_layer_input} rows for a "
                f"vocabulary of {config.vocab_size}: the tokens past it have no per-layer input"
            )

    def decoder_layer(self, config, i: int, qkv_bias: bool, o_bias: bool, tp: TensorParallel) -> nn.Module:
        return Gemma4DecoderLayer(config, i, tp)

    def init_buffers(self, max_positions: int) -> None:
        """Both RoPE tables, each as wide as its layers' heads (a global layer's table from its own
        shape: transformers' ``per_layer_config``)."""
        if "rope_local_cos" not in self._buffers:
            self.register_rope_buffers()
        device = self.embed_tokens.weight.device
        if device.type == "meta":
            return
        by_type = {GLOBAL: ("rope_cos", "rope_sin"), LOCAL: ("rope_local_cos", "rope_local_sin")}
        for layer_type, (cos_name, sin_name) in by_type.items():
            if layer_type not in self.config.layer_types:
                continue
            first = self.config.layer_types.index(layer_type)
            cos, sin = rope_tables(self.config.per_layer_config[first], layer_type, max_positions)
            setattr(self, cos_name, cos.to(device))
            setattr(self, sin_name, sin.to(device))

    def rope_at(self, positions: torch.Tensor, dtype: torch.dtype):
        dtype = self.rope_dtype or dtype
        types = set(self.config.layer_types)
        rows = {}
        if GLOBAL in types:
            rows[False] = (self.rope_cos[positions].to(dtype)[:, None], self.rope_sin[positions].to(dtype)[:, None])
        if LOCAL in types:
            rows[True] = (
                self.rope_local_cos[positions].to(dtype)[:, None],
                self.rope_local_sin[positions].to(dtype)[:, None],
            )
        return rows

    # -- the KV pool ------------------------------------------------------------------------------
    def _lay_out_pool(self) -> tuple[int, int, int]:
        """Give each layer its pool row and head repetition; the pool's ``(rows, heads, head dim)``."""
        attns = [layer.self_attn for layer in self.layers]
        makers = [a for a in attns if not a.shares]
        if not makers:
            raise ValueError("a Gemma 4 config whose every layer shares K/V has no layer to make them")
        width = max(a.num_kv_heads * a.head_dim for a in makers)
        head_dim = max(a.head_dim for a in makers)
        rows: dict[str, int] = {}
        for row, a in enumerate(makers):
            a.kv_row = row
            heads = width // a.head_dim
            if width % a.head_dim or heads % a.num_kv_heads or a.num_heads % heads:
                raise ValueError(
                    f"Gemma 4 layer shapes Augur's KV pool cannot hold together: a slot of {width} values read as "
                    f"{a.head_dim}-dim heads for {a.num_kv_heads} KV heads and {a.num_heads} query heads"
                )
            a.kv_repeat = heads // a.num_kv_heads
            if a.stores:
                rows[a.layer_type] = row
        for a in attns:
            if a.shares:
                producer = next(m for m in reversed(makers) if m.stores and m.layer_type == a.layer_type)
                a.kv_row, a.kv_repeat = producer.kv_row, producer.kv_repeat
        return len(makers), width // head_dim, head_dim

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        return self._kv_shape

    # -- forward ----------------------------------------------------------------------------------
    def per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[T, layers, P]: each token's per-layer vectors, its table rows mixed with a projection of its
        embedding ``x``."""
        T, L = input_ids.shape[0], self.num_layers
        table = self.embed_tokens_per_layer(input_ids).view(T, L, self.per_layer)
        projected = self.per_layer_model_projection(x) * self.config.hidden_size**-0.5
        projected = self.per_layer_projection_norm(projected.view(T, L, self.per_layer))
        return (projected + table) * 2.0**-0.5

    def forward(self, input_ids, positions, meta, kv_caches, skip=None, hidden_layers=()):
        """Llama's forward (see ``LlamaForCausalLM.forward``) with the per-layer inputs and the K/V each
        producer hands its sharers."""
        x = self.embed(input_ids)
        per_layer = self.per_layer_inputs(input_ids, x) if self.per_layer else None
        rope = self.rope_at(positions, x.dtype)
        wanted = set(hidden_layers)
        captured: dict[int, torch.Tensor] = {}
        shared: dict = {}
        for i in range(self.num_layers):
            cos, sin = self.layer_rope(rope, i)
            mine = None if per_layer is None else per_layer[:, i]
            attn = skip is None or i not in skip.attn
            mlp = skip is None or i not in skip.mlp
            if attn or mlp:
                x = self.layers[i](x, cos, sin, kv_caches, i, meta, attn, mlp, mine, shared)
            if i in wanted:
                captured[i] = x
        return self.norm(x), captured

    # -- weights ----------------------------------------------------------------------------------
    _ROUTER = {  # the router's checkpoint names → its place in Gemma4MoE
        ".router.proj.": ".moe.gate.",
        ".router.scale": ".moe.router_scale",
        ".router.per_expert_scale": ".moe.per_expert_scale",
    }

    def checkpoint_name(self, name: str) -> str:
        name = super().checkpoint_name(name)
        for piece, ours in self._ROUTER.items():
            if piece in name:
                return name.replace(piece, ours)
        found = _LAYER.match(name)
        if found and name.startswith(f"layers.{found[1]}.experts.") and not name.startswith(f"layers.{found[1]}.moe."):
            return name.replace(".experts.", ".moe.experts.", 1)
        return name

    def checkpoint_aliases(self, name: str) -> tuple[str, ...]:
        """The other names a checkpoint tensor (or module) also fills: a keys-are-values layer's ``k_proj``
        is its ``v_proj`` too (its weight, a stored quantized form, a LoRA adapter's pair on it)."""
        found = _LAYER.match(self.checkpoint_name(name))
        if found and ".self_attn.k_proj" in name and self.layers[int(found[1])].self_attn.k_is_v:
            return (name.replace(".self_attn.k_proj", ".self_attn.v_proj"),)
        return ()

    def checkpoint_skips(self, name: str) -> bool:
        """A sharing layer's K/V tensors (the "E" releases carry them; transformers ignores them): not read."""
        found = _LAYER.match(self.checkpoint_name(name))
        return bool(found and self.layers[int(found[1])].self_attn.shares and _SHARED_KV.search(name))

    def checkpoint_stream(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors with a keys-are-values layer's ``k_proj`` also as its ``v_proj``, and
        a sharing layer's K/V tensors (which transformers ignores too) left out: what the loader hands on
        (engine/runner/loader.py), before ``--quantization`` takes each linear layer's weights."""
        for name, tensor in weights:
            if self.checkpoint_skips(name):
                continue
            yield name, tensor
            for alias in self.checkpoint_aliases(name):
                yield alias, tensor

    def expected_slots(self, pname: str) -> set[str]:
        found = _LAYER.match(pname)
        sharing = found and self.layers[int(found[1])].self_attn.shares
        if sharing and pname.endswith((".self_attn.qkv_proj.weight", ".self_attn.qkv_proj.bias")):
            return {f"{pname}:q"}
        return super().expected_slots(pname)

    def checkpoint_slice(self, name: str) -> tuple[int, int, int] | str | None:
        if self.tp.size == 1:
            return None
        ours = self.checkpoint_name(name)
        if ours.startswith(("embed_tokens_per_layer.", "per_layer_")) or ".per_layer_" in ours:
            return None  # the per-layer inputs: every rank all of them
        found = _LAYER.match(ours)
        if found and ".self_attn." in ours:  # this layer's own shapes (layers differ)
            layer = self.layers[int(found[1])]
            return layer_slice(ours, layer.self_attn, layer.mlp, self.tp.rank)
        return super().checkpoint_slice(name)


class Gemma4TextForCausalLM(TextTower, Gemma4ForCausalLM):
    """The language model of a ``Gemma4ForConditionalGeneration`` checkpoint, served as text only:
    :class:`Gemma4ForCausalLM` with the checkpoint's weight names; the vision and audio towers and their
    embedders are skipped."""

    architecture = "Gemma4ForConditionalGeneration"
    _skipped_prefixes = TextTower._skipped_prefixes + tuple(
        prefix + part for prefix in ("", "model.") for part in ("audio_tower.", "embed_vision.", "embed_audio.")
    )
