"""Medusa heads (``--speculative-method medusa --draft-model DIR``): extra output heads on the
target's own last hidden state, each guessing a token further ahead, and a tree of their guesses.

Head ``k`` (0-based) is ``num_layers`` residual blocks ``x + SiLU(W x + b)`` and a linear output layer;
from the final (normed) hidden state at position ``t`` — the one whose logits gave token ``t + 1`` —
it predicts token ``t + 2 + k``. After a verify step the target has just produced the sequence's root
token from the hidden state of the last token it kept, so head ``k`` drafts level ``k + 1`` of the tree
below the root, with no forward at all: one small batched matmul per step for every drafting request.

The heads see only the hidden state, never the tokens drafted before them, so every node at level
``d`` has the same candidates (head ``d - 1``'s top-k). The tree grows best-first by the product of
the heads' probabilities along a path, under the node budget (``--spec-tree-budget``, at most
``--spec-tree-topk`` children a node), no deeper than the step's depth and the number of heads; with
``--spec-tree-topk 1`` it is a chain of each head's argmax. The tree is deterministic (no ``q``): sampling
requests verify it by multi-draft rejection against one-hot drafts, so the output keeps exactly the
target's distribution.

The directory layout is Medusa's published one (``config.json`` with ``medusa_num_heads`` and
``medusa_num_layers``; ``medusa_lm_head.safetensors`` or ``medusa_lm_head.pt`` whose keys are
``{head}.{block}.linear.weight|bias`` and ``{head}.{num_layers}.weight``), which ``augur train-draft
--method medusa`` writes too. A wrong shape or a missing tensor is a start-up error that names it.
"""

from __future__ import annotations

import heapq
import json
import time
from pathlib import Path

import torch
from torch import nn

from engine.parallel import SINGLE, TensorParallel
from engine.request.sequence import Sequence
from engine.runner.loader import check_state, read_state_file, resolve_model_path, take_slice
from engine.runner.model_runner import ModelRunner
from engine.runner.readback import to_host
from engine.sampling.tree import DraftTree
from engine.speculative.proposer import CostShape, ProposeContext, Proposer

WEIGHT_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")


