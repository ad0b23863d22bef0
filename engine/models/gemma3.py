"""Gemma 3: Gemma-2's decoder with per-head q/k norms and two RoPE tables, on the same flattened batch
and paged KV cache.

What differs from ``engine.models.gemma2``:
- q and k are normalized per head (``q_norm`` / ``k_norm``, Gemma's RMSNorm: scale ``1 + weight``)
  before RoPE;
- layers come in a *local* : *global* pattern (``layer_types``; 5 : 1 in every released model):
  a local layer attends within the sliding window, a global layer to the whole context;
- local and global layers rotate with different RoPE parameters (``rope_parameters`` is keyed by
  layer type in transformers 5: ``sliding_attention`` with the local base, 10 000 in the releases;
  ``full_attention`` with the global base, 1 000 000, and on the 4B and larger models a linear
  scaling of factor 8 — older configs' ``rope_local_base_freq`` and ``rope_scaling`` are converted
  to that form by the config class). So the model keeps two cos/sin tables and each layer reads the
  one of its type;
- no attention soft-cap in the released configs; one set in a config is applied (as Gemma-2's is),
  though transformers' Gemma 3 ignores it.

Two classes:
- :class:`Gemma3ForCausalLM`: text-only checkpoints (the 1B, and ``Gemma3ForCausalLM`` exports);
- :class:`Gemma3TextForCausalLM`: the language model of a multimodal ``Gemma3ForConditionalGeneration``
  checkpoint (4B, 12B, 27B), served as text only. Images are not served: the vision tower and the
  projector's weights are skipped as they load, and the API refuses image content parts. The loader's
  ``load_config`` hands this class the checkpoint's ``text_config`` (with the top-level EOS ids),
  so the rest of the engine sees an ordinary decoder's config.

Bidirectional Gemma 3 configs (``use_bidirectional_attention``: an encoder for embeddings) are refused.
"""

from __future__ import annotations

from torch import nn

from engine.models.gemma2 import Gemma2Attention, Gemma2DecoderLayer, Gemma2ForCausalLM, GemmaRMSNorm
from engine.models.layer_rope import LOCAL, LayerTypeRope, check_layer_types
from engine.models.llama import LlamaMLP
from engine.models.text_tower import TextTower
from engine.parallel import SINGLE, TensorParallel


class Gemma3Attention(Gemma2Attention):
    """Gemma-2's attention (score scale ``query_pre_attn_scalar ** -0.5``, a soft-cap where the config
    sets one) with q and k normalized per head before RoPE."""

    def __init__(self, config, layer_idx: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__(config, layer_idx, tp)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    """Gemma-2's four-norm layer around :class:`Gemma3Attention`; ``local`` says which RoPE table the
    model hands it (a local layer's, even where the config sets no window and it attends to all)."""

    def __init__(self, config, layer_idx: int, tp: TensorParallel = SINGLE) -> None:
        nn.Module.__init__(self)
        h, eps = config.hidden_size, config.rms_norm_eps
        self.local = config.layer_types[layer_idx] == LOCAL
        self.self_attn = Gemma3Attention(config, layer_idx, tp)
        self.mlp = LlamaMLP(config, bias=False, act=config.hidden_activation, tp=tp)  # GeGLU (tanh GELU)
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)


class Gemma3ForCausalLM(LayerTypeRope, Gemma2ForCausalLM):
    """Gemma 3 causal LM over a paged KV cache.

    Two RoPE tables, the global layers' and the local layers' (:class:`LayerTypeRope`: the forward is
    Llama's loop with each layer handed its own table). Weights load as Gemma-2's (checkpoint names
    match once q/k/v and gate/up are fused; ``q_norm`` and ``k_norm`` are per head, whole on every
    tensor-parallel rank); the final logits are soft-capped where the config sets
    ``final_logit_softcapping``."""

    @staticmethod
    def check_config(config) -> None:
        if getattr(config, "use_bidirectional_attention", None):
            raise ValueError(
                "Gemma 3 with use_bidirectional_attention is an encoder (every token attends to later ones), "
                "not a causal LM: Augur cannot serve it"
            )
        check_layer_types(config, "Gemma 3")

    def decoder_layer(self, config, i: int, qkv_bias: bool, o_bias: bool, tp: TensorParallel) -> nn.Module:
        return Gemma3DecoderLayer(config, i, tp)


class Gemma3TextForCausalLM(TextTower, Gemma3ForCausalLM):
    """The language model of a ``Gemma3ForConditionalGeneration`` checkpoint (4B, 12B, 27B), served as
    text only: :class:`Gemma3ForCausalLM` with the checkpoint's weight names (:class:`TextTower`).

    Transformers' ``Gemma3ForConditionalGeneration`` does not apply ``final_logit_softcapping``; this
    class does where the text config sets it, as its text-only sibling does (no released config sets it)."""

    architecture = "Gemma3ForConditionalGeneration"
