"""OLMo 2: a Llama-shaped decoder with norms after its sublayers and q/k norms over whole projections.

What differs from ``engine.models.llama``:

- *post-norm*: a layer normalizes each sublayer's output before adding it to the residual stream,
  ``x + norm(attn(x))`` and ``x + norm(mlp(x))`` (``post_attention_layernorm`` and
  ``post_feedforward_layernorm``), and never its input (no ``input_layernorm``).
- the query and key projections are RMS-normalized over their *whole* width, ``heads * head_dim``
  (Qwen3 normalizes each head on its own), before RoPE: ``q_norm`` has one weight per query dimension
  of every head, ``k_norm`` per key dimension.
- every RMSNorm scales in float32 and rounds to the input dtype last (Llama rounds, then scales); RoPE
  turns q and k in float32 (its tables stay float32) and rounds them after, as transformers' OLMo 2
  and 3 do.
- no biases in the MLP; ``attention_bias`` puts them on q/k/v and o.

Under tensor parallelism a rank holds only its heads' slice of q and k, but their norm's mean square
runs over all heads: each rank sums the squares of its slice, an all-reduce adds the ranks' sums
(divided by the number of ranks holding each key head where key heads are replicated), and each rank
scales its slice by the whole projection's root mean square. The norms' weights are cut like the
projections' rows.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention import AttentionMetadata
from engine.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, apply_rope
from engine.parallel import SINGLE, TensorParallel


class Olmo2RMSNorm(nn.Module):
    """RMSNorm with OLMo 2's rounding (normalize and scale in float32, then round), over a last
    dimension of ``dim`` on this rank that may be a slice of a ``total``-wide vector spread over the
    ranks (a q or k projection under tensor parallelism), each slice held by ``replicas`` ranks."""

    invariant = False  # on the batch-invariant operators (LlamaForCausalLM.use_invariant_ops)
    round_first = False  # round the normalized input to its dtype before scaling (Llama's order; MiniMax-M2's)

    def __init__(
        self, dim: int, eps: float, tp: TensorParallel = SINGLE, total: int | None = None, replicas: int = 1
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.tp = tp
        self.total = total or dim
        self.replicas = replicas
        self.spans_ranks = tp.size > 1 and self.total != dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        if self.spans_ranks:
            if self.invariant:  # each row's sum in one order whatever the batch: a product with ones
                ones = torch.ones(1, xf.shape[-1], dtype=xf.dtype, device=xf.device)
                squares = torch.ops.augur.invariant_linear(xf * xf, ones, None)
            else:
                squares = (xf * xf).sum(-1, keepdim=True)
            mean_square = self.tp.all_reduce(squares) / (self.replicas * self.total)
            y = xf / torch.sqrt(mean_square + self.eps)
        elif self.invariant:  # normalized in float32 by the invariant kernel (a unit weight), scaled below
            ones = torch.ones(xf.shape[-1], dtype=xf.dtype, device=xf.device)
            y = torch.ops.augur.invariant_rms_norm(xf, ones, self.eps, False)
        else:
            y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.round_first:
            return self.weight * y.to(x.dtype)
        return (self.weight.float() * y).to(x.dtype)


class Olmo2Attention(LlamaAttention):
    """Llama's attention with q and k RMS-normalized over their whole projections (``norm``) before RoPE
    (:meth:`turn`)."""

    norm = Olmo2RMSNorm
    biased = True  # q/k/v and o take biases where the config's attention_bias says (MiniMax-M2's never)

    def __init__(self, config, layer_idx: int, tp: TensorParallel = SINGLE) -> None:
        bias = self.biased and bool(getattr(config, "attention_bias", False))
        super().__init__(config, layer_idx, qkv_bias=bias, o_bias=bias, qk_norm=False, tp=tp)
        heads = config.num_attention_heads
        kv_heads = config.num_key_value_heads or heads
        eps = config.rms_norm_eps
        self.q_norm = self.norm(self.q_size, eps, tp, total=heads * self.head_dim)
        # Past as many ranks as key heads, each key head is on size / kv_heads ranks (TensorParallel.kv_heads).
        replicas = max(1, tp.size // kv_heads)
        self.k_norm = self.norm(self.kv_size, eps, tp, total=kv_heads * self.head_dim, replicas=replicas)

    def turn(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on q or k ``[T, heads, head_dim]``: in float32 where the tables are (OLMo's), rounded after."""
        return apply_rope(x, cos, sin).to(x.dtype)

    def forward(self, x, cos, sin, kv_pool: torch.Tensor, layer: int, meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.turn(self.q_norm(q).view(T, self.num_heads, self.head_dim), cos, sin)
        k = self.turn(self.k_norm(k).view(T, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        return self.tp.all_reduce(self.o_proj(self.attend(q, k, v, kv_pool, layer, meta)))


class Olmo2DecoderLayer(nn.Module):
    """Attention and an MLP, each normalized after it (``norm``) and added to the residual; ``attn``: the
    attention when not OLMo 2's (EXAONE 4's)."""

    def __init__(self, config, layer_idx: int, tp: TensorParallel = SINGLE, attn: nn.Module | None = None,
                 norm: type[nn.Module] = Olmo2RMSNorm) -> None:  # fmt: skip
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = attn if attn is not None else Olmo2Attention(config, layer_idx, tp)
        self.mlp = LlamaMLP(config, bias=False, tp=tp)
        self.post_attention_layernorm = norm(h, eps)
        self.post_feedforward_layernorm = norm(h, eps)

    def forward(self, x, cos, sin, kv_pool, layer, meta, attn: bool = True, mlp: bool = True) -> torch.Tensor:
        if attn:
            x = x + self.post_attention_layernorm(self.self_attn(x, cos, sin, kv_pool, layer, meta))
        if mlp:
            x = x + self.post_feedforward_layernorm(self.mlp(x))
        return x


class WholeProjectionNorms:
    """Mixed into a ``LlamaForCausalLM`` subclass whose attention normalizes q and k over their whole
    projections (:class:`Olmo2RMSNorm` as ``q_norm`` / ``k_norm``): under tensor parallelism a rank
    reads the norms' weights cut like the rows of their projections."""

    def checkpoint_slice(self, name: str) -> tuple[int, int, int] | str | None:
        if self.tp.size > 1 and (".q_norm." in name or ".k_norm." in name):
            attn = self.layers[0].self_attn
            if ".q_norm." in name:
                return 0, self.tp.rank * attn.q_size, attn.q_size
            return 0, attn.first_kv_head * attn.head_dim, attn.kv_size
        return super().checkpoint_slice(name)


class Olmo2ForCausalLM(WholeProjectionNorms, LlamaForCausalLM):
    """OLMo 2 causal LM over a paged KV cache: Llama's model (forward loop with layer skipping — a
    skipped sublayer goes with its post-norm — and captured hidden states, RoPE tables, weight loading
    with q/k/v and gate/up fused, embedding and LM head sharding, CPU packing) with OLMo 2's layers and
    final norm."""

    rope_dtype = torch.float32

    def __init__(self, config, max_positions: int | None = None, tp: TensorParallel = SINGLE) -> None:
        super().__init__(config, max_positions, tp)
        self.norm = Olmo2RMSNorm(config.hidden_size, config.rms_norm_eps)

    def decoder_layer(self, config, i: int, qkv_bias: bool, o_bias: bool, tp: TensorParallel) -> nn.Module:
        return Olmo2DecoderLayer(config, i, tp)
