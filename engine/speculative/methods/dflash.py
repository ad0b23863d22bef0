"""DFlash block drafting (``--draft-model DIR`` of a DFlash checkpoint; ``--speculative-method dflash``):
a small block-diffusion drafter that writes a whole block of draft tokens in **one** forward.

Every other model drafter here runs one forward per draft level, each feeding the token the last one
chose. DFlash (z-lab, arXiv 2602.06036) instead feeds the block ``[root, MASK, MASK, ...]`` at
positions ``root .. root + k`` and reads a draft token at every mask position at once: attention
inside the block is bidirectional, and what the drafter knows of the text comes from the target's own
hidden features. So a draft of ``k`` tokens costs one drafter forward whatever ``k``.

The drafter (``DFlashDrafter``):

- **Context features.** The outputs of a few target layers (``target_layer_ids``: 0-based decoder
  layers, Hugging Face's ``hidden_states[id + 1]``) at every position the target has made final are
  concatenated and fused, ``ctx = hidden_norm(fc([h_a; h_b; ...]))``. In every drafter layer the
  context positions' keys and values are that layer's ``k_proj`` / ``v_proj`` of ``ctx`` (with ``k_norm``
  and RoPE at their positions), the same weights the block's own keys use; no query is read there.
  They live in the drafter's own KV cache (``engine/speculative/own_cache.py``), written by each step's
  catch-up over the positions the target made final since the last one.
- **The block.** Its rows are the target's embeddings of ``[root, MASK x k]`` (the root: the token the
  last verify emitted, not yet through the target); Qwen3 pre-norm decoder layers (``q_norm`` /
  ``k_norm``), whose queries see every context position and every row of the block; the final
  ``norm`` and the *target's* output layer give each mask row's logits: row ``j`` drafts the token at
  ``root + j``. The drafter has no embedding or output layer of its own.

One drafter forward per step does both: the catch-up's context rows (marked by a negative token id;
their per-row input is ``ctx``, put in place of the layer's normed input, so only their keys and
values matter) and the block rows after them, under a mask where the block sees everything and the
context rows see the context. The block's own keys are written to the draft slots past the context
and overwritten by the next catch-up, so only the target's features ever stay in the cache.

Verification: a chain of the argmax at each mask row for greedy requests, or with ``--spec-tree-topk
K`` a tree of each position's best ``K`` grown best-first by their product (every node of a level has
the same candidates, as Medusa's); sampled requests draw each position from the drafter's
distribution ``q_j`` there (shaped by the request's own sampling parameters), ``K`` distinct tokens a
position under the previous position's first with ``--spec-tree-topk K``, and verify by (multi-draft)
rejection sampling against the distribution each was drawn from. A position's ``q_j`` does not
depend on the tokens drafted before it, which the rejection rule allows: it holds for any draft
distribution fixed before the token is drawn, so the output keeps exactly the target's distribution.
The block length (the depth) is the controller's, per request and step, at most the checkpoint's
``block_size - 1``.

Checkpoints load in the published layout (``config.json`` with ``block_size`` and ``dflash_config``:
``mask_token_id``, ``target_layer_ids``; ``model.safetensors`` with ``fc.weight``,
``hidden_norm.weight``, ``norm.weight`` and ``layers.N.*`` in Qwen3's names), implemented here: no
``trust_remote_code``. ``augur train-draft --method dflash`` writes the same layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig

from engine.attention.staging import to_device
from engine.models.llama import LlamaAttention, LlamaMLP, RMSNorm, rope_cos_sin, rope_rows
from engine.request.sequence import Sequence
from engine.runner.loader import check_state, resolve_model_path
from engine.runner.model_runner import ForwardChunk, ModelRunner
from engine.runner.readback import to_host
from engine.sampling.sampler import SamplingMetadata, compute_probs, exponential_noise, processed
from engine.sampling.tree import DraftTree
from engine.speculative.features import PendingFeatures
from engine.speculative.levels import draw_siblings
from engine.speculative.methods.medusa import best_first_tree
from engine.speculative.own_cache import OwnCache
from engine.speculative.proposer import CostShape, ProposeContext, Proposer

MAX_PENDING_ROWS = 1024  # target feature rows kept per sequence until its drafter catches up
ARCHITECTURE = "DFlashDraftModel"


class DFlashLayer(nn.Module):
    """A Qwen3 decoder layer; its attention's keys and values read either the layer's normed input (block
    rows) or the fused context feature (context rows)."""

    def __init__(self, config, qk_norm: bool) -> None:
        super().__init__()
        bias = bool(getattr(config, "attention_bias", False))
        self.self_attn = LlamaAttention(config, 0, bias, bias, qk_norm)
        self.mlp = LlamaMLP(config, bias=bool(getattr(config, "mlp_bias", False)))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DFlashDrafter(nn.Module):
    """The drafter as a model the runner drives (its own KV pool of ``num_layers`` layers). Rows with a
    negative token id are context rows: their input is ``hidden_in`` (the fused feature ``ctx``)."""

    sliding_window = None

    def __init__(
        self,
        config: LlamaConfig,  # the drafter's layers' shape; vocab_size is the target's
        num_features: int,
        target_hidden: int,
        embed: nn.Module,  # the target's embedding
        head,  # the target's output layer: final-normed states [N, hidden] -> [N, V] float32 logits
        max_positions: int,
        qk_norm: bool = True,
    ) -> None:
        super().__init__()
        h = config.hidden_size
        self.config = config
        self.num_layers = config.num_hidden_layers
        self.vocab_size = config.vocab_size
        self.embed_tokens = embed
        self.head = head
        self.fc = nn.Linear(num_features * target_hidden, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(config, qk_norm) for _ in range(self.num_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.max_positions = max_positions
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self.init_rope()

    def init_rope(self) -> None:
        cos, sin = rope_cos_sin(self.config, self.max_positions)
        self.rope_cos, self.rope_sin = cos.to(self.fc.weight.device), sin.to(self.fc.weight.device)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """``[n, num_features * target_hidden]`` target features → ``ctx`` ``[n, hidden]``."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def forward(self, input_ids, positions, meta, kv_caches, skip=None, hidden_layers=(), hidden_in=None):
        context = (input_ids < 0)[:, None]  # [T, 1]
        x = self.embed_tokens(input_ids.clamp(min=0))
        cos, sin = rope_rows(self.rope_cos, self.rope_sin, positions, x.dtype)
        for i, layer in enumerate(self.layers):
            h = layer.input_layernorm(x)
            if hidden_in is not None:
                h = torch.where(context, hidden_in.to(h.dtype), h)
            x = x + layer.self_attn(h, cos, sin, kv_caches, i, meta)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x), {}

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)

    # -- the published layout -----------------------------------------------------------------------
    def _parts(self) -> list[tuple[torch.Tensor, list[str]]]:
        """Each parameter with the checkpoint tensors it holds, in order (q/k/v and gate/up fused here)."""
        out: list[tuple[torch.Tensor, list[str]]] = [
            (self.fc.weight, ["fc.weight"]),
            (self.hidden_norm.weight, ["hidden_norm.weight"]),
            (self.norm.weight, ["norm.weight"]),
        ]
        for i, layer in enumerate(self.layers):
            p, a, m = f"layers.{i}.", layer.self_attn, layer.mlp
            out += [
                (layer.input_layernorm.weight, [p + "input_layernorm.weight"]),
                (layer.post_attention_layernorm.weight, [p + "post_attention_layernorm.weight"]),
                (a.qkv_proj.weight, [p + f"self_attn.{x}_proj.weight" for x in "qkv"]),
                (a.o_proj.weight, [p + "self_attn.o_proj.weight"]),
                (m.gate_up_proj.weight, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
                (m.down_proj.weight, [p + "mlp.down_proj.weight"]),
            ]
            if a.q_norm is not None:
                out += [
                    (a.q_norm.weight, [p + "self_attn.q_norm.weight"]),
                    (a.k_norm.weight, [p + "self_attn.k_norm.weight"]),
                ]
            if a.qkv_proj.bias is not None:
                out += [(a.qkv_proj.bias, [p + f"self_attn.{x}_proj.bias" for x in "qkv"])]
            if a.o_proj.bias is not None:
                out += [(a.o_proj.bias, [p + "self_attn.o_proj.bias"])]
            if m.gate_up_proj.bias is not None:
                out += [(m.gate_up_proj.bias, [p + "mlp.gate_proj.bias", p + "mlp.up_proj.bias"])]
                out += [(m.down_proj.bias, [p + "mlp.down_proj.bias"])]
        return out

    def _splits(self, param: torch.Tensor, names: list[str]) -> list[int]:
        """The sizes along dim 0 of the checkpoint tensors ``names`` fused into ``param``."""
        if len(names) == 1:
            return [param.shape[0]]
        a = self.layers[0].self_attn
        return [a.q_size, a.kv_size, a.kv_size] if len(names) == 3 else [param.shape[0] // 2] * 2

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = {}
        for param, names in self._parts():
            for name, n in zip(names, self._splits(param, names)):
                shapes[name] = (n, *param.shape[1:])
        return shapes

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        state = {}
        for param, names in self._parts():
            state.update(zip(names, param.detach().split(self._splits(param, names))))
        return {name: t.contiguous().cpu() for name, t in state.items()}

    @torch.no_grad()
    def load_checkpoint_state(self, state: dict[str, torch.Tensor]) -> None:
        for param, names in self._parts():
            param.copy_(torch.cat([state[n] for n in names]).to(param.dtype))

    def save(self, path: str | Path, target_layer_ids: list[int], block_size: int, mask_token_id: int,
             num_target_layers: int, extra: dict | None = None) -> None:  # fmt: skip
        """Write the published layout: ``config.json`` and ``model.safetensors``."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        save_file(self.checkpoint_state(), path / "model.safetensors", metadata={"format": "pt"})
        c = self.config
        attn = self.layers[0].self_attn
        cfg = {
            "architectures": [ARCHITECTURE],
            "model_type": "qwen3",
            "block_size": block_size,
            "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids)},
            "num_target_layers": num_target_layers,
            "num_hidden_layers": self.num_layers,
            "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size,
            "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": attn.total_kv_heads,
            "head_dim": attn.head_dim,
            "hidden_act": c.hidden_act,
            "attention_bias": attn.qkv_proj.bias is not None,
            "rms_norm_eps": c.rms_norm_eps,
            "rope_parameters": c.rope_parameters,
            "max_position_embeddings": c.max_position_embeddings,
            "layer_types": ["full_attention"] * self.num_layers,
            "vocab_size": c.vocab_size,
            "tie_word_embeddings": False,
            **(extra or {}),
        }
        (path / "config.json").write_text(json.dumps(cfg, indent=2, default=str) + "\n")


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The published default when a config names none: one layer, the middle; else evenly spaced from
    layer 1 to layer ``L - 3``."""
    L, n = num_target_layers, num_draft_layers
    if n == 1:
        return [L // 2]
    return [round(1 + i * (L - 4) / (n - 1)) for i in range(n)]


def read_dflash_config(path: Path, target_config) -> dict:
    """What a DFlash directory's ``config.json`` says, checked against the target: the layers' config,
    the block size, the mask token and the target layers read (0-based)."""
    cfg = json.loads((path / "config.json").read_text())
    sub = cfg.get("dflash_config") or {}
    L = target_config.num_hidden_layers
    if int(cfg.get("num_target_layers", L)) != L:
        raise ValueError(f"{path}: drafts for a target of {cfg['num_target_layers']} layers; this target has {L}")
    if sub.get("causal"):
        raise ValueError(f"{path}: a causal DFlash drafter (dflash_config.causal) is not supported")
    n = int(cfg["num_hidden_layers"])
    kinds = set(cfg.get("layer_types") or ["full_attention"])
    if kinds != {"full_attention"}:
        raise ValueError(f"{path}: layer_types {sorted(kinds)}: only full_attention drafter layers are supported")
    block = int(sub.get("block_size") or cfg.get("block_size") or 16)
    if block < 2:
        raise ValueError(f"{path}: block_size {block}: a block needs the root and at least one mask position")
    if "mask_token_id" not in sub and "mask_token_id" not in cfg:
        raise ValueError(f"{path}/config.json names no mask_token_id (dflash_config.mask_token_id)")
    mask = int(sub.get("mask_token_id", cfg.get("mask_token_id")))
    if not 0 <= mask < target_config.vocab_size:
        raise ValueError(
            f"{path}: mask_token_id {mask} is outside the target's vocabulary ({target_config.vocab_size})"
        )
    ids = sub.get("target_layer_ids") or cfg.get("target_layer_ids") or default_target_layer_ids(L, n)
    ids = [int(j) for j in ids]
    bad = [j for j in ids if not 0 <= j < L]
    if bad:
        raise ValueError(f"{path}: target_layer_ids {bad} outside 0..{L - 1} (the target's decoder layers)")
    if int(cfg["hidden_size"]) != target_config.hidden_size:
        raise ValueError(
            f"{path}: hidden_size {cfg['hidden_size']} differs from the target's {target_config.hidden_size} "
            "(the drafter embeds and reads out with the target's own layers)"
        )
    keep = {
        k: v for k, v in cfg.items() if k not in ("architectures", "auto_map", "torch_dtype", "dtype", "dflash_config")
    }
    keep.update(vocab_size=target_config.vocab_size)
    return {"layer": LlamaConfig(**keep), "block_size": block, "mask_token_id": mask, "target_layer_ids": ids}


def is_dflash_dir(path: Path) -> bool:
    f = Path(path) / "config.json"
    if not f.is_file():
        return False
    cfg = json.loads(f.read_text())
    return ARCHITECTURE in (cfg.get("architectures") or []) or "dflash_config" in cfg


def _read_weights(path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    from engine.runner.loader import iter_safetensors

    return path, {name.removeprefix("model."): t for name, t in iter_safetensors(path)}


def load_dflash(path: str | Path, target: ModelRunner, dtype: torch.dtype, device: torch.device, max_positions: int):
    """The drafter of a directory in the published layout, on the target's embedding and output layer,
    and what its config says (``read_dflash_config``)."""
    path = Path(path)
    info = read_dflash_config(path, target.hf_config)
    file, state = _read_weights(path)
    qk_norm = "layers.0.self_attn.q_norm.weight" in state
    embed, head = target.model.embed_tokens, target.model.compute_logits
    drafter = DFlashDrafter(
        info["layer"], len(info["target_layer_ids"]), target.hf_config.hidden_size, embed, head, max_positions, qk_norm
    ).to(device=device)
    own = {n: state.pop(n) for n in ("embed_tokens.weight", "lm_head.weight") if n in state}
    why = f"{len(info['target_layer_ids'])} target layers fused, {drafter.num_layers} drafter layers"
    check_state(file, state, drafter.checkpoint_shapes(), why)
    drafter.load_checkpoint_state(state)
    if "embed_tokens.weight" in own:  # a drafter that brings its own embedding
        drafter.embed_tokens = nn.Embedding.from_pretrained(own["embed_tokens.weight"].to(device), freeze=True)
    if "lm_head.weight" in own:  # ... or its own output layer
        lm_head = nn.Linear(*reversed(own["lm_head.weight"].shape), bias=False, device=device)
        with torch.no_grad():
            lm_head.weight.copy_(own["lm_head.weight"])
        drafter.own_head = lm_head
        drafter.head = lambda hidden: lm_head(hidden).float()
    drafter.init_rope()
    return drafter.to(dtype=dtype).eval().requires_grad_(False), info


class DFlashProposer(Proposer):
    method = "dflash"
    # One drafter forward per step (its catch-up and the whole block), whatever the depth.
    cost = CostShape(kind="dflash", catch_up=True, per_level=False)

    def __init__(self, runner: ModelRunner, target: ModelRunner, info: dict, eos_token_ids: list[int],
                 topk: int = 1, budget: int = 16, catch_up_budget: int = 2048) -> None:  # fmt: skip
        if topk < 1 or budget < 1:
            raise ValueError("spec tree topk and budget must be positive")
        self.runner = runner
        self.drafter: DFlashDrafter = runner.model
        self.cache = OwnCache(runner)
        self.kv_bytes_per_token = runner.kv_bytes_per_token
        self.block_size = info["block_size"]
        self.mask_token_id = info["mask_token_id"]
        self.hidden_layers = tuple(info["target_layer_ids"])
        # Hugging Face's hidden_states[L] (the last layer's) is after the final norm; ours is before it.
        self.last_layer = target.model.num_layers - 1
        self.target_norm = target.model.norm
        self.vocab_size = target.vocab_size
        self.eos_token_ids = eos_token_ids
        self.device = target.device
        self.topk, self.budget, self.catch_up_budget = topk, budget, catch_up_budget
        self._pending = PendingFeatures(MAX_PENDING_ROWS)
        self._timings: list[tuple[str, int, int, object]] = []
        self.num_forwards = 0

    @classmethod
    def build(cls, config, target: ModelRunner, *, tokenizer, eos_token_ids) -> DFlashProposer:
        if not config.draft_model:
            raise ValueError("speculative method 'dflash' needs --draft-model DIR (a DFlash checkpoint)")
        if target.model.tp.size > 1:
            raise ValueError("speculative method 'dflash' does not run beside a tensor-parallel target yet")
        path = resolve_model_path(config.draft_model)
        max_positions = target.model.rope_cos.shape[0]
        drafter, info = load_dflash(path, target, target.dtype, target.device, max_positions)
        runner = ModelRunner(
            drafter, drafter.config, target.device, target.dtype, block_size=config.block_size,
            compile=target.compiled, attention_backend=target.attention_backend, freeze=False,
            cuda_graph_max_seqs=target.cuda_graph_max_seqs, kv_cache_dtype=target.kv_cache_dtype,
        )  # fmt: skip
        return cls(
            runner, target, info, eos_token_ids, config.spec_tree_topk, config.spec_tree_budget,
            config.max_num_batched_tokens,
        )  # fmt: skip

    @classmethod
    def claims(cls, path: Path) -> bool:
        return is_dflash_dir(path)

    # -- shape ----------------------------------------------------------------------------------
    def deepest(self, configured: int) -> int:
        return min(configured, self.block_size - 1)

    def slots_needed(self, depth: int, greedy: bool = True) -> int:
        depth = min(depth, self.block_size - 1)
        if depth <= 0 or self.topk == 1:  # a chain; the block writes as many slots past the root
            return max(depth, 0)
        if not greedy:  # k siblings a position
            return self.topk * depth
        return max(depth, min(self.budget, sum(self.topk**d for d in range(1, depth + 1))))

    def catch_up_tokens(self, seq: Sequence, route: str | None = None) -> int:
        return max(seq.num_tokens - seq.draft_num_computed, 1)

    # -- the cache and the target's features ------------------------------------------------------
    def allocate_kv(self, num_blocks: int) -> None:
        self.cache.allocate(num_blocks)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        self.cache.copy_blocks(copies)

    def runners(self) -> list[ModelRunner]:
        return [self.runner]

    def on_computed(self, seq: Sequence, start: int, hidden: dict[int, torch.Tensor]) -> None:
        parts = [self.target_norm(hidden[j]) if j == self.last_layer else hidden[j] for j in self.hidden_layers]
        self._pending.add(seq.seq_id, start, torch.cat(parts, -1))

    def on_fork(self, parent: Sequence, child: Sequence) -> None:
        child.draft_num_computed = parent.draft_num_computed
        self._pending.fork(parent.seq_id, child.seq_id)

    def on_preempt(self, seq: Sequence) -> None:
        seq.draft_num_computed = 0
        self._pending.drop(seq.seq_id)
        self.cache.forget(seq)

    def on_free(self, seq: Sequence) -> None:
        self._pending.drop(seq.seq_id)
        self.cache.forget(seq)

    # -- drafting -------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], depths: list[int], ctx: ProposeContext) -> list[DraftTree]:
        chunks, features, blocks, rows, fed = self._chunks(seqs, depths)
        trees = [DraftTree() for _ in seqs]
        if not chunks:
            return trees
        logits = self._forward(chunks, features, rows)
        for s in fed:  # the full blocks of context now written
            self.cache.mark_valid(s)
        offsets, at = {}, 0
        for i, d in blocks:
            offsets[i] = at
            at += d
        greedy = [(i, d) for i, d in blocks if seqs[i].params.greedy]
        sampled = [(i, d) for i, d in blocks if not seqs[i].params.greedy]
        if greedy:
            for (i, _), tree in zip(greedy, self._greedy(logits, offsets, greedy)):
                trees[i] = tree
        if sampled:
            for (i, _), tree in zip(sampled, self._sampled(seqs, logits, offsets, sampled)):
                trees[i] = tree
        return trees

    def _chunks(self, seqs: list[Sequence], depths: list[int]):
        """Each sequence's part of the step's one drafter forward: its catch-up's context rows and, once
        it has caught up, its block. Returns the chunks, the context rows' target features (or None),
        ``(sequence index, depth)`` of each block in order, the flat row of every context row, and the
        sequences in the forward."""
        chunks, features, blocks, rows, fed = [], [], [], [], []
        budget, flat = self.catch_up_budget, 0
        for i, s in enumerate(seqs):
            self.cache.skip_cached_prefix(s)
            s.draft_num_computed = max(s.draft_num_computed, self._pending.first(s.seq_id, s.draft_num_computed))
            start = s.draft_num_computed
            n = s.num_tokens - 1 - start  # context rows the drafter has not written (the root is not one)
            take = min(n, max(budget, 1)) if n > 0 else 0
            budget -= take
            depth = min(depths[i], self.block_size - 1) if take == n else 0
            block = [s.token_ids[-1], *[self.mask_token_id] * depth] if depth > 0 else []
            if not take and not block:
                continue
            q = take + len(block)
            mask = None
            if block:  # the block sees every context row and all of itself; context rows are causal
                mask = torch.ones(q, q, dtype=torch.bool)
                mask[:take, :take] = torch.ones(take, take, dtype=torch.bool).tril()
                mask[:take, take:] = False
                blocks.append((i, depth))
            chunks.append(ForwardChunk([-1] * take + block, start, s.block_table, depth, tree_mask=mask))
            if take:
                features.append(self._pending.take(s.seq_id, start, take, "DFlash drafter"))
                rows.extend(range(flat, flat + take))
            flat += q
            s.draft_num_computed = start + take
            fed.append(s)
        return chunks, features, blocks, rows, fed

    def _forward(self, chunks: list[ForwardChunk], features: list[torch.Tensor], rows: list[int]) -> torch.Tensor:
        """The one drafter forward: logits ``[sum of depths, V]``, each block's mask rows in order."""
        batch = self.runner.prepare(chunks)
        self.cache.overwrites(chunks)
        lap = self.runner.lap()
        hidden_in = torch.zeros(batch.num_tokens, self.drafter.config.hidden_size, dtype=self.runner.dtype,
                                device=self.device)  # fmt: skip
        if rows:
            hidden_in[to_device(rows, self.device, torch.int64)] = self.drafter.fuse(torch.cat(features))
        out = self.runner.execute(batch, hidden_in=hidden_in)
        self.num_forwards += 1
        self._timings.append((self.cost.kind, batch.num_seqs, batch.num_tokens, lap.stop()))
        return out.logits

    def _greedy(self, logits: torch.Tensor, offsets: dict[int, int], members: list[tuple[int, int]]) -> list[DraftTree]:
        if self.topk == 1:
            best = to_host(logits.argmax(-1))[0]
            return [DraftTree.chain(best[offsets[i] : offsets[i] + d]) for i, d in members]
        logp, tok = torch.log_softmax(logits.float(), -1).topk(self.topk, dim=-1)  # [R, k]
        logp, tok = to_host(logp, tok)
        return [
            best_first_tree(
                logp[offsets[i] : offsets[i] + d], tok[offsets[i] : offsets[i] + d], d, self.slots_needed(d)
            )
            for i, d in members
        ]

    def _sampled(self, seqs, logits, offsets, members) -> list[DraftTree]:
        """Each position drawn from the drafter's distribution there, shaped by the request's own
        sampling parameters (``q``, kept for the rejection rule), with the noise the verify samples
        that position with (a seeded request's draws are coupled to its verification's). With
        ``--spec-tree-topk K``, ``K`` distinct tokens a position, drawn without replacement, all under
        the previous position's first (the spine), each with the distribution it was drawn from."""
        group = [seqs[i] for i, _ in members]
        md = SamplingMetadata.from_state(
            [s.params for s in group], [s.num_output_tokens for s in group], [s.token_counts for s in group],
            [s.prompt_mask for s in group], [s.noise_key() for s in group], self.eos_token_ids, self.vocab_size,
            self.device,
        )  # fmt: skip
        k = self.topk
        levels = []  # per position: the sequences drafting it, their tokens [A, k] and those tokens' q [A, k, V]
        for level in range(max(d for _, d in members)):
            live = [b for b, (_, d) in enumerate(members) if d > level]
            idx = to_device([offsets[members[b][0]] + level for b in live], self.device, torch.int64)
            mdl = md.select(live)
            q = compute_probs(processed(logits[idx], mdl), mdl)  # [A, V]
            noise = exponential_noise(q, [group[b].noise_key(level) for b in live])
            order, qs = draw_siblings(q, noise, k) if k > 1 else ((q / noise).argmax(-1, keepdim=True), q[:, None])
            levels.append((live, order, qs))
        host = to_host(*(t for _, order, qs in levels for t in (order, qs.gather(2, order[..., None]))))
        trees = []
        for b in range(len(members)):
            tokens, parents, rows, spine = [], [], [], -1
            for (live, _, qs), toks, mass in zip(levels, host[::2], host[1::2]):
                if b not in live:
                    break
                a, first = live.index(b), len(tokens)
                for i in range(k):
                    if i > 0 and mass[a][i][0] <= 0.0:
                        continue  # fewer than k tokens have mass (top-k / top-p): no such sibling
                    tokens.append(toks[a][i])
                    parents.append(spine)
                    rows.append(qs[a, i])
                spine = first
            trees.append(DraftTree(tokens, parents, torch.stack(rows)))
        return trees

    def timings(self) -> list[tuple[str, int, int, float]]:
        laps, self._timings = self._timings, []
        return [(kind, s, t, lap.seconds) for kind, s, t, lap in laps]

    # -- start-up -------------------------------------------------------------------------------
    def cost_probe(self):
        @torch.inference_mode()
        def probe(chunks: list[ForwardChunk]):
            batch = self.runner.prepare(chunks)
            h = self.drafter.config.hidden_size
            feats = torch.zeros(batch.num_tokens, h, dtype=self.runner.dtype, device=self.device)
            return self.runner.execute(batch, hidden_in=feats).logits

        return probe

    def warmup(self) -> None:
        """With graphs, capture the drafter's forward as the step calls it (with the context input)."""
        self.runner.capture_graphs(features=self.drafter.config.hidden_size)

    @torch.inference_mode()  # as propose() builds the metadata: a graph guards on its tensors' mode
    def warm_compiled(self, view) -> None:
        """Compile the drafter's forward as the step calls it, with the context input: context rows and a
        block (masked), a block alone, and a long catch-up's context rows alone (causal)."""
        runner = view(self.runner)
        if not runner.compiled:
            return
        h = self.drafter.config.hidden_size
        for take, depth in ((1, 2), (0, 1), (2, 0)):
            q = take + (1 + depth if depth else 0)
            mask = None
            if depth:
                mask = torch.ones(q, q, dtype=torch.bool)
                mask[:take, take:] = False
            ids = [-1] * take + ([0] * (1 + depth) if depth else [])
            blocks = -(-q // runner.block_size)
            # two sequences: a graph over one would specialise on it
            chunks = [ForwardChunk(ids, 0, list(range(b * blocks, (b + 1) * blocks)), depth, tree_mask=mask)
                      for b in range(2)]  # fmt: skip
            batch = runner.prepare(chunks)
            feats = torch.zeros(batch.num_tokens, h, dtype=runner.dtype, device=runner.device)
            runner.execute(batch, hidden_in=feats)
