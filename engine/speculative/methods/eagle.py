"""EAGLE-style draft head (``--speculative-method eagle --draft-model DIR``): one decoder layer that
drafts from the target's own features, with a small KV cache of its own and EAGLE-2 dynamic trees.

The head (EAGLE-3's shape) fuses the target's hidden states at a low, a middle and a high layer
(``fc``: ``[hidden, n * target_hidden]``; EAGLE-1's single top feature is the case ``n = 1``) into one
feature ``f``. Its decoder layer attends over ``concat(norm(embed(token)), norm(f))`` and adds the
result to ``f``; the layer's output (before the final norm) is the head's own hidden state ``g``,
and ``lm_head(norm(g))`` predicts the next token, over the target's vocabulary or a reduced draft
vocabulary (``d2t``: draft id → target id offset; logits outside it are ``-inf``).

Row ``t`` of the head pairs the target's features at position ``t`` with the token that followed,
``x[t + 1]``, and predicts ``x[t + 2]``: the head's rows lag the target's tokens by one (the
draft-model machinery's ``shift``). Each step the head *catches up* over the rows the target made
final since its last step (the accepted tokens, with the verify forward's features), whose last row
pairs the target's last feature with the root and gives level 1; deeper levels feed each drafted
token with its parent's ``g`` in place of a target feature (its ancestors are in the head's KV, its
context's rows too). Chains, sampled trees and greedy EAGLE-2 trees (expand the best nodes by
cumulative draft log-probability, keep the best ``budget``) are ``engine/speculative/levels.py``'s.
Rows fed during drafting are never kept: the next catch-up rewrites them from the target's features.

The target features a sequence has not yet caught up on wait on the device
(``engine/speculative/features.py``, at most :data:`MAX_PENDING_ROWS` per sequence). The last row of
a reused prefix-cache block was computed with the token that followed it when it was written.

Checkpoints load in EAGLE-3's published layout (``config.json`` with ``draft_vocab_size``;
``model.safetensors`` or ``pytorch_model.bin`` with ``fc.weight``, ``midlayer.*``, ``norm.weight``,
``lm_head.weight``, ``d2t``, ``t2d``) and in the ``speculators`` format (``speculators_model_type``
``eagle3``, ``transformer_layer_config``, ``eagle_aux_hidden_state_layer_ids``, ``layers.0.*``).
Layer ids are Hugging Face ``hidden_states`` indices (``j``: the output of decoder layer ``j - 1``);
the default is EAGLE-3's ``(2, L // 2, L - 3)``. ``augur train-draft --method eagle`` writes the
EAGLE-3 layout. A wrong shape or a missing tensor is a start-up error that names it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig

from engine.models.llama import LlamaAttention, LlamaMLP, RMSNorm, layer_slice, rope_cos_sin, rope_rows, use_fused_ops
from engine.parallel import SINGLE, TensorParallel
from engine.request.sequence import Sequence
from engine.runner.loader import (
    check_state,
    fused_ops_serve,
    read_state_file,
    read_tensor,
    resolve_model_path,
    take_slice,
)
from engine.runner.model_runner import ForwardBatch, ForwardChunk, ModelRunner
from engine.sampling.tree import DraftTree
from engine.speculative.early_stop import early_stop_for
from engine.speculative.features import PendingFeatures
from engine.speculative.methods.draft_model import DraftModelProposer
from engine.speculative.proposer import CostShape

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
MAX_PENDING_ROWS = 1024  # target feature rows kept per sequence until its head catches up


class EagleLayer(nn.Module):
    """The head's decoder layer: attention over ``[norm(embedding); norm(feature)]``, residual on the feature."""

    def __init__(self, config, norm_before_residual: bool, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        h = config.hidden_size
        bias = bool(getattr(config, "attention_bias", False))
        self.self_attn = LlamaAttention(config, 0, bias, bias, qk_norm=False, tp=tp)
        attn = self.self_attn
        attn.qkv_proj = nn.Linear(2 * h, attn.q_size + 2 * attn.kv_size, bias=bias)
        self.mlp = LlamaMLP(config, bias=bool(getattr(config, "mlp_bias", False)), tp=tp)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.norm_before_residual = norm_before_residual

    def attention_input(self, embeds: torch.Tensor, feature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention's input and the residual it is added to."""
        normed = self.hidden_norm(feature)
        return torch.cat([self.input_layernorm(embeds), normed], -1), normed if self.norm_before_residual else feature

    def finish(self, attn_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The MLP half: the layer's output ``g`` (before the final norm)."""
        x = residual + attn_out
        return x + self.mlp(self.post_attention_layernorm(x))


class EagleHead(nn.Module):
    """The EAGLE head as a model the runner can drive (one layer, its own KV pool). Sharded (``tp`` of
    size N, ``--draft-tensor-parallel-size N``) as the target's layers are: its layer by heads and by
    the MLP's inner dimension, its output layer by draft vocabulary (the logits gathered); ``fc`` and
    the norms whole; it embeds with the target's own sharded embedding (``embed``: the target model's
    ``embed``)."""

    num_layers = 1
    sliding_window = None

    def __init__(
        self,
        config: LlamaConfig,  # the layer's shape; vocab_size is the target's
        num_features: int,
        target_hidden: int,
        draft_vocab: int,
        embed,  # the target's embedding (unless the checkpoint brings its own): a table, or a sharded model's embed
        max_positions: int,
        norm_before_residual: bool = False,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        h = config.hidden_size
        self.config, self.tp = config, tp
        self.vocab_size, self.draft_vocab = config.vocab_size, draft_vocab
        self.embed_tokens = embed
        self.fc = nn.Linear(num_features * target_hidden, h, bias=False)
        self.layers = nn.ModuleList([EagleLayer(config, norm_before_residual, tp)])
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.draft_vocab_shard = tp.split(draft_vocab, "draft vocabulary")
        self.lm_head = nn.Linear(h, self.draft_vocab_shard, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool))
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self.register_buffer("target_ids", torch.empty(0, dtype=torch.long), persistent=False)
        self.max_positions = max_positions
        self.init_buffers()

    def init_buffers(self) -> None:
        """Rotary tables, and the target id of each draft id (after ``d2t`` is loaded)."""
        cos, sin = rope_cos_sin(self.config, self.max_positions)
        dev = self.fc.weight.device
        self.rope_cos, self.rope_sin = cos.to(dev), sin.to(dev)
        self.target_ids = torch.arange(self.draft_vocab, device=dev) + self.d2t.to(dev)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_rows(self.rope_cos, self.rope_sin, positions, dtype)

    def forward(self, input_ids, positions, meta, kv_caches, skip=None, hidden_layers=(), hidden_in=None):
        """Rows of ``(token, feature)``: a fused target feature (catch-up) or a parent's ``g`` (drafting);
        returns ``norm(g)`` and ``{0: g}``."""
        e = self.embed_tokens(input_ids)
        feature = hidden_in.to(e.dtype) if hidden_in is not None else torch.zeros_like(e)
        cos, sin = self.rope(positions, e.dtype)
        layer = self.layers[0]
        x, residual = layer.attention_input(e, feature)
        g = layer.finish(layer.self_attn(x, cos, sin, kv_caches, 0, meta), residual)
        return self.norm(g), {0: g}

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` → ``[N, target vocab]`` float32 (ids outside the draft vocabulary: -inf)."""
        logits = self.tp.gather_vocab(self.lm_head(hidden)).float()
        if self.draft_vocab == self.vocab_size:
            return logits  # d2t is all zeros: the draft ids are the target's
        wide = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        wide[:, self.target_ids] = logits
        return wide

    # -- the published layout -----------------------------------------------------------------------
    def checkpoint_shapes(self, with_embed: bool = False) -> dict[str, tuple[int, ...]]:
        """EAGLE-3's tensor names and the shapes this head needs (whole, as the checkpoint has them)."""
        cfg, h = self.config, self.config.hidden_size
        head_dim = self.layers[0].self_attn.head_dim
        q_size = cfg.num_attention_heads * head_dim
        kv_size = (cfg.num_key_value_heads or cfg.num_attention_heads) * head_dim
        inter = cfg.intermediate_size
        shapes = {
            "fc.weight": tuple(self.fc.weight.shape),
            "midlayer.self_attn.q_proj.weight": (q_size, 2 * h),
            "midlayer.self_attn.k_proj.weight": (kv_size, 2 * h),
            "midlayer.self_attn.v_proj.weight": (kv_size, 2 * h),
            "midlayer.self_attn.o_proj.weight": (h, q_size),
            "midlayer.mlp.gate_proj.weight": (inter, h),
            "midlayer.mlp.up_proj.weight": (inter, h),
            "midlayer.mlp.down_proj.weight": (h, inter),
            "midlayer.hidden_norm.weight": (h,),
            "midlayer.input_layernorm.weight": (h,),
            "midlayer.post_attention_layernorm.weight": (h,),
            "norm.weight": (h,),
            "lm_head.weight": (self.draft_vocab, h),
            "d2t": (self.draft_vocab,),
            "t2d": (self.vocab_size,),
        }
        for _, names in self._bias_parts():  # a bias has its weight's rows
            shapes.update({n: (shapes[n.removesuffix(".bias") + ".weight"][0],) for n in names})
        if with_embed:
            shapes["embed_tokens.weight"] = (self.vocab_size, h)
        return shapes

    def _bias_parts(self) -> list[tuple[nn.Parameter, list[str]]]:
        """The layer's biases, where its config has them (``attention_bias``, ``mlp_bias``): each fused
        parameter with the checkpoint names of its parts, in order."""
        attn, mlp = self.layers[0].self_attn, self.layers[0].mlp
        a, m = "midlayer.self_attn.", "midlayer.mlp."
        parts = [
            (attn.qkv_proj.bias, [a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"]),
            (attn.o_proj.bias, [a + "o_proj.bias"]),
            (mlp.gate_up_proj.bias, [m + "gate_proj.bias", m + "up_proj.bias"]),
            (mlp.down_proj.bias, [m + "down_proj.bias"]),
        ]
        return [(param, names) for param, names in parts if param is not None]

    def checkpoint_slice(self, name: str) -> tuple[int, int, int] | str | None:
        """What of checkpoint tensor ``name`` this rank holds (as ``LlamaForCausalLM.checkpoint_slice``)."""
        if self.tp.size == 1:
            return None
        if name == "lm_head.weight":
            return 0, self.tp.rank * self.draft_vocab_shard, self.draft_vocab_shard
        if not name.startswith("midlayer."):
            return None  # fc, the norms, d2t and t2d, a checkpoint's own embedding: whole on every rank
        return layer_slice(name, self.layers[0].self_attn, self.layers[0].mlp, self.tp.rank)

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """The head's tensors under EAGLE-3's names (q/k/v and gate/up unfused)."""
        layer = self.layers[0]
        attn = layer.self_attn
        q, k, v = attn.qkv_proj.weight.split([attn.q_size, attn.kv_size, attn.kv_size])
        gate, up = layer.mlp.gate_up_proj.weight.chunk(2)
        state = {
            "fc.weight": self.fc.weight,
            "midlayer.self_attn.q_proj.weight": q,
            "midlayer.self_attn.k_proj.weight": k,
            "midlayer.self_attn.v_proj.weight": v,
            "midlayer.self_attn.o_proj.weight": attn.o_proj.weight,
            "midlayer.mlp.gate_proj.weight": gate,
            "midlayer.mlp.up_proj.weight": up,
            "midlayer.mlp.down_proj.weight": layer.mlp.down_proj.weight,
            "midlayer.hidden_norm.weight": layer.hidden_norm.weight,
            "midlayer.input_layernorm.weight": layer.input_layernorm.weight,
            "midlayer.post_attention_layernorm.weight": layer.post_attention_layernorm.weight,
            "norm.weight": self.norm.weight,
            "lm_head.weight": self.lm_head.weight,
            "d2t": self.d2t,
            "t2d": self.t2d,
        }
        for param, names in self._bias_parts():
            split = (
                param.split([attn.q_size, attn.kv_size, attn.kv_size]) if len(names) == 3 else param.chunk(len(names))
            )
            state.update(zip(names, split))
        return {name: t.detach().contiguous().cpu() for name, t in state.items()}

    @torch.no_grad()
    def load_checkpoint_state(self, state: dict[str, torch.Tensor]) -> None:
        layer = self.layers[0]
        attn = layer.self_attn
        cat = torch.cat
        mlp = "midlayer.mlp."
        params = {
            "fc.weight": (self.fc.weight, state["fc.weight"]),
            "qkv": (attn.qkv_proj.weight, cat([state[f"midlayer.self_attn.{x}_proj.weight"] for x in "qkv"])),
            "o": (attn.o_proj.weight, state["midlayer.self_attn.o_proj.weight"]),
            "gate_up": (
                layer.mlp.gate_up_proj.weight,
                cat([state[mlp + "gate_proj.weight"], state[mlp + "up_proj.weight"]]),
            ),
            "down": (layer.mlp.down_proj.weight, state[mlp + "down_proj.weight"]),
            "hn": (layer.hidden_norm.weight, state["midlayer.hidden_norm.weight"]),
            "in": (layer.input_layernorm.weight, state["midlayer.input_layernorm.weight"]),
            "post": (layer.post_attention_layernorm.weight, state["midlayer.post_attention_layernorm.weight"]),
            "norm": (self.norm.weight, state["norm.weight"]),
            "lm_head": (self.lm_head.weight, state["lm_head.weight"]),
            "d2t": (self.d2t, state["d2t"]),
            "t2d": (self.t2d, state["t2d"]),
        }
        for param, names in self._bias_parts():
            params[names[0]] = (param, cat([state[n] for n in names]))
        if "embed_tokens.weight" in state:
            self.embed_tokens = nn.Embedding(*state["embed_tokens.weight"].shape, device=self.fc.weight.device)
            params["embed"] = (self.embed_tokens.weight, state["embed_tokens.weight"])
        for param, value in params.values():
            param.copy_(value.to(param.dtype))
        self.init_buffers()

    def save(self, path: str | Path, aux_layer_ids: list[int], extra: dict | None = None) -> None:
        """Write EAGLE-3's layout: ``config.json`` and ``model.safetensors``."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        save_file(self.checkpoint_state(), path / WEIGHT_FILES[0], metadata={"format": "pt"})
        cfg = self.config.to_dict()
        cfg.update(
            architectures=["LlamaForCausalLMEagle3"],
            num_hidden_layers=1,
            draft_vocab_size=self.draft_vocab,
            target_hidden_size=self.fc.weight.shape[1] // len(aux_layer_ids),
            norm_before_residual=self.layers[0].norm_before_residual,
            eagle_config={"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids), "use_aux_hidden_state": True},
            **(extra or {}),
        )
        (path / "config.json").write_text(json.dumps(cfg, indent=2, default=str) + "\n")


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's default feature layers (Hugging Face ``hidden_states`` indices): low, middle, high."""
    return [2, num_layers // 2, num_layers - 3]


def read_eagle_config(path: Path, target_config) -> dict:
    """What a directory in either published layout says: the layer's config, the draft vocabulary,
    the feature layers (Hugging Face indices), the target hidden size and the residual's norm."""
    cfg = json.loads((path / "config.json").read_text())
    L = target_config.num_hidden_layers
    if "speculators_model_type" in cfg:
        kind = cfg["speculators_model_type"]
        if kind != "eagle3":
            raise ValueError(f"{path}: speculators_model_type {kind!r} is not supported (Augur loads 'eagle3')")
        if not isinstance(cfg.get("transformer_layer_config"), dict):
            raise ValueError(f"{path}/config.json: a speculators checkpoint needs transformer_layer_config")
        layer = dict(cfg["transformer_layer_config"])
        residual_norm = bool(cfg.get("norm_before_residual", True))  # the speculators default
        ids = cfg.get("eagle_aux_hidden_state_layer_ids")
        if cfg.get("norm_before_fc"):
            raise ValueError(f"{path}: norm_before_fc is not supported")
    else:
        layer = cfg
        residual_norm = bool(cfg.get("norm_before_residual", False))
        ids = cfg.get("eagle_aux_hidden_state_layer_ids") or (cfg.get("eagle_config") or {}).get(
            "eagle_aux_hidden_state_layer_ids"
        )
    ids = [int(j) for j in (ids or default_aux_layer_ids(L))]
    bad = [j for j in ids if not 1 <= j <= L]
    if bad:
        raise ValueError(f"{path}: feature layers {bad} outside 1..{L} (the target's hidden_states indices)")
    vocab = target_config.vocab_size
    draft_vocab = int(cfg.get("draft_vocab_size") or layer.get("draft_vocab_size") or layer.get("vocab_size") or vocab)
    keep = {k: v for k, v in layer.items() if k not in ("architectures", "auto_map", "torch_dtype", "dtype")}
    keep.update(vocab_size=vocab, num_hidden_layers=1)
    return {
        "layer": LlamaConfig(**keep),
        "draft_vocab": draft_vocab,
        "aux_layer_ids": ids,
        "target_hidden": int(cfg.get("target_hidden_size") or target_config.hidden_size),
        "norm_before_residual": residual_norm,
    }


def is_eagle_dir(path: Path) -> bool:
    f = Path(path) / "config.json"
    if not f.is_file():
        return False
    cfg = json.loads(f.read_text())
    archs = " ".join(cfg.get("architectures") or [])
    return cfg.get("speculators_model_type") == "eagle3" or "Eagle3" in archs or "eagle_config" in cfg


def _read_weights(path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    file, raw = read_state_file(path, WEIGHT_FILES)
    state = {}
    for name, t in raw.items():  # vLLM-style prefixes and the speculators layer name are aliases
        name = name.removeprefix("model.")
        state[name.replace("layers.0.", "midlayer.", 1) if name.startswith("layers.0.") else name] = t
    return file, state


def load_eagle(path: str | Path, target_config, embed, dtype, device, max_positions: int, tp: TensorParallel = SINGLE):
    """The head and its feature layers (Hugging Face indices) from a directory in either published
    layout; under ``tp``, this rank's shard of it (``embed``: the sharded target's ``embed``)."""
    path = Path(path)
    info = read_eagle_config(path, target_config)
    file, state = _read_weights(path)
    if info["target_hidden"] != target_config.hidden_size:
        raise ValueError(
            f"{path}: target_hidden_size {info['target_hidden']} does not match the target's hidden size "
            f"{target_config.hidden_size}"
        )
    head = EagleHead(
        info["layer"],
        len(info["aux_layer_ids"]),
        info["target_hidden"],
        info["draft_vocab"],
        embed,
        max_positions,
        info["norm_before_residual"],
        tp,
    ).to(device=device)
    if info["draft_vocab"] == target_config.vocab_size:  # a full vocabulary needs no mapping
        state.setdefault("d2t", torch.zeros(info["draft_vocab"], dtype=torch.long))
    if "t2d" not in state and "d2t" in state:  # t2d only restates d2t (which target ids have a draft id)
        t2d = torch.zeros(target_config.vocab_size, dtype=torch.bool)
        ids = (torch.arange(len(state["d2t"])) + state["d2t"].long()).clamp(0, target_config.vocab_size - 1)
        state["t2d"] = t2d.index_fill_(0, ids, True)
    want = head.checkpoint_shapes(with_embed="embed_tokens.weight" in state)
    why = (
        f"target hidden size {target_config.hidden_size}, vocabulary {target_config.vocab_size}, "
        f"{len(info['aux_layer_ids'])} feature layers, draft vocabulary {info['draft_vocab']}"
    )
    check_state(file, state, want, why)
    d2t = state["d2t"].long()
    ids = torch.arange(len(d2t)) + d2t
    if len(d2t) and (int(ids.min()) < 0 or int(ids.max()) >= target_config.vocab_size):
        raise ValueError(f"{file}: d2t maps draft ids outside the target's vocabulary ({target_config.vocab_size})")
    head.load_checkpoint_state({name: take_slice(t, head.checkpoint_slice(name)) for name, t in state.items()})
    if fused_ops_serve(torch.device(device), dtype):  # as the target's layers (engine/models/fused.py)
        use_fused_ops(head)
    return head.to(dtype=dtype).eval().requires_grad_(False), info["aux_layer_ids"]


def eagle_shard(tp: TensorParallel, device, target: ModelRunner, draft_model: str, max_positions: int):
    """A rank's shard of the head (``engine.runner.parallel.open_sharded``'s factory), embedding
    through the rank's own shard of the target's embedding."""
    path = resolve_model_path(draft_model)  # (in this host's cache)
    head, _ = load_eagle(path, target.hf_config, target.model.embed, target.dtype, device, max_positions, tp)
    return head, head.config, target.dtype


def whole_embedding(model_path: Path, shard: nn.Embedding, vocab_size: int) -> nn.Embedding:
    """The target's whole embedding table, read from its checkpoint, in the class of a rank's shard
    (Gemma's scales its output): what an EAGLE head embeds with beside a tensor-parallel target, whose
    rank 0 holds only its slice of the vocabulary."""
    weight = read_tensor(model_path, "model.embed_tokens.weight")
    table = type(shard)(vocab_size, shard.embedding_dim, device=shard.weight.device, dtype=shard.weight.dtype)
    with torch.no_grad():
        table.weight.copy_(weight)
    return table.requires_grad_(False)


class EagleProposer(DraftModelProposer):
    method = "eagle"
    has_language_model = False  # the head reads the target's features: no language model on its own
    cost = CostShape(kind="eagle")  # a catch-up forward, then one per level, like a draft model
    shift = 1
    state_layers = (0,)
    fuses_chains = False  # each level feeds the head's own state back

    def __init__(self, runner: ModelRunner, aux_layers: tuple[int, ...], target_vocab: int, eos_token_ids, tree,
                 topk=2, budget=16, catch_up_budget=2048, early_stop=None) -> None:  # fmt: skip
        super().__init__(runner, target_vocab, eos_token_ids, tree, topk, budget, catch_up_budget, early_stop)
        self.head: EagleHead = runner.model
        self.hidden_layers = aux_layers  # target layers whose outputs the head fuses
        self.draft_vocab_size = target_vocab  # it embeds target ids with the target's table
        self._pending = PendingFeatures(MAX_PENDING_ROWS)

    @classmethod
    def build(cls, config, target: ModelRunner, *, tokenizer, eos_token_ids) -> EagleProposer:
        if not config.draft_model:
            raise ValueError("speculative method 'eagle' needs --draft-model DIR (an EAGLE-3 head)")
        path = resolve_model_path(config.draft_model)
        max_positions = target.model.rope_cos.shape[0]
        runner_kwargs = dict(
            block_size=config.block_size, compile=target.compiled, attention_backend=target.attention_backend,
            freeze=False,  # its levels run a row or two each
            cuda_graph_max_seqs=target.cuda_graph_max_seqs, kv_cache_dtype=target.kv_cache_dtype,
        )  # fmt: skip
        if config.draft_tensor_parallel_size > 1:  # sharded like the target, over its ranks
            from engine.runner.parallel import open_sharded

            runner = open_sharded(
                target, "EAGLE head", eagle_shard, (config.draft_model, max_positions), **runner_kwargs
            )
            ids = read_eagle_config(path, target.hf_config)["aux_layer_ids"]
        else:
            embed = target.model.embed_tokens
            if target.model.tp.size > 1:  # a sharded target: the head gets a whole table of its own on rank 0
                embed = whole_embedding(resolve_model_path(config.model), embed, target.vocab_size)
            head, ids = load_eagle(path, target.hf_config, embed, target.dtype, target.device, max_positions)
            runner = ModelRunner(head, head.config, target.device, target.dtype, **runner_kwargs)
        return cls.around(runner, tuple(j - 1 for j in ids), config, target, eos_token_ids)  # (decoder layer j - 1's)

    @classmethod
    def around(cls, runner: ModelRunner, layers: tuple[int, ...], config, target: ModelRunner, eos_token_ids):
        """The proposer around a built head, reading the outputs of the target's decoder ``layers``."""
        stop = early_stop_for(config, default=None)
        tree, topk, budget = config.spec_tree_topk > 1, config.spec_tree_topk, config.spec_tree_budget
        return cls(
            runner, layers, target.vocab_size, eos_token_ids, tree, topk, budget, config.max_num_batched_tokens, stop
        )

    @classmethod
    def claims(cls, path: Path) -> bool:
        return is_eagle_dir(path)

    # -- the target's features, until the head catches up on them ------------------------------
    def on_computed(self, seq: Sequence, start: int, hidden: dict[int, torch.Tensor]) -> None:
        self._pending.add(seq.seq_id, start, torch.cat([hidden[layer] for layer in self.hidden_layers], -1))

    def _skip_cached_prefix(self, seq: Sequence) -> None:
        super()._skip_cached_prefix(seq)
        first = self._pending.first(seq.seq_id, seq.draft_num_computed)
        seq.draft_num_computed = max(seq.draft_num_computed, first)  # rows before have no features left

    def _catch_up_state(self, seq: Sequence, start: int, n: int) -> torch.Tensor:
        return self._pending.take(seq.seq_id, start, n, "EAGLE head")

    def _forward(self, batch: ForwardBatch, chunks: list[ForwardChunk], input_ids=None, hidden_in=None):
        if input_ids is None and hidden_in is not None:  # a catch-up: fuse the target's features
            hidden_in = self.head.fc(hidden_in.to(self.head.fc.weight.dtype))
        return super()._forward(batch, chunks, input_ids, hidden_in)

    def warmup(self) -> None:
        """With graphs, capture the head's forward as the step calls it (with features)."""
        self.runner.capture_graphs(self.state_layers, features=self.head.config.hidden_size)

    def warm_compiled(self, view) -> None:
        """Compile the head's forward as the step calls it: with features, its tokens from the batch
        (catch-up) or still on the device (draft levels)."""
        runner = view(self.runner)
        h = self.head.config.hidden_size
        for n in (1, 2) if runner.compiled else ():
            chunks = [ForwardChunk([0] * n, 0, list(range(-(-n // runner.block_size))), n)]
            batch = runner.prepare(chunks)
            feats = torch.zeros(n, h, dtype=runner.dtype, device=runner.device)
            runner.execute(batch, hidden_layers=self.state_layers, hidden_in=feats)
            runner.execute(batch, input_ids=batch.input_ids, hidden_layers=self.state_layers, hidden_in=feats)

    # -- lifecycle ------------------------------------------------------------------------------
    def on_verified(self, seq: Sequence, tree: DraftTree, accepted: list[int]) -> None:
        # Rows fed while drafting carried the head's own g, not the target's feature: the next
        # catch-up recomputes the accepted ones.
        self.observe_acceptance(seq, tree, accepted)
        self._written.pop(seq.seq_id, None)

    def on_fork(self, parent: Sequence, child: Sequence) -> None:
        super().on_fork(parent, child)
        self._pending.fork(parent.seq_id, child.seq_id)

    def on_preempt(self, seq: Sequence) -> None:
        super().on_preempt(seq)
        self._pending.drop(seq.seq_id)

    def on_free(self, seq: Sequence) -> None:
        super().on_free(seq)
        self._pending.drop(seq.seq_id)
