"""Gemma-2: a Llama-shaped decoder with a few twists, on the same flattened batch and paged KV cache.

What differs from ``engine.models.llama``:
- the embedding is scaled by sqrt(hidden_size), rounded to the hidden dtype (as Gemma was trained);
- RMSNorm multiplies by ``1 + weight`` and rounds to the input dtype only at the end;
- each sublayer has a norm before *and* after it (``input_layernorm`` / ``post_attention_layernorm``
  around attention, ``pre_feedforward_layernorm`` / ``post_feedforward_layernorm`` around the MLP);
- the MLP is GeGLU (tanh-approximated GELU);
- attention scores are scaled by ``query_pre_attn_scalar ** -0.5`` and *soft-capped*:
  ``cap * tanh(scores / cap)`` before the mask (``attn_logit_softcapping``), as are the final
  logits (``final_logit_softcapping``);
- layers alternate sliding-window and full attention (``layer_types``).

Weights load as Llama's do (q/k/v and gate/up fused as they arrive); the output layer is the
embedding table (tied).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, RMSNorm, sliding_window_of
from engine.parallel import SINGLE, TensorParallel


class GemmaRMSNorm(RMSNorm):
    """RMSNorm scaled by ``1 + weight`` (a zero weight is the identity scale), all in float32."""

    unit_offset = True

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.invariant or self.fused:
            return super().forward(x)
        y = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


class ScaledEmbedding(nn.Embedding):
    """The token embedding times sqrt(hidden_size) (or ``scale``), the factor rounded to the weights'
    dtype: what the first layer reads (a proposer reusing ``embed_tokens`` gets the same). The tied
    output layer reads the unscaled ``weight``."""

    def __init__(self, *args, scale: float | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # The factor rounded to each dtype, as Python numbers: no host-to-device copy per call (which a
        # CUDA graph's capture refuses), and constants to torch.compile.
        root = self.embedding_dim**0.5 if scale is None else scale
        dtypes = (torch.float32, torch.bfloat16, torch.float16)
        self.factors = {dt: torch.tensor(root, dtype=dt, device="cpu").item() for dt in dtypes}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = super().forward(input_ids)
        return x * self.factors[x.dtype]


class Gemma2Attention(LlamaAttention):
    """Llama's attention with Gemma-2's score scale (``query_pre_attn_scalar ** -0.5``) and soft-cap."""

    def __init__(self, config, layer_idx: int, tp: TensorParallel = SINGLE) -> None:
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config, layer_idx, qkv_bias=bias, o_bias=bias, qk_norm=False, tp=tp)
        self.scale = config.query_pre_attn_scalar**-0.5
        self.softcap = float(getattr(config, "attn_logit_softcapping", None) or 0.0)


class Gemma2DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma2Attention(config, layer_idx, tp)
        self.mlp = LlamaMLP(config, bias=False, act=config.hidden_activation, tp=tp)  # GeGLU (tanh GELU)
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, x, cos, sin, kv_pool, layer, meta, attn: bool = True, mlp: bool = True) -> torch.Tensor:
        if attn:
            a = self.self_attn(self.input_layernorm(x), cos, sin, kv_pool, layer, meta)
            x = x + self.post_attention_layernorm(a)
        if mlp:
            x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma-2 causal LM over a paged KV cache. Shares Llama's forward loop (``skip`` leaves a
    sublayer out with its pre- and post-norm; ``hidden_layers`` capture a layer's output before the
    final norm), RoPE tables, weight loading (the checkpoint's names match ours once q/k/v and gate/up
    are fused) and CPU packing."""

    def __init__(self, config, max_positions: int | None = None, tp: TensorParallel = SINGLE) -> None:
        nn.Module.__init__(self)
        self.check_config(config)
        self.config = config
        self.tp = tp
        self.vocab_shard = tp.split(config.vocab_size, "vocabulary")
        self.embed_tokens = ScaledEmbedding(self.vocab_shard, config.hidden_size)
        layers = range(config.num_hidden_layers)
        self.layers = nn.ModuleList(self.decoder_layer(config, i, False, False, tp) for i in layers)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.lm_head = None if self.tie_word_embeddings else nn.Linear(config.hidden_size, self.vocab_shard, bias=False)
        self.final_softcap = float(getattr(config, "final_logit_softcapping", None) or 0.0)  # 0: no cap
        windows = {sliding_window_of(config, i) for i in range(config.num_hidden_layers)} - {None}
        if len(windows) > 1:
            raise ValueError(f"layers with different sliding windows are not supported: {sorted(windows)}")
        self.sliding_window: int | None = windows.pop() if windows else None
        self.register_rope_buffers()
        self.init_buffers(max_positions or config.max_position_embeddings)

    @staticmethod
    def check_config(config) -> None:
        if getattr(config, "use_bidirectional_attention", None):
            raise ValueError("Gemma-2 with bidirectional attention is not a causal LM")

    def decoder_layer(self, config, i: int, qkv_bias: bool, o_bias: bool, tp: TensorParallel) -> nn.Module:
        return Gemma2DecoderLayer(config, i, tp)

    def register_rope_buffers(self) -> None:
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)  # [max_positions, head_dim]
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] → [N, vocab] float32
        logits = super().compute_logits(hidden)
        if self.final_softcap > 0.0 and self.batch_invariant:
            logits = torch.ops.augur.invariant_softcap(logits, self.final_softcap)
        elif self.final_softcap > 0.0:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
