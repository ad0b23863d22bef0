"""What every ``augur train-draft`` method's trainer shares (``engine/offline/train_draft.py`` runs them):
the cached target rows on the training device, the target's distribution at a row, and the loss."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TrainConfig:
    method: str = "medusa"
    num_heads: int = 4  # medusa, mtp: draft depth
    num_layers: int = 1  # medusa, mtp: residual blocks per head; dflash: drafter layers
    gen_tokens: int = 128  # continuation length generated per prompt and temperature
    steps: int = 1500
    batch_size: int = 256  # positions per step (eagle: rows of whole sequences, packed)
    lr: float = 1e-3
    head_decay: float = 0.8  # loss weight of draft depth k: head_decay ** k
    unroll: int = 3  # eagle: steps per row (1 + those on its own outputs)
    draft_vocab: int = 0  # eagle: 0 = the target's whole vocabulary, else its most frequent ids
    heldout_frac: float = 0.05
    save_every: int = 200
    seed: int = 0
    block_size: int = 8  # dflash: the block (its root and block_size - 1 mask positions: the deepest draft)
    anchors: int = 32  # dflash: blocks trained per sequence and step


def kl_and_agreement(target_logp: torch.Tensor, logits: torch.Tensor, weight: torch.Tensor | None = None):
    """KL(target || draft) averaged over rows (weighted: only rows with weight 1), and top-1 agreement."""
    q = torch.log_softmax(logits.float(), -1)
    kl = (target_logp.exp() * (target_logp - q)).sum(-1)
    agree = (q.argmax(-1) == target_logp.argmax(-1)).float()
    if weight is None:
        return kl.mean(), agree.mean()
    n = weight.sum().clamp_min(1)
    return (kl * weight).sum() / n, (agree * weight).sum() / n


class Trainer:
    """One method's heads, data split, batches and per-depth losses."""

    def __init__(self, cache: dict, cfg: TrainConfig, g: torch.Generator, device: torch.device) -> None:
        self.cache, self.cfg, self.g, self.device = cache, cfg, g, device
        self.lm_head = cache["lm_head"].float().to(device)

    def rows(self, name: str, rows: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        """Cached rows (host memory) on the training device, in float32."""
        t = self.cache[name] if layer is None else self.cache[name][layer]
        return t[rows].to(self.device).float()

    def target_logp(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.rows("final", rows) @ self.lm_head.T, -1)