class ResBlock(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """``num_heads`` heads of ``num_layers`` residual blocks and an output layer each. Sharded (``tp``
    of size N, ``--draft-tensor-parallel-size N``), each rank holds the residual blocks whole and its
    rows of every output layer (vocabulary ``rank * V / N`` onwards, as the target's LM head), and the
    logits are gathered."""

    def __init__(self, hidden: int, vocab: int, num_heads: int, num_layers: int = 1, tp: TensorParallel = SINGLE):
        super().__init__()
        self.num_heads, self.num_layers, self.tp = num_heads, num_layers, tp
        self.vocab_shard = tp.split(vocab, "vocabulary")
        self.heads = nn.ModuleList(
            nn.Sequential(
                *[ResBlock(hidden) for _ in range(num_layers)], nn.Linear(hidden, self.vocab_shard, bias=False)
            )
            for _ in range(num_heads)
        )

    def forward(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """``[N, hidden]`` final hidden states → ``[N, heads, vocab]`` logits (float32) of the first heads."""
        logits = torch.stack([h(hidden) for h in self.heads[: num_heads or self.num_heads]], 1)
        return self.tp.gather_vocab(logits).float()

    def config(self) -> dict:
        return {"medusa_num_heads": self.num_heads, "medusa_num_layers": self.num_layers}

    def save(self, path: str | Path, extra: dict | None = None) -> None:
        """Write Medusa's published layout (the keys are the head list's own state dict)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.heads.state_dict().items()}
        save_file(state, path / WEIGHT_FILES[0], metadata={"format": "pt"})
        (path / "config.json").write_text(json.dumps({**self.config(), **(extra or {})}, indent=2) + "\n")


def is_medusa_dir(path: Path) -> bool:
    f = Path(path) / "config.json"
    return f.is_file() and "medusa_num_heads" in json.loads(f.read_text())


def load_medusa(
    path: str | Path, hidden: int, vocab: int, dtype: torch.dtype, device: torch.device, tp: TensorParallel = SINGLE
) -> MedusaHeads:
    """Heads from a directory in Medusa's layout, checked against the target's hidden and vocabulary
    sizes; under ``tp``, this rank's rows of their output layers."""
    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    if "medusa_num_heads" not in cfg:
        raise ValueError(f"{path}/config.json has no medusa_num_heads: not a Medusa directory")
    heads = MedusaHeads(hidden, vocab, int(cfg["medusa_num_heads"]), int(cfg.get("medusa_num_layers", 1)), tp)
    file, state = read_state_file(path, WEIGHT_FILES)
    outputs = {f"{k}.{heads.num_layers}.weight" for k in range(heads.num_heads)}
    want = {
        name: (vocab, hidden) if name in outputs else tuple(t.shape) for name, t in heads.heads.state_dict().items()
    }
    why = f"{heads.num_heads} heads of {heads.num_layers} layers, target hidden size {hidden}, vocabulary {vocab}"
    check_state(file, state, want, why)
    rows = (0, tp.rank * heads.vocab_shard, heads.vocab_shard)  # (as the target's LM head: checkpoint_slice)
    heads.heads.load_state_dict({k: take_slice(v, rows) if k in outputs else v for k, v in state.items()})
    return heads.to(device=device, dtype=dtype).eval().requires_grad_(False)


def medusa_shard(tp: TensorParallel, device, target: ModelRunner, draft_model: str) -> MedusaHeads:
    """A rank's shard of the heads (``engine.runner.parallel.open_sharded_module``'s factory)."""
    path = resolve_model_path(draft_model)  # (in this host's cache)
    return load_medusa(path, target.hf_config.hidden_size, target.vocab_size, target.dtype, device, tp)


def best_first_tree(logp: list[list[float]], tokens: list[list[int]], depth: int, budget: int) -> DraftTree:
    """Level ``d``'s candidates are ``tokens[d]`` with log-probabilities ``logp[d]`` (the same under every
    node): grow the ``budget`` most likely paths' nodes, best first (an ancestor always outranks its
    descendants, so nodes come out in topological order, siblings best first)."""
    out_tokens: list[int] = []
    parents: list[int] = []
    heap = [(-logp[0][j], 0, j, -1) for j in range(len(tokens[0]))]  # (-score, level, candidate, parent)
    heapq.heapify(heap)
    while heap and len(out_tokens) < budget:
        neg, level, j, parent = heapq.heappop(heap)
        out_tokens.append(tokens[level][j])
        parents.append(parent)
        node = len(out_tokens) - 1
        if level + 1 < depth:
            for c in range(len(tokens[level + 1])):
                heapq.heappush(heap, (neg - logp[level + 1][c], level + 1, c, node))
    return DraftTree(out_tokens, parents)


class MedusaProposer(Proposer):
    method = "medusa"
    # One batched pass of the heads per step over the drafting requests (timed like a catch-up).
    cost = CostShape(kind="medusa", catch_up=True, per_level=False)

    def __init__(self, heads: MedusaHeads, target: ModelRunner, topk: int, budget: int) -> None:
        if topk < 1 or budget < 1:
            raise ValueError("spec tree topk and budget must be positive")
        self.heads, self.topk, self.budget = heads, topk, budget
        self.norm = target.model.norm  # the heads read the final, normed hidden state
        self.hidden_layers = (target.model.num_layers - 1,)
        self.device = target.device
        self._timings: list[tuple[str, int, int, float]] = []

    @classmethod
    def build(cls, config, target: ModelRunner, *, tokenizer, eos_token_ids) -> MedusaProposer:
        if not config.draft_model:
            raise ValueError("speculative method 'medusa' needs --draft-model DIR (Medusa heads)")
        path = resolve_model_path(config.draft_model)
        cfg = target.hf_config
        if config.draft_tensor_parallel_size > 1:  # their output layers split by vocabulary over the ranks
            from engine.runner.parallel import open_sharded_module

            heads = open_sharded_module(target, "Medusa heads", medusa_shard, config.draft_model)
        else:
            heads = load_medusa(path, cfg.hidden_size, target.vocab_size, target.dtype, target.device)
        return cls(heads, target, config.spec_tree_topk, config.spec_tree_budget)

    @classmethod
    def claims(cls, path: Path) -> bool:
        return is_medusa_dir(path)

    def slots_needed(self, depth: int, greedy: bool = True) -> int:
        depth = min(depth, self.heads.num_heads)
        return depth if self.topk == 1 else min(self.budget, sum(self.topk**d for d in range(1, depth + 1)))

    def depth_for_slots(self, slots: int, depth: int, greedy: bool, route: str | None = None) -> int:
        return super().depth_for_slots(slots, min(depth, self.heads.num_heads), greedy, route)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], depths: list[int], ctx: ProposeContext) -> list[DraftTree]:
        layer = self.hidden_layers[0]
        have = [i for i, s in enumerate(seqs) if s.seq_id in ctx.hidden_states]  # forked choices wait a step
        trees = [DraftTree() for _ in seqs]
        if not have:
            return trees
        D = min(max(depths[i] for i in have), self.heads.num_heads)
        t0 = time.perf_counter()
        h = torch.stack([ctx.hidden_states[seqs[i].seq_id][layer][-1] for i in have])  # [B, hidden]
        logits = self.heads(self.norm(h), D)  # [B, D, V]
        if self.topk == 1:
            best = logits.argmax(-1).tolist()  # one transfer
            for b, i in enumerate(have):
                trees[i] = DraftTree.chain(best[b][: depths[i]])
        else:
            logp, tok = torch.log_softmax(logits, -1).topk(self.topk, dim=-1)  # [B, D, k]
            logp, tok = to_host(logp, tok)  # one transfer
            for b, i in enumerate(have):
                d = min(depths[i], D)
                trees[i] = best_first_tree(logp[b], tok[b], d, self.slots_needed(d))
        self._timings.append(("medusa", len(have), len(have), time.perf_counter() - t0))
        return trees

    def timings(self) -> list[tuple[str, int, int, float]]:
        out, self._timings = self._timings, []
        return out

    def cost_probe(self):
        hidden = self.norm.weight.shape[0]

        @torch.inference_mode()
        def probe(chunks) -> torch.Tensor:
            h = torch.zeros(len(chunks), hidden, dtype=self.norm.weight.dtype, device=self.device)
            return self.heads(self.norm(h)).argmax(-1)

        return probe
