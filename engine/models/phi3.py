"""Phi-3 (and Phi-4-mini, which ships as ``Phi3ForCausalLM``): a Llama-shaped decoder whose checkpoint
stores its projections fused, with partial rotary embeddings and LongRoPE scaling.

What differs from ``engine.models.llama``:

- the checkpoint holds ``self_attn.qkv_proj`` and ``mlp.gate_up_proj`` already fused, in the layout
  of our fused parameters (q rows, then k, then v; gate rows, then up): they load as they are. No
  biases anywhere.
- *partial rotary*: RoPE turns only the first ``rotary_dim = int(head_dim * partial_rotary_factor)``
  dimensions of each head (rotate-half within those), the rest pass through unrotated; the RoPE
  tables are ``[max_positions, rotary_dim]`` wide.
- *LongRoPE* (``rope_type: "longrope"``): two sets of per-frequency divisors, ``short_factor`` for
  sequences up to ``original_max_position_embeddings`` and ``long_factor`` beyond, and one attention
  factor scaling cos and sin. Transformers picks the set by the length of the sequence it is running
  (and recomputes the whole cache when a generation crosses the boundary). A paged KV cache keeps
  keys rotated once, so one set must serve every position of every sequence. The rule here: an
  engine whose longest sequence (``max_positions``, the engine's max model length) fits in
  ``original_max_position_embeddings`` uses the short factors, exactly transformers' choice at every
  length it can run; a longer engine uses the long factors for all positions, transformers' choice for
  sequences past the original length (and for shorter ones a difference from transformers, which it
  would have switched back to short). Serve with ``--max-model-len`` at most the original length to
  get the short factors.
- a sliding window (``sliding_window``), when set, applies to every layer.

Under tensor parallelism a rank holds its heads' rows of q/k/v and its slice of gate/up, as for Llama;
since one checkpoint tensor holds several of those pieces and the loader reads one contiguous slice
per tensor (``checkpoint_slice``), each rank reads the fused tensors whole and cuts its pieces in
``load_weights``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.attention import AttentionMetadata
from engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, apply_rope
from engine.parallel import SINGLE, TensorParallel


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rotary_dim_of(config) -> int:
    """How many leading dimensions of each head RoPE turns (``partial_rotary_factor`` of them; all by
    default). Transformers 5 keeps the factor in ``rope_parameters``; older configs at the top level."""
    params = getattr(config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    return int(head_dim_of(config) * factor)


def phi3_rope_cos_sin(config, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[max_positions, rotary_dim]``, the attention factor folded in; for LongRoPE
    the factor set chosen by ``max_positions`` (the module docstring's rule). GLM-4.5's partial
    rotary tables too (default RoPE)."""
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    dim = rotary_dim_of(config)
    if rope_type == "default":
        base = params.get("rope_theta", 10000.0)
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        scaling = 1.0
    elif rope_type == "longrope":
        # Transformers' own LongRoPE frequencies, asked for a sequence of the engine's longest length:
        # short factors up to the original length, long ones past it.
        inv_freq, scaling = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=max_positions)
    else:
        raise ValueError(f"RoPE type {rope_type!r} with partial rotary is not supported (supported: default, longrope)")
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq.float())
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, 1, R] with R <= D: the first R dimensions rotated, the rest kept."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return torch.cat((apply_rope(x[..., :r], cos, sin), x[..., r:]), dim=-1)


class PartialRotaryAttention(LlamaAttention):
    """Llama's attention with RoPE on the first ``rotary_dim`` dimensions of each head, after the q/k
    norms where the family has them (Phi-3 has neither biases nor norms; GLM-4.5 has q/k/v biases and
    may have norms); at full width it is Llama's forward (its fused RoPE kernel included)."""

    def __init__(
        self, config, layer_idx: int, tp: TensorParallel = SINGLE, qkv_bias: bool = False, qk_norm: bool = False
    ) -> None:
        super().__init__(config, layer_idx, qkv_bias=qkv_bias, o_bias=False, qk_norm=qk_norm, tp=tp)
        self.rotary_dim = rotary_dim_of(config)

    def forward(self, x, cos, sin, kv_pool: torch.Tensor, layer: int, meta: AttentionMetadata) -> torch.Tensor:
        if self.rotary_dim == self.head_dim:
            return super().forward(x, cos, sin, kv_pool, layer, meta)
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_partial_rope(q, cos, sin), apply_partial_rope(k, cos, sin)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        return self.tp.all_reduce(self.o_proj(self.attend(q, k, v, kv_pool, layer, meta)))


