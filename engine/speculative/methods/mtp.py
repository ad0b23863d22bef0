"""Chained draft heads (``--speculative-method mtp --draft-model DIR``): multi-token prediction where
each head reads the previous head's output, so draft ``k`` conditions on drafts ``1 .. k - 1``.

Head ``k`` (0-based) maps a state and the embedding of a token to a new state:
``s' = blocks(W [norm(s); norm(embed(x))])`` (``blocks``: residual ``x + SiLU(W x + b)`` blocks), and the
target's own final norm and output layer turn ``s'`` into logits. Head 0 starts from the target's last
hidden state (the output of its last layer at the position before the root) and the root token; head
``k`` from head ``k - 1``'s output and the token drafted from it. This is DeepSeek-V3's MTP chain
(``[norm(h); norm(embed)]`` projected, a shared output head) with Hydra's cheap heads in place of a
transformer block per module: no attention, so no KV cache, and a draft level is one small batched
matmul chain over the level's nodes. Because each head sees the drafted token, trees branch for real:
each node's children come from its own state (chains, sampled trees, and EAGLE-2 dynamic greedy trees,
all ``engine/speculative/levels.py``'s), unlike Medusa's, where every node of a level has the same
candidates. A draft is at most as deep as there are heads.

The directory is Augur's (there is no published layout for chained heads on Llama-family targets):
``config.json`` with ``mtp_num_heads``, ``mtp_num_layers``, ``hidden_size`` and ``rms_norm_eps``, and
``mtp_heads.safetensors`` (``{k}.proj.weight``, ``{k}.hidden_norm.weight``, ``{k}.embed_norm.weight``,
``{k}.blocks.{j}.linear.weight|bias``). ``augur train-draft --method mtp`` writes it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from engine.attention.staging import to_device
from engine.models.llama import RMSNorm
from engine.request.sequence import Sequence
from engine.runner.loader import check_state, read_state_file, resolve_model_path
from engine.runner.model_runner import ModelRunner
from engine.sampling.tree import DraftTree
from engine.speculative.early_stop import early_stop_for
from engine.speculative.levels import LevelDrafter
from engine.speculative.methods.medusa import ResBlock
from engine.speculative.proposer import CostShape, ProposeContext

WEIGHT_FILE = "mtp_heads.safetensors"


class ChainedHead(nn.Module):
    def __init__(self, hidden: int, num_layers: int, eps: float) -> None:
        super().__init__()
        self.hidden_norm = RMSNorm(hidden, eps)
        self.embed_norm = RMSNorm(hidden, eps)
        self.proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.blocks = nn.Sequential(*[ResBlock(hidden) for _ in range(num_layers)])

    def forward(self, state: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.proj(torch.cat([self.hidden_norm(state), self.embed_norm(embeds)], -1)))


class ChainedHeads(nn.Module):
    def __init__(self, hidden: int, num_heads: int, num_layers: int = 1, eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden, self.num_heads, self.num_layers, self.eps = hidden, num_heads, num_layers, eps
        self.heads = nn.ModuleList(ChainedHead(hidden, num_layers, eps) for _ in range(num_heads))

    def config(self) -> dict:
        return {
            "architectures": ["AugurChainedHeads"],
            "mtp_num_heads": self.num_heads,
            "mtp_num_layers": self.num_layers,
            "hidden_size": self.hidden,
            "rms_norm_eps": self.eps,
        }

    def save(self, path: str | Path, extra: dict | None = None) -> None:
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.heads.state_dict().items()}
        save_file(state, path / WEIGHT_FILE, metadata={"format": "pt"})
        (path / "config.json").write_text(json.dumps({**self.config(), **(extra or {})}, indent=2) + "\n")


def is_mtp_dir(path: Path) -> bool:
    f = Path(path) / "config.json"
    return f.is_file() and "mtp_num_heads" in json.loads(f.read_text())


def load_chained_heads(path: str | Path, hidden: int, dtype: torch.dtype, device: torch.device) -> ChainedHeads:
    """Heads from an ``augur train-draft --method mtp`` directory, checked against the target's hidden size."""
    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    if "mtp_num_heads" not in cfg:
        raise ValueError(f"{path}/config.json has no mtp_num_heads: not a chained-heads directory")
    if int(cfg.get("hidden_size", hidden)) != hidden:
        raise ValueError(f"{path}: hidden_size {cfg['hidden_size']} does not match the target's {hidden}")
    heads = ChainedHeads(
        hidden, int(cfg["mtp_num_heads"]), int(cfg.get("mtp_num_layers", 1)), cfg.get("rms_norm_eps", 1e-6)
    )
    file, state = read_state_file(path, (WEIGHT_FILE,))
    check_state(file, state, {name: tuple(t.shape) for name, t in heads.heads.state_dict().items()})
    heads.heads.load_state_dict(state)
    return heads.to(device=device, dtype=dtype).eval().requires_grad_(False)


