"""The Llama family: Llama 2/3 (incl. llama3 RoPE scaling), Vicuna, TinyLlama, Qwen2, Qwen3, Mistral.

One compact implementation; the family members differ only in a few switches (class attributes):
Qwen2 has biases on q/k/v, Qwen3 normalizes q and k per head, Mistral may use a sliding window.

The forward takes one flattened batch of new tokens from many sequences (see ``engine.attention``)
and can skip attention and MLP sublayers (self-speculative drafting) and return chosen layers' hidden states
(Medusa/EAGLE-style heads read them).

Built with a :class:`~engine.parallel.TensorParallel` of size N, a model holds one rank's shard
(Megatron's layout): q/k/v and gate/up are column-parallel (this rank's heads, its slice of the MLP's
inner dimension; KV heads replicated where there are fewer than ranks), ``o_proj`` and ``down_proj``
row-parallel with one all-reduce each, the embedding and the LM head split by vocabulary (the
logits gathered). :meth:`LlamaForCausalLM.checkpoint_slice` tells the loader which slice of each
checkpoint tensor this rank reads.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.attention import AttentionMetadata, paged_attention
from engine.models.invariant import InvariantLinear, activation
from engine.models.layer_skip import LayerSkip
from engine.models.packed import PackedLinear, pack_linears
from engine.parallel import SINGLE, TensorParallel


class RMSNorm(nn.Module):
    unit_offset = False  # Gemma's: the scale is 1 + weight, in float32
    invariant = False  # on augur::invariant_rms_norm (LlamaForCausalLM.use_invariant_ops)
    fused = False  # on augur::fused_rms_norm (LlamaForCausalLM.use_fused_ops)

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.invariant:
            return torch.ops.augur.invariant_rms_norm(x, self.weight, self.eps, self.unit_offset)
        if self.fused:
            return torch.ops.augur.fused_rms_norm(x, self.weight, self.eps, self.unit_offset)
        # Normalize in float32, scale in the input dtype (the order Hugging Face's Llama uses).
        y = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * y.to(x.dtype)


def rope_cos_sin(config, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_positions, head_dim] for the config's RoPE type (computed by transformers)."""
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "dynamic":
        raise ValueError("dynamic NTK RoPE scaling is not supported (its frequencies change with length)")
    if rope_type == "default":
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        scaling = 1.0
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    t = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq.float())
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, 1, D] (rotate-half convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rope_rows(cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """The rows of RoPE tables ``[max_positions, D]`` for these positions, ``(cos, sin)`` each
    ``[T, 1, D]`` in ``dtype``."""
    return cos[positions].to(dtype).unsqueeze(1), sin[positions].to(dtype).unsqueeze(1)


# An FP8 KV cache's scales in a checkpoint: llm-compressor's (self_attn.k_scale) or AutoFP8's (k_proj.output_scale)
_KV_SCALE = re.compile(r"layers\.(?P<layer>\d+)\.self_attn\.(?:(?P<kv>[kv])_scale|(?P<proj>[kv])_proj\.output_scale)$")


class LlamaAttention(nn.Module):
    def __init__(
        self, config, layer_idx: int, qkv_bias: bool, o_bias: bool, qk_norm: bool, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        self.tp = tp
        heads = config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.num_heads = tp.split(heads, "attention heads")  # this rank's
        self.total_kv_heads = config.num_key_value_heads or heads
        self.num_kv_heads, self.first_kv_head = tp.kv_heads(self.total_kv_heads)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.sliding = sliding_window_of(config, layer_idx) is not None
        self.softcap = 0.0  # attention-score soft-cap (Gemma-2); 0: none
        self.sinks: nn.Parameter | None = None  # [this rank's heads] attention-sink logits (gpt-oss)
        # [2, this rank's KV heads] float32: K and V scales of an FP8 KV cache, where the checkpoint carries
        # them (engine/attention/kv_dtype.py; set by LlamaForCausalLM.load_weights); None: 1.0
        self.register_buffer("kv_scales", None, persistent=False)
        self.fused = False  # q/k norms and RoPE on augur::fused_rope (LlamaForCausalLM.use_fused_ops)

    def forward(self, x, cos, sin, kv_pool: torch.Tensor, layer: int, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.rotated(x, cos, sin, kv_pool, layer, meta)
        return self.tp.all_reduce(self.o_proj(self.attend(q, k, v, kv_pool, layer, meta)))

    def rotated(self, x, cos, sin, kv_pool: torch.Tensor, layer: int, meta: AttentionMetadata):
        """``(q, k, v)`` of ``x``, q and k normalized (where the family has the norms) and turned by RoPE;
        on the fused kernel, which may write K and V into the pool itself, k and v None where it did."""
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.fused:  # the q/k norms (where the family has them), RoPE and the K/V write in one kernel
            qn, kn = self.q_norm, self.k_norm
            norms = (None, None, 0.0, False) if qn is None else (qn.weight, kn.weight, qn.eps, qn.unit_offset)
            slots = meta.kv_write_slots(kv_pool)  # None: the attention operator writes the K/V
            pool = None if slots is None else kv_pool
            heads = (self.num_heads, self.num_kv_heads)
            q, k = torch.ops.augur.fused_rope(qkv, cos, sin, *heads, *norms, pool, layer, slots)
            if slots is not None:
                k = v = None  # (in the pool already)
        else:
            q = q.view(T, self.num_heads, self.head_dim)
            k = k.view(T, self.num_kv_heads, self.head_dim)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q, k, v

    def set_kv_scale(self, which: str, scale: torch.Tensor) -> None:
        """A checkpoint's FP8 KV-cache scale for K or V (``which``): one for the layer, or one per KV head
        (this rank's are kept)."""
        scale = scale.detach().float().flatten()
        if scale.numel() == self.total_kv_heads:
            scale = scale[self.first_kv_head : self.first_kv_head + self.num_kv_heads]
        elif scale.numel() != 1:
            raise ValueError(
                f"a {which} scale of the KV cache has {scale.numel()} values: one or {self.total_kv_heads} expected"
            )
        if self.kv_scales is None:
            self.kv_scales = torch.ones(2, self.num_kv_heads, device=scale.device)
        self.kv_scales[0 if which == "k" else 1] = scale

    def attend(self, q, k, v, kv_pool: torch.Tensor, layer: int, meta: AttentionMetadata) -> torch.Tensor:
        """Paged attention with this layer's options (scale, window, soft-cap, sinks, KV scales): the
        call every family's attention makes once its q, k and v are ready."""
        return paged_attention(
            q, k, v, kv_pool, layer, meta, self.scale, sliding=self.sliding, softcap=self.softcap, sinks=self.sinks,
            kv_scales=self.kv_scales,
        )  # fmt: skip


class LlamaMLP(nn.Module):
    def __init__(self, config, bias: bool, act: str | None = None, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.intermediate_size = tp.split(config.intermediate_size, "MLP inner size")  # this rank's
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(self.intermediate_size, config.hidden_size, bias=bias)
        self.act_name = act or config.hidden_act
        self.act = activation(self.act_name)
        self.invariant = False  # on augur::invariant_act_mul (LlamaForCausalLM.use_invariant_ops)
        self.fused = False  # on augur::fused_act_mul (LlamaForCausalLM.use_fused_ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.invariant:
            inner = torch.ops.augur.invariant_act_mul(gate_up, self.act_name)
        elif self.fused:
            inner = torch.ops.augur.fused_act_mul(gate_up, self.act_name)
        else:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            inner = self.act(gate) * up
        return self.tp.all_reduce(self.down_proj(inner))


class LlamaDecoderLayer(nn.Module):
    """Attention and an MLP, each after its norm and added to the residual. ``mlp``: the feed-forward
    block when not Llama's dense one (a mixture of experts: engine/models/moe.py); ``attn``: the
    attention when not Llama's."""

    def __init__(
        self, config, layer_idx: int, qkv_bias: bool, o_bias: bool, qk_norm: bool, tp=SINGLE, mlp=None, attn=None
    ) -> None:
        super().__init__()
        self.self_attn = attn if attn is not None else LlamaAttention(config, layer_idx, qkv_bias, o_bias, qk_norm, tp)
        self.mlp = mlp if mlp is not None else LlamaMLP(config, bias=getattr(config, "mlp_bias", False), tp=tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.fused = False  # the residual sum and the second norm in one kernel (use_fused_ops)

    def forward(self, x, cos, sin, kv_pool, layer, meta, attn: bool = True, mlp: bool = True) -> torch.Tensor:
        if self.fused and attn and mlp:
            a = self.self_attn(self.input_layernorm(x), cos, sin, kv_pool, layer, meta)
            norm = self.post_attention_layernorm
            h, x = torch.ops.augur.fused_add_rms_norm(x, a, norm.weight, norm.eps, norm.unit_offset)
            return x + self.mlp(h)
        if attn:
            x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_pool, layer, meta)
        if mlp:
            x = x + self.mlp(self.post_attention_layernorm(x))
        return x


def use_fused_ops(model: nn.Module, on: bool = True) -> None:
    """Run ``model``'s small operators between the matrix products on fused GPU kernels
    (engine/models/fused.py): RoPE, the norms, the residual sum before a layer's second norm, the
    MLP's activation and product (SiLU and tanh-GELU; another activation stays eager). ``on=False``
    turns them back off (the step benchmark compares both)."""
    # (here, not at the top: it needs Triton) Importing it registers the augur::fused_* operators.
    from engine.models.fused import FUSED_ACTIVATIONS

    for module in model.modules():
        if isinstance(module, LlamaMLP) and module.act_name not in FUSED_ACTIVATIONS:
            continue
        if hasattr(module, "fused"):
            module.fused = on


def sliding_window_of(config, layer_idx: int) -> int | None:
    """The sliding window of one layer, or None for full attention."""
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return window


class LlamaForCausalLM(nn.Module):
    """Llama-architecture causal LM over a paged KV cache."""

    qk_norm = False
    rope_dtype: torch.dtype | None = None  # the RoPE rows' dtype (None: the model's; OLMo 2 turns in float32)
    # Every linear layer's weight reaches load_weights under the name checkpoint_name / weight_target
    # place it by: --quantization int4 / fp8 convert each as it arrives (engine/quant/streamed.py)
    streams_linear_weights = True
    batch_invariant = False  # on the batch-invariant operators (use_invariant_ops)

    def __init__(self, config, max_positions: int | None = None, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.vocab_shard = tp.split(config.vocab_size, "vocabulary")  # this rank's rows of the embedding and LM head
        qkv_bias, o_bias = self.attention_biases(config)
        self.embed_tokens = nn.Embedding(self.vocab_shard, config.hidden_size)
        self.layers = nn.ModuleList(
            self.decoder_layer(config, i, qkv_bias, o_bias, tp) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = None if self.tie_word_embeddings else nn.Linear(config.hidden_size, self.vocab_shard, bias=False)
        windows = {sliding_window_of(config, i) for i in range(config.num_hidden_layers)} - {None}
        if len(windows) > 1:
            raise ValueError(f"layers with different sliding windows are not supported: {sorted(windows)}")
        self.sliding_window: int | None = windows.pop() if windows else None
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)  # [max_positions, head_dim]
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self.init_buffers(max_positions or config.max_position_embeddings)

    def init_buffers(self, max_positions: int) -> None:
        """(Re)compute the non-persistent buffers, e.g. after construction on the meta device."""
        device = self.embed_tokens.weight.device
        if device.type == "meta":
            return
        cos, sin = rope_cos_sin(self.config, max_positions)
        self.rope_cos = cos.to(device)
        self.rope_sin = sin.to(device)

    def decoder_layer(self, config, i: int, qkv_bias: bool, o_bias: bool, tp: TensorParallel) -> nn.Module:
        """Layer ``i`` (a family whose layers differ, e.g. dense and mixture-of-experts, overrides this)."""
        return LlamaDecoderLayer(config, i, qkv_bias, o_bias, self.qk_norm, tp)

    @staticmethod
    def attention_biases(config) -> tuple[bool, bool]:
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv_caches: torch.Tensor,  # [num_layers, 2, num_slots, Hkv, D]
        skip: LayerSkip | None = None,
        hidden_layers: Sequence[int] = (),
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Returns the final-normed hidden states [T, hidden] and ``{layer: its output [T, hidden]}`` for
        each layer in ``hidden_layers``. ``skip`` leaves those attention / MLP sublayers out (a
        skipped attention writes no K/V: self-speculative drafts, which verification overwrites)."""
        x = self.embed(input_ids)
        rope = self.rope_at(positions, x.dtype)
        wanted = set(hidden_layers)
        captured: dict[int, torch.Tensor] = {}
        for i in range(self.num_layers):
            cos, sin = self.layer_rope(rope, i)
            if skip is None:
                x = self.layers[i](x, cos, sin, kv_caches, i, meta)
            elif i not in skip.attn or i not in skip.mlp:
                x = self.layers[i](x, cos, sin, kv_caches, i, meta, i not in skip.attn, i not in skip.mlp)
            if i in wanted:
                captured[i] = x
        return self.norm(x), captured

    def rope_at(self, positions: torch.Tensor, dtype: torch.dtype):
        """The rotary inputs of a forward at these positions: here the RoPE tables' rows ``[T, 1, D]`` in
        ``dtype``, ``(cos, sin)``, which every layer's attention takes (a family whose layers rotate by
        other tables, or whose attention takes more, overrides this and :meth:`layer_rope`)."""
        return rope_rows(self.rope_cos, self.rope_sin, positions, self.rope_dtype or dtype)

    def layer_rope(self, rope, i: int):
        """Layer ``i``'s ``(cos, sin)`` of what :meth:`rope_at` gave: here the one pair of every layer."""
        return rope

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings; sharded, each rank looks up the ids in its slice of the vocabulary
        (zeros for the others') and the ranks' rows are summed."""
        if self.tp.size == 1:
            return self.embed_tokens(input_ids)
        local = input_ids - self.tp.rank * self.vocab_shard
        mine = (local >= 0) & (local < self.vocab_shard)
        x = self.embed_tokens(torch.where(mine, local, 0))
        return self.tp.all_reduce(x * mine.unsqueeze(-1).to(x.dtype))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] → [N, vocab] float32
        if self.lm_head is not None:
            logits = self.lm_head(hidden)
        else:
            logits = torch.nn.functional.linear(hidden, self.embed_tokens.weight)
        return self.tp.gather_vocab(logits).float()

    def pack_for_cpu(self, layer: type[nn.Module] = PackedLinear) -> None:
        """Prepack every linear layer's weights (see ``engine.models.packed``) into ``layer``s; a tied
        output layer gets one over the embedding table."""
        pack_linears(self, layer)
        if self.lm_head is None:
            self.lm_head = layer(self.embed_tokens.weight, None)

    def use_invariant_ops(self) -> None:
        """Run on the batch-invariant operators (engine/models/invariant.py): every linear layer (the tied
        output layer too) on ``augur::invariant_linear``, the norms and the MLP's activation on theirs, an
        NF4 layer's product on the linear one (an int4 layer's kernel sums each output over K in order
        already). What is left of the forward is exactly rounded element by element."""
        self.pack_for_cpu(InvariantLinear)
        for module in self.modules():
            if hasattr(module, "invariant"):  # norms, MLPs, NF4 layers
                module.invariant = True
        self.batch_invariant = True

    def use_fused_ops(self) -> None:
        use_fused_ops(self)

    # -- weights ------------------------------------------------------------------------------------
    _fused = {  # checkpoint name piece → (our fused parameter, shard)
        ".q_proj.": (".qkv_proj.", "q"),
        ".k_proj.": (".qkv_proj.", "k"),
        ".v_proj.": (".qkv_proj.", "v"),
        ".gate_proj.": (".gate_up_proj.", 0),
        ".up_proj.": (".gate_up_proj.", 1),
    }

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face checkpoint tensors, fusing q/k/v and gate/up as they arrive. Each tensor
        goes where :meth:`weight_target` says (a whole parameter, or a slot of a fused one); every
        slot :meth:`expected_slots` lists must have arrived."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in self.take_kv_scales(weights):
            if "rotary_emb.inv_freq" in name:
                continue
            name = self.checkpoint_name(name)
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding serves as the output layer
            target, shard = self.weight_target(name)
            if target not in params:
                raise ValueError(f"unexpected weight in checkpoint: {name}")
            param = params[target]
            if shard is None:
                if param.shape != tensor.shape:
                    raise ValueError(
                        f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, model {tuple(param.shape)}"
                    )
                param.copy_(tensor)
            else:
                slot = self.weight_slot(target, param, shard)
                if slot.shape != tensor.shape:
                    raise ValueError(
                        f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, model {tuple(slot.shape)}"
                    )
                slot.copy_(tensor)
            loaded.add(f"{target}:{shard}")
        expected = set().union(*(self.expected_slots(pname) for pname in params))
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:3]}")

    def take_kv_scales(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """``weights`` without the FP8 KV-cache scales a checkpoint may carry, each given to its layer's
        attention (:meth:`LlamaAttention.set_kv_scale`); they serve ``--kv-cache-dtype fp8``."""
        for name, tensor in weights:
            found = _KV_SCALE.search(name)
            if found is None:
                yield name, tensor
            else:
                self.layers[int(found["layer"])].self_attn.set_kv_scale(found["kv"] or found["proj"], tensor)

    def checkpoint_name(self, name: str) -> str:
        """A checkpoint tensor's name in our module tree's terms (before fusing)."""
        return name.removeprefix("model.")

    def weight_target(self, name: str) -> tuple[str, object]:
        """(our parameter, its slot or None for all of it) for checkpoint tensor ``name``."""
        for piece, (fused, s) in self._fused.items():
            if piece in name:
                return name.replace(piece, fused), s
        return name, None

    def weight_slot(self, target: str, param: torch.Tensor, shard) -> torch.Tensor:
        """The part of fused parameter ``target`` that checkpoint slot ``shard`` fills."""
        return param.narrow(0, *self._shard_range(target, shard))

    def expected_slots(self, pname: str) -> set[str]:
        """The ``target:slot`` keys a complete checkpoint fills for parameter ``pname``."""
        if ".qkv_proj." in pname:
            return {f"{pname}:q", f"{pname}:k", f"{pname}:v"}
        if ".gate_up_proj." in pname:
            return {f"{pname}:0", f"{pname}:1"}
        return {f"{pname}:None"}

    def _shard_range(self, target: str, shard) -> tuple[int, int]:
        """(start, length) of slot ``shard`` in the fused parameter ``target``, from the module owning it
        (layers may differ: a dense MLP beside a mixture's shared expert)."""
        if shard in ("q", "k", "v"):
            attn = self.get_submodule(target.split(".qkv_proj.")[0])
            return {
                "q": (0, attn.q_size),
                "k": (attn.q_size, attn.kv_size),
                "v": (attn.q_size + attn.kv_size, attn.kv_size),
            }[shard]
        inter = self.get_submodule(target.split(".gate_up_proj.")[0]).intermediate_size
        return (shard * inter, inter)

    def checkpoint_slice(self, name: str) -> tuple[int, int, int] | str | None:
        """What of checkpoint tensor ``name`` this rank holds: ``(dim, start, length)``, ``"zeros"``
        (a row-parallel layer's bias, added once: rank 0 holds it, the others zeros) or None (all of it)."""
        if self.tp.size == 1:
            return None
        name = name.removeprefix("model.")
        if name in ("embed_tokens.weight", "lm_head.weight"):
            return 0, self.tp.rank * self.vocab_shard, self.vocab_shard
        return layer_slice(name, self.layers[0].self_attn, self.layers[0].mlp, self.tp.rank)


def layer_slice(name: str, attn: LlamaAttention, mlp: LlamaMLP, r: int) -> tuple[int, int, int] | str | None:
    """What of a decoder layer's checkpoint tensor ``name`` rank ``r`` holds (see ``checkpoint_slice``),
    given a layer of this rank's shapes (every layer of a model has the same)."""
    if _KV_SCALE.search(name):
        return None  # (a KV-cache scale: every rank reads all of it, and keeps its heads')
    weight = name.endswith(".weight")
    if ".q_proj." in name:
        return 0, r * attn.q_size, attn.q_size
    if ".k_proj." in name or ".v_proj." in name:
        return 0, attn.first_kv_head * attn.head_dim, attn.kv_size
    if ".gate_proj." in name or ".up_proj." in name:
        return 0, r * mlp.intermediate_size, mlp.intermediate_size
    if ".o_proj." in name:
        return (1, r * attn.q_size, attn.q_size) if weight else None if r == 0 else "zeros"
    if ".down_proj." in name:
        return (1, r * mlp.intermediate_size, mlp.intermediate_size) if weight else None if r == 0 else "zeros"
    return None


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_biases(config) -> tuple[bool, bool]:
        return True, False  # biases on q/k/v only


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True


class MistralForCausalLM(LlamaForCausalLM):
    pass


class SeedOssForCausalLM(LlamaForCausalLM):
    """Seed-OSS (ByteDance's Seed-OSS-36B): Llama's decoder, the output projection's bias set apart from
    q/k/v's (``attention_out_bias``: none in the released model, where q/k/v have theirs)."""

    @staticmethod
    def attention_biases(config) -> tuple[bool, bool]:
        return bool(getattr(config, "attention_bias", True)), bool(getattr(config, "attention_out_bias", False))