def check_rotary_dim(config, family: str) -> None:
    """A config's partial rotary factor must leave RoPE an even number of a head's dimensions."""
    rotary = rotary_dim_of(config)
    if rotary <= 0 or rotary % 2 or rotary > head_dim_of(config):
        raise ValueError(
            f"{family} partial_rotary_factor gives {rotary} rotary dimensions of a {head_dim_of(config)}-wide "
            "head; RoPE needs an even number, at least 2, at most the head's width"
        )


class PartialRotaryTables:
    """RoPE tables ``[max_positions, rotary_dim]`` (:func:`phi3_rope_cos_sin`) for a
    ``LlamaForCausalLM`` subclass whose attention is :class:`PartialRotaryAttention`."""

    def init_buffers(self, max_positions: int) -> None:
        device = self.embed_tokens.weight.device
        if device.type == "meta":
            return
        cos, sin = phi3_rope_cos_sin(self.config, max_positions)
        self.rope_cos = cos.to(device)  # [max_positions, rotary_dim]
        self.rope_sin = sin.to(device)


class Phi3ForCausalLM(PartialRotaryTables, LlamaForCausalLM):
    """Phi-3 causal LM over a paged KV cache: Llama's model (forward loop with layer skipping and
    captured hidden states, embedding and LM head sharding, CPU packing, the invariant and fused
    operators) with Phi-3's attention, RoPE tables and loading of pre-fused checkpoint tensors."""

    _fused: dict = {}  # no checkpoint tensor is a piece of one of ours: qkv_proj and gate_up_proj come fused
    streams_linear_weights = False  # its load_weights places them (and cuts a rank's rows) by name

    def __init__(self, config, max_positions: int | None = None, tp: TensorParallel = SINGLE) -> None:
        check_rotary_dim(config, "Phi-3")
        super().__init__(config, max_positions, tp)

    def decoder_layer(self, config, i: int, qkv_bias: bool, o_bias: bool, tp: TensorParallel) -> nn.Module:
        return LlamaDecoderLayer(config, i, qkv_bias, o_bias, False, tp, attn=PartialRotaryAttention(config, i, tp))

    @staticmethod
    def attention_biases(config) -> tuple[bool, bool]:
        return False, False

    # -- weights ------------------------------------------------------------------------------------
    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face checkpoint tensors, each onto the parameter of its name (this rank's rows of
        the fused ones under tensor parallelism)."""
        if self.tp.size > 1 and not isinstance(self.layers[0].self_attn.qkv_proj, nn.Linear):
            raise ValueError(
                "Phi-3 cannot be quantized as it loads under tensor parallelism (--quantization nf4 with "
                "--tensor-parallel-size > 1): its checkpoint stores q/k/v and gate/up fused, and each "
                "checkpoint matrix is quantized whole before a rank's rows could be cut from it; serve it "
                "with --quantization int4, or on one rank"
            )
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in self.take_kv_scales(weights):
            if "rotary_emb.inv_freq" in name:
                continue
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding serves as the output layer
            if name not in params:
                raise ValueError(f"unexpected weight in checkpoint: {name}")
            tensor = self._rank_rows(name, tensor)
            if params[name].shape != tensor.shape:
                raise ValueError(
                    f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, model {tuple(params[name].shape)}"
                )
            params[name].copy_(tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:3]}")

    def _rank_rows(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a whole fused checkpoint tensor: its heads' q, k and v rows, or its slice of
        gate and of up, stacked as our fused parameter holds them; any other tensor as it came."""
        if self.tp.size == 1 or not (".qkv_proj." in name or ".gate_up_proj." in name):
            return tensor
        attn, mlp, r = self.layers[0].self_attn, self.layers[0].mlp, self.tp.rank
        if ".qkv_proj." in name:
            q_total = self.config.num_attention_heads * attn.head_dim
            kv_total = (self.config.num_key_value_heads or self.config.num_attention_heads) * attn.head_dim
            kv_start = attn.first_kv_head * attn.head_dim
            pieces = [
                (r * attn.q_size, attn.q_size),
                (q_total + kv_start, attn.kv_size),
                (q_total + kv_total + kv_start, attn.kv_size),
            ]
        else:
            inner, total = mlp.intermediate_size, self.config.intermediate_size
            pieces = [(r * inner, inner), (total + r * inner, inner)]
        return torch.cat([tensor.narrow(0, start, length) for start, length in pieces])

    def checkpoint_slice(self, name: str) -> tuple[int, int, int] | str | None:
        """As Llama's, except that a rank reads the fused q/k/v and gate/up tensors whole (it needs
        several separate row ranges of each: ``_rank_rows`` cuts them)."""
        if ".qkv_proj." in name or ".gate_up_proj." in name:
            return None
        return super().checkpoint_slice(name)
