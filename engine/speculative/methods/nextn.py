"""The checkpoint's own next-token prediction layer as the drafter (``--speculative-method nextn``):
the multi-token-prediction (MTP) layer that GLM-4.5, 4.6 and 4.7, DeepSeek-V3 (R1, V3.1) and GLM-4.7-Flash
ship past their decoder's layers (``num_nextn_predict_layers``), which SGLang drafts with as ``NEXTN``
and vLLM as ``mtp``.

The layer is DeepSeek-V3's MTP module. Its row ``t`` fuses the target's final (normed) hidden state at
position ``t`` with the embedding of the token that followed, ``x[t + 1]``::

    m = eh_proj([enorm(embed(x[t + 1])); hnorm(h[t])])

runs one decoder layer of the target's own kind over the rows (its attention over a small KV cache of
its own, latent attention in DeepSeek-V3's architecture; a mixture of experts like the target's), and
predicts ``x[t + 2]`` with ``lm_head(norm(g))`` (``norm``: the checkpoint's ``shared_head.norm``). A
deeper draft level feeds the layer's own output ``g`` in place of ``h``, through the same layer (as
SGLang and vLLM chain one layer; a checkpoint with more such layers drafts with its first).

Everything around the layer is the EAGLE head's (:mod:`.eagle`): row ``t`` pairs the target's state at
``t`` with token ``t + 1``, each step catches up over the rows the target made final (the verify
forward's states of the accepted tokens), deeper levels feed the parent's ``g``, and chains, sampled
trees and greedy EAGLE-2 trees verify as every model drafter's do. This file is the layer and its
loading: from the target's own checkpoint (or ``--draft-model DIR`` holding one in the same layout),
by the family's own loader, so that a quantized checkpoint, ``--quantization``, tensor-parallel slices
(the layer is always sharded like the target), the CPU's packed layers and the batch-invariant
operators serve it as they serve the target's layers. The layer's copies of the embedding and the
output layer (``embed_tokens``, ``shared_head.head``) are not read: it embeds and predicts with the
target's own tables, as SGLang does (memory: two vocabulary-sized tables).
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import torch
from torch import nn

from engine.models.llama import LlamaForCausalLM, RMSNorm, rope_rows
from engine.models.packed import PackedLinear, pack_linears
from engine.parallel import SINGLE, TensorParallel
from engine.runner.loader import checkpoint_keys, load_model, resolve_model_path
from engine.runner.model_runner import ForwardBatch, ForwardChunk, ModelRunner
from engine.speculative.methods.eagle import EagleProposer

# the layer's own tensors past its decoder layer's (checkpoint name after "model.layers.{L}.") -> ours
EXTRAS = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "shared_head.norm.weight": "norm.weight",
}
SHARED = ("embed_tokens.weight", "shared_head.head.weight")  # its copies of the target's tables: not read


class NextNLayer:
    """Mixed in before a family's model class (:func:`nextn_class`): that family's prediction layer
    ``model.layers.{num_hidden_layers}`` as a one-layer model the runner drives, loaded by the family's
    own ``load_weights`` (its checkpoint names mapped to a one-layer model's: :meth:`local`)."""

    sliding_window = None  # (the families with such a layer have none)

    def __init__(self, config, max_positions: int | None = None, tp: TensorParallel = SINGLE) -> None:
        nn.Module.__init__(self)
        self.config, self.tp = config, tp
        self.first = config.num_hidden_layers  # the layer's index in the checkpoint
        h, eps = config.hidden_size, config.rms_norm_eps
        self.vocab_shard = tp.split(config.vocab_size, "vocabulary")
        qkv_bias, o_bias = self.attention_biases(config)
        self.layers = nn.ModuleList([self.decoder_layer(config, self.first, qkv_bias, o_bias, tp)])
        self.enorm, self.hnorm, self.norm = RMSNorm(h, eps), RMSNorm(h, eps), RMSNorm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.embed_tokens = nn.Embedding(0, h)  # the target's, once shared (share)
        self.lm_head = None
        self.target_norm: nn.Module | None = None
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self.init_buffers(max_positions or config.max_position_embeddings)

    def share(self, target: nn.Module) -> None:
        """Embed and predict with ``target``'s own tables (a rank's shards, under tensor parallelism),
        and norm its hidden states with its final norm."""
        self.embed_tokens, self.lm_head, self.target_norm = target.embed_tokens, target.lm_head, target.norm

    def forward(self, input_ids, positions, meta, kv_caches, skip=None, hidden_layers=(), hidden_in=None):
        """Rows of ``(token, state)``: the target's final-normed state (catch-up) or a parent's ``g``
        (drafting); returns ``norm(g)`` and ``{0: g}``."""
        e = self.embed(input_ids)
        state = hidden_in.to(e.dtype) if hidden_in is not None else torch.zeros_like(e)
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(state)], -1))
        cos, sin = rope_rows(self.rope_cos, self.rope_sin, positions, x.dtype)
        g = self.layers[0](x, cos, sin, kv_caches, 0, meta)
        return self.norm(g), {0: g}

    # -- the checkpoint, as the family reads it ---------------------------------------------------------
    def local(self, name: str) -> str:
        """A checkpoint name of the layer as a one-layer model's (``model.layers.0.*``, or one of
        :data:`EXTRAS`); other names as they are."""
        prefix = f"model.layers.{self.first}."
        if not name.startswith(prefix):
            return name
        rest = name.removeprefix(prefix)
        return "model." + EXTRAS[rest] if rest in EXTRAS else "model.layers.0." + rest

    def checkpoint_skips(self, name: str) -> bool:
        prefix = f"model.layers.{self.first}."
        return not name.startswith(prefix) or name.removeprefix(prefix) in SHARED

    def checkpoint_name(self, name: str) -> str:
        return super().checkpoint_name(self.local(name))

    def checkpoint_slice(self, name: str):
        return super().checkpoint_slice(self.local(name))

    def take_kv_scales(self, weights):
        return super().take_kv_scales((self.local(name), t) for name, t in weights)

    def pack_for_cpu(self, layer: type[nn.Module] = PackedLinear) -> None:
        """The layer's own linears packed; the output layer is the target's, packed with it."""
        pack_linears(self, layer)

    def expected_slots(self, pname: str) -> set[str]:
        return set() if pname.startswith("embed_tokens.") else super().expected_slots(pname)