class ChainedHeadsProposer(LevelDrafter):
    method = "mtp"
    cost = CostShape(kind="mtp", catch_up=True, per_level=True)  # one head pass per level

    def __init__(self, heads: ChainedHeads, target: ModelRunner, eos_token_ids, tree, topk=2, budget=16,
                 early_stop=None) -> None:  # fmt: skip
        super().__init__(target.vocab_size, eos_token_ids, target.device, tree, topk, budget, early_stop)
        self.heads = heads
        self.target = target  # its embedding and output layer (through the runner: sharded, every rank runs them)
        self.model = target.model  # its final norm
        self.hidden_layers = (target.model.num_layers - 1,)

    @classmethod
    def build(cls, config, target: ModelRunner, *, tokenizer, eos_token_ids) -> ChainedHeadsProposer:
        if not config.draft_model:
            raise ValueError("speculative method 'mtp' needs --draft-model DIR (chained heads)")
        path = resolve_model_path(config.draft_model)
        heads = load_chained_heads(path, target.hf_config.hidden_size, target.dtype, target.device)
        stop = early_stop_for(config, default=None)
        tree, topk, budget = config.spec_tree_topk > 1, config.spec_tree_topk, config.spec_tree_budget
        return cls(heads, target, eos_token_ids, tree, topk, budget, stop)

    @classmethod
    def claims(cls, path: Path) -> bool:
        return is_mtp_dir(path)

    def slots_needed(self, depth: int, greedy: bool = True) -> int:
        return super().slots_needed(min(depth, self.heads.num_heads), greedy)

    def depth_for_slots(self, slots: int, depth: int, greedy: bool, route: str | None = None) -> int:
        return super().depth_for_slots(slots, min(depth, self.heads.num_heads), greedy, route)

    def on_verified(self, seq: Sequence, tree: DraftTree, accepted: list[int]) -> None:
        self.observe_acceptance(seq, tree, accepted)
        self._written.pop(seq.seq_id, None)  # no cache: nothing to keep

    @torch.inference_mode()
    def _root_logits(self, seqs: list[Sequence], ctx: ProposeContext):
        layer = self.hidden_layers[0]
        ready = [i for i, s in enumerate(seqs) if s.seq_id in ctx.hidden_states]
        if not ready:
            return [], torch.empty(0, self.vocab_size, device=self.device), None
        h = torch.stack([ctx.hidden_states[seqs[i].seq_id][layer][-1] for i in ready])  # before the root
        roots = to_device([seqs[i].token_ids[-1] for i in ready], self.device, torch.int64)
        return ready, *self._run(0, h, roots, len(ready))

    @torch.inference_mode()
    def _level(self, seqs, ids, per_seq, first, depth, masks=None, state=None):
        return self._run(depth, state, ids.reshape(-1), len(seqs))

    def _run(self, k: int, state: torch.Tensor, ids: torch.Tensor, num_seqs: int):
        """Head ``k`` over ``(state, token)`` rows, timed: the next token's logits and the new states."""
        lap = self.target.lap()
        logits, new = self._head(k, state, ids)
        self._timings.append(("mtp", num_seqs, len(ids), lap.stop(), 1))
        return logits, new

    def _head(self, k: int, state: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        new = self.heads.heads[k](state, self.target.embed(ids))
        return self.target.logits(self.model.norm(new)), new

    def cost_probe(self):
        @torch.inference_mode()
        def probe(chunks) -> torch.Tensor:
            n = sum(len(c.token_ids) for c in chunks)
            h = torch.zeros(n, self.heads.hidden, dtype=self.model.norm.weight.dtype, device=self.device)
            return self._head(0, h, torch.zeros(n, dtype=torch.long, device=self.device))[0]

        return probe
