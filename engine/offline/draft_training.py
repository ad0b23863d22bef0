"""What every ``augur train-draft`` method's trainer shares (``engine/offline/train_draft.py`` runs them):
the cached target rows on the training device, the target's distribution at a row, and the loss."""

from __future__ import annotations

import math
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
    warmup_frac: float = 0.05  # the learning rate's linear warm-up, as a share of the steps
    clip: float = 1.0  # the gradient's largest norm (0: not clipped)
    head_decay: float = 0.8  # loss weight of draft depth k: head_decay ** k
    unroll: int = 3  # eagle: steps per row (1 + those on its own outputs)
    draft_vocab: int = 0  # eagle: 0 = the target's whole vocabulary, else its most frequent ids
    heldout_frac: float = 0.05
    save_every: int = 200
    seed: int = 0
    block_size: int = 8  # dflash: the block (its root and block_size - 1 mask positions: the deepest draft)
    anchors: int = 32  # dflash: blocks trained per sequence and step


def lr_at(step: int, steps: int, peak: float, warmup_frac: float) -> float:
    """A linear warm-up over ``warmup_frac`` of the steps, then a cosine decay to 10% of the peak."""
    warm = max(1, int(steps * warmup_frac))
    if step < warm:
        return peak * (step + 1) / warm
    progress = (step - warm) / max(1, steps - warm)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


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


class SequenceTrainer(Trainer):
    """A trainer over whole sequences, packed (the EAGLE head, the DFlash drafter): a share of the
    sequences held out, the rest drawn in packs of about ``batch_size`` rows."""

    def __init__(self, cache: dict, cfg: TrainConfig, g: torch.Generator, device: torch.device) -> None:
        super().__init__(cache, cfg, g, device)
        seqs = torch.randperm(len(cache["first"]), generator=g)
        n_held = max(1, int(len(seqs) * cfg.heldout_frac))
        self.held_seqs, self.train_seqs = seqs[:n_held], seqs[n_held:]

    def _pack_under(self, order: torch.Tensor, budget: int) -> list[torch.Tensor]:
        """Split sequences into packs of about ``budget`` rows."""
        packs, cur, rows = [], [], 0
        lengths = self.cache["starts"][1:] - self.cache["starts"][:-1]
        for s in order.tolist():
            if cur and rows + int(lengths[s]) > budget:
                packs.append(torch.tensor(cur))
                cur, rows = [], 0
            cur.append(s)
            rows += int(lengths[s])
        if cur:
            packs.append(torch.tensor(cur))
        return packs

    def layer_config(self, num_layers: int):
        """A ``LlamaConfig`` of ``num_layers`` drafter layers at the target's shape and RoPE."""
        from transformers import LlamaConfig

        tc = self.cache["config"]
        keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")
        layer = {k: tc[k] for k in keep if tc.get(k) is not None}
        rope = tc.get("rope_parameters") or {"rope_type": "default", "rope_theta": tc.get("rope_theta", 10000.0)}
        layer.update(
            rms_norm_eps=tc.get("rms_norm_eps", 1e-6),
            hidden_act=tc.get("hidden_act", "silu"),
            max_position_embeddings=tc.get("max_position_embeddings", 2048),
            rope_parameters=rope,
            vocab_size=tc["vocab_size"],
            num_hidden_layers=num_layers,
        )
        return LlamaConfig(**layer)

    @staticmethod
    @torch.no_grad()
    def start(module: torch.nn.Module) -> None:
        """Random trainable matrices, and every decoder layer's residual branches at zero (its output
        projections): a drafter first passes its input through."""
        for p in module.parameters():
            if p.requires_grad and p.dim() > 1:
                torch.nn.init.normal_(p, 0.0, 0.02)
        for layer in module.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
