"""Muon: momentum SGD whose update of each weight matrix is orthogonalised.

The update direction of a matrix is replaced by the nearest semi-orthogonal matrix (every singular value
set to one), found with a few Newton-Schulz iterations. No direction dominates the step, so rare
directions learn as fast as common ones; at a fixed number of steps a small transformer reaches a much
lower loss than with AdamW, which is what a model trained in minutes on a CPU needs (the demo pair:
``engine/offline/demo.py``). Only the hidden matrices of the blocks take Muon; embeddings, the output head and
norm gains stay with AdamW (:func:`optimizers`).
"""

from __future__ import annotations

import torch

# Quintic Newton-Schulz coefficients chosen for fast convergence from a spectral norm below one: the
# iteration pushes singular values towards ~1 (into roughly 0.7-1.2, close enough for a descent direction).
_NS_COEFFS = (3.4445, -4.7750, 2.0315)


def orthogonalise(g: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """An approximately semi-orthogonal matrix with ``g``'s singular vectors (``U V^T`` of its SVD).
    The iteration tolerates bf16, whose matmuls are several times faster where the hardware has them;
    pass float32 where it has not (CPUs without AMX or AVX-512 BF16)."""
    a, b, c = _NS_COEFFS
    x = g.to(dtype)
    x = x / (x.norm() + 1e-7)  # spectral norm <= Frobenius norm <= 1
    wide = x.shape[0] <= x.shape[1]
    if not wide:
        x = x.mT  # iterate on the smaller Gram matrix
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x if wide else x.mT).to(g.dtype)


class Muon(torch.optim.Optimizer):
    """Nesterov momentum, orthogonalised per matrix, scaled by ``sqrt(max(1, rows / cols))`` so tall and
    wide matrices move their outputs by similar amounts."""

    def __init__(
        self, params, lr: float = 0.02, momentum: float = 0.95, ns_steps: int = 5, ns_dtype=torch.bfloat16
    ) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum, "ns_steps": ns_steps, "ns_dtype": ns_dtype})
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"Muon updates matrices only, got a parameter of shape {tuple(p.shape)}")

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            beta = group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum", torch.zeros_like(p))
                buf.mul_(beta).add_(p.grad)
                update = orthogonalise(p.grad.add(buf, alpha=beta), group["ns_steps"], group["ns_dtype"])
                p.add_(update, alpha=-group["lr"] * max(1.0, p.shape[0] / p.shape[1]) ** 0.5)


def optimizers(
    model: torch.nn.Module, adam_lr: float, muon_lr: float, ns_dtype: torch.dtype = torch.bfloat16
) -> list[tuple[torch.optim.Optimizer, float]]:
    """(optimizer, peak learning rate) pairs: Muon for the blocks' weight matrices, AdamW for the rest
    (embeddings and the tied output head, norm gains)."""
    matrices, rest = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        is_matrix = p.ndim == 2 and "embed" not in name and "lm_head" not in name
        (matrices if is_matrix else rest).append(p)
    out: list[tuple[torch.optim.Optimizer, float]] = []
    if matrices:
        out.append((Muon(matrices, lr=muon_lr, ns_dtype=ns_dtype), muon_lr))
    if rest:
        out.append((torch.optim.AdamW(rest, lr=adam_lr, betas=(0.9, 0.95), weight_decay=0.0), adam_lr))
    return out