@functools.cache
def nextn_class(family: type) -> type:
    """The prediction layer of ``family``'s checkpoints as a model class."""
    return type(f"{family.__name__}NextN", (NextNLayer, family), {})


def check_nextn(path: Path, config, family: type) -> None:
    """A start-up error where the target has no prediction layer this file can read."""
    layers = int(getattr(config, "num_nextn_predict_layers", 0) or 0)
    if layers < 1:
        raise ValueError(
            f"speculative method 'nextn' drafts with the checkpoint's own multi-token-prediction layer, and "
            f"{config.architectures[0] if config.architectures else 'this model'} has none "
            "(its config.json has no num_nextn_predict_layers)"
        )
    if not issubclass(family, LlamaForCausalLM):
        raise ValueError(f"speculative method 'nextn' is not built for {family.__name__}")
    prefix = f"model.layers.{config.num_hidden_layers}."
    keys = set(checkpoint_keys(path))
    missing = [prefix + n for n in EXTRAS if prefix + n not in keys]
    if missing:
        raise ValueError(
            f"{path}: the checkpoint has no multi-token-prediction layer {prefix[:-1]} (missing {missing[0]}); "
            "a checkpoint saved by transformers leaves it out: serve the released weights"
        )


def one_layer_config(config):
    """The target's config for a one-layer model (what the runner sizes the layer's KV cache by)."""
    one = copy.deepcopy(config)
    one.num_hidden_layers = 1
    return one


def nextn_shard(tp: TensorParallel, device, target: ModelRunner, source: str, max_positions: int, quantization):
    """The layer (a rank's shard of it, beside that rank's shard of the target), from checkpoint
    ``source``, as the family loads the target's layers."""
    path = resolve_model_path(source)
    invariant = bool(getattr(target.model, "batch_invariant", False))
    cls = nextn_class(type(target.model))
    head = load_model(
        path, target.hf_config, target.dtype, device, max_positions, pack=not target.compiled,
        quantization=quantization, tp=tp, batch_invariant=invariant, cls=cls,
    )  # fmt: skip
    head.share(target.model)
    return head.requires_grad_(False), one_layer_config(target.hf_config), target.dtype


class NextNProposer(EagleProposer):
    method = "nextn"

    @classmethod
    def build(cls, config, target: ModelRunner, *, tokenizer, eos_token_ids) -> NextNProposer:
        source = config.draft_model or config.model
        check_nextn(resolve_model_path(source), target.hf_config, type(target.model))
        max_positions = target.model.rope_cos.shape[0]
        runner_kwargs = dict(
            block_size=config.block_size, compile=target.compiled, attention_backend=target.attention_backend,
            freeze=False, cuda_graph_max_seqs=target.cuda_graph_max_seqs, kv_cache_dtype=target.kv_cache_dtype,
        )  # fmt: skip
        args = (source, max_positions, config.quantization)
        if target.model.tp.size > 1:  # sharded like the target, over its ranks
            from engine.runner.parallel import open_sharded

            runner = open_sharded(target, "prediction layer", nextn_shard, args, **runner_kwargs)
        else:
            head, one, dtype = nextn_shard(SINGLE, target.device, target, *args)
            runner = ModelRunner(head, one, target.device, dtype, **runner_kwargs)
        last = (target.hf_config.num_hidden_layers - 1,)  # the target's last layer: its state before the final norm
        return cls.around(runner, last, config, target, eos_token_ids)

    @classmethod
    def claims(cls, path: Path) -> bool:
        return False  # (the target's own checkpoint: named, never guessed from a --draft-model layout)

    def _forward(self, batch: ForwardBatch, chunks: list[ForwardChunk], input_ids=None, hidden_in=None):
        if input_ids is None and hidden_in is not None:  # a catch-up: the target's states, final-normed
            hidden_in = self.head.target_norm(hidden_in)
        return super(EagleProposer, self)._forward(batch, chunks, input_ids, hidden_in)
