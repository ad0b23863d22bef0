"""``augur::small_linear`` (engine/models/small_linear.py): the AVX512-BF16 kernel for a decode's few
rows equals the float32 product to bfloat16 rounding, gives each row the same bits whatever the
number of rows it serves, hands more rows to oneDNN's packed weights, and a bf16 model loaded on
this CPU runs every linear layer through it, eager and compiled."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.models.small_linear import MAX_ROWS, SmallRowsLinear, load_small_linear
from engine.runner.loader import load_config, load_model
from engine.runner.model_runner import ForwardChunk, ModelRunner

pytestmark = pytest.mark.skipif(not load_small_linear(), reason="needs a CPU with AVX512-BF16 (and a compiler)")


def layer(n_in: int, n_out: int, bias: bool, seed: int = 0) -> tuple[nn.Linear, SmallRowsLinear]:
    torch.manual_seed(seed)
    lin = nn.Linear(n_in, n_out, bias=bias).to(torch.bfloat16)
    return lin, SmallRowsLinear(lin.weight, lin.bias)


def exact(lin: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return nn.functional.linear(x.float(), lin.weight.float(), None if lin.bias is None else lin.bias.float())


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 9, 40])
@pytest.mark.parametrize("n_in,n_out", [(320, 1728), (864, 320), (100, 37)])  # 100, 37: tails of both loops
@pytest.mark.parametrize("bias", [False, True])
def test_equals_the_float32_product_to_bf16_rounding(rows, n_in, n_out, bias):
    lin, small = layer(n_in, n_out, bias)
    x = torch.randn(rows, n_in).to(torch.bfloat16)
    with torch.inference_mode():
        got = small(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n_out)
    want = exact(lin, x)
    err = (got.float() - want).abs().max() / want.abs().max()
    assert err < 8e-3, err  # bf16 output rounding (2^-8) and float32 sums
    assert err > 0  # (bf16 rounding shows: the comparison is not of a tensor with itself)


def test_a_row_has_the_same_bits_however_many_rows_it_serves_with():
    """The kernel's sums run in one order for 1..MAX_ROWS rows: a verify's row is the decode's row."""
    _, small = layer(864, 322, True)
    x = torch.randn(MAX_ROWS, 864).to(torch.bfloat16)
    with torch.inference_mode():
        together = small(x)
        for r in range(MAX_ROWS):
            assert torch.equal(small(x[r : r + 1]), together[r : r + 1])
            assert torch.equal(small(x[: r + 1]), together[: r + 1])


def test_a_wrong_kernel_would_be_caught():
    """The tolerance is tight enough to catch a lost block of k (here: the input's last 32 columns)."""
    lin, small = layer(320, 64, False)
    x = torch.randn(2, 320).to(torch.bfloat16)
    x_cut = x.clone()
    x_cut[:, -32:] = 0
    with torch.inference_mode():
        got = small(x_cut)
    want = exact(lin, x)
    assert (got.float() - want).abs().max() / want.abs().max() > 8e-3


def test_other_dtypes_and_shapes_take_the_reference():
    w = torch.randn(16, 32)
    x = torch.randn(2, 32)
    assert torch.equal(torch.ops.augur.small_linear(x, w), nn.functional.linear(x, w))  # float32: F.linear
    x3 = torch.randn(2, 5, 32).to(torch.bfloat16)
    _, small = layer(32, 16, False)
    with torch.inference_mode():
        assert small(x3).shape == (2, 5, 16)  # leading dimensions kept
        assert small(x3[:0]).shape == (0, 5, 16)  # no rows (a forward with no logits asked for)
        # A float32 input beside bf16 packed weights is F.linear's, not oneDNN's: F.linear's answer.
        got = torch.ops.augur.small_linear(x, w, small.packed)
        assert torch.equal(got, nn.functional.linear(x, w))
        # A bias of the wrong size is F.linear's clear error, never a read past its end.
        with pytest.raises(RuntimeError):
            torch.ops.augur.small_linear(x3[0, :1], small.weight, small.packed, torch.zeros(3, dtype=torch.bfloat16))


def test_a_bf16_model_on_this_cpu_runs_every_linear_through_it(model_dirs):
    path = model_dirs["LlamaForCausalLM"]
    cfg = load_config(path)
    model = load_model(path, cfg, torch.bfloat16, torch.device("cpu"), 128)
    plain = [m for m in model.modules() if type(m) is nn.Linear]
    assert not plain
    small = [m for m in model.modules() if isinstance(m, SmallRowsLinear)]
    assert len(small) == 4 * cfg.num_hidden_layers + 1  # qkv, o, gate_up, down a layer, and the output layer
    f32 = load_model(path, cfg, torch.float32, torch.device("cpu"), 128)
    assert not any(isinstance(m, SmallRowsLinear) for m in f32.modules())  # float32: oneDNN's own


@pytest.mark.parametrize("compiled", [False, True])
def test_the_bf16_model_matches_its_float32_self(model_dirs, compiled):
    """Logits of a bf16 model through the kernel (decode and a 3-row verify) against the same weights
    in float32, within bf16's precision; compiled, the op runs inside the graph."""
    path = model_dirs["LlamaForCausalLM"]
    cfg = load_config(path)
    runners = []
    for dtype in (torch.bfloat16, torch.float32):
        model = load_model(path, cfg, dtype, torch.device("cpu"), 128, pack=not compiled)
        on = compiled and dtype == torch.bfloat16
        runners.append(ModelRunner(model, cfg, torch.device("cpu"), dtype, 4, 16, compile=on))
    prompt, table = list(range(3, 14)), [2, 5, 7, 1]
    outs = []
    for r in runners:
        r.forward([ForwardChunk(prompt, 0, table, 1)])
        one = r.forward([ForwardChunk([20], len(prompt), table, 1)]).logits
        three = r.forward([ForwardChunk([21, 22, 23], len(prompt) + 1, table, 3)]).logits
        outs.append((one, three))
    for got, want in zip(outs[0], outs[1]):
        assert (got - want).abs().max() < 0.05 * want.abs().max()


def test_a_large_model_served_eagerly_keeps_only_packed_weights(model_dirs, monkeypatch):
    """Small-rows layers hold their weights and a packed copy; a large eager model (whose layers would
    be packed) keeps only the packed copy instead, as before; compiled (no packing asked), small rows."""
    import engine.runner.loader as loader
    from engine.models.packed import PackedLinear

    monkeypatch.setattr(loader, "MIN_PACKED_BYTES", 0)  # every model counts as large here
    path = model_dirs["LlamaForCausalLM"]
    cfg = load_config(path)
    eager = load_model(path, cfg, torch.bfloat16, torch.device("cpu"), 128)
    assert any(isinstance(m, PackedLinear) for m in eager.modules())
    assert not any(isinstance(m, SmallRowsLinear) for m in eager.modules())
    compiled = load_model(path, cfg, torch.bfloat16, torch.device("cpu"), 128, pack=False)
    assert any(isinstance(m, SmallRowsLinear) for m in compiled.modules())
