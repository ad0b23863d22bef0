"""Muon (engine/offline/muon.py), the optimiser that trains the demo pair's matrices."""

from __future__ import annotations

import pytest
import torch

from engine.offline.muon import Muon, optimizers, orthogonalise


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(64, 128), (128, 64), (96, 96)])
def test_orthogonalise_flattens_the_spectrum(shape, dtype):
    g = torch.Generator().manual_seed(0)
    # A badly conditioned matrix: singular values spread over two orders of magnitude.
    u, _ = torch.linalg.qr(torch.randn(shape[0], shape[0], generator=g))
    v, _ = torch.linalg.qr(torch.randn(shape[1], shape[1], generator=g))
    k = min(shape)
    m = u[:, :k] @ torch.diag(torch.logspace(0, -2, k)) @ v[:, :k].T
    o = orthogonalise(m, dtype=dtype)
    assert o.dtype == m.dtype
    s = torch.linalg.svdvals(o)
    assert s.max() < 1.3 and s.min() > 0.5, s  # from a 100x spread to a narrow band around 1
    # Same singular vectors: the orthogonalised matrix points where the gradient points.
    assert torch.sum(o * m) > 0


def test_muon_refuses_non_matrices():
    with pytest.raises(ValueError, match="matrices"):
        Muon([torch.nn.Parameter(torch.zeros(4))])


def test_optimizers_split_matrices_from_embeddings_and_norms():
    model = torch.nn.ModuleDict(
        {
            "embed_tokens": torch.nn.Embedding(10, 8),
            "proj": torch.nn.Linear(8, 8, bias=False),
            "norm": torch.nn.LayerNorm(8),
        }
    )
    (muon, muon_lr), (adam, adam_lr) = optimizers(model, adam_lr=1e-3, muon_lr=0.02)
    assert isinstance(muon, Muon) and isinstance(adam, torch.optim.AdamW) and (muon_lr, adam_lr) == (0.02, 1e-3)
    assert [p for g in muon.param_groups for p in g["params"]] == [model["proj"].weight]
    assert len([p for g in adam.param_groups for p in g["params"]]) == 3  # embedding, norm weight and bias


def test_muon_fits_a_linear_map():
    """A least-squares problem Muon must solve: the loss falls by orders of magnitude."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 32, generator=g)
    w_true = torch.randn(16, 32, generator=g)
    y = x @ w_true.T
    w = torch.nn.Parameter(torch.zeros(16, 32))
    opt = Muon([w], lr=0.05)
    first = None
    for step in range(300):
        for group in opt.param_groups:
            group["lr"] = 0.05 * (1 - step / 300) + 1e-3
        loss = ((x @ w.T - y) ** 2).mean()
        first = first if first is not None else loss.item()
        loss.backward()
        opt.step()
        w.grad = None
    assert loss.item() < first * 1e-2, (first, loss.item())
