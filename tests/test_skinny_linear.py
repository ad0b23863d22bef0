"""The few-rows linear kernel (engine/models/skinny_linear.py) against float64 sums, and its rows'
independence.

On CPU tensors the kernel runs in Triton's interpreter (conftest sets ``TRITON_INTERPRET=1`` without
CUDA); with CUDA, on the GPU (the battery in loadtest/gpu_checks.sh runs this file). The interpreter
truncates a float32 sum to bfloat16 where a GPU rounds it, so a result is checked within one unit in
the last place of the exact sum, plus the float32 sums' own error. Each check can fail: a kernel that
dropped a step of the inner dimension, read a neighbouring row or column, skipped the bias or tiled
a row's sums by the number of rows differs in what these compare.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.runner.loader import load_config, load_model
from engine.runner.model_runner import ForwardChunk, ModelRunner

skinny = pytest.importorskip("engine.models.skinny_linear", reason="needs Triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16, torch.float16]


def _close_to_exact(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    exact = x.double() @ w.double().T + (b.double() if b is not None else 0.0)
    ulp = 2.0 ** -(7 if got.dtype == torch.bfloat16 else 10)  # one unit in the last place, relative
    # float32 sums of K products of operands near 1: a few units of float32's last place times K
    slack = 1e-6 * x.shape[1] * (x.double().abs() @ w.double().abs().T)
    err = (got.double() - exact).abs()
    assert bool((err <= ulp * exact.abs() + slack + 1e-30).all()), float((err - ulp * exact.abs() - slack).max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(96, 64), (100, 300), (40, 520)])
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 64])
def test_the_kernel_gives_the_exact_sums_within_a_rounding(dtype, n, k, rows):
    """Uneven shapes on purpose: a last column block and a last inner step only partly inside."""
    g = torch.Generator().manual_seed(n * 1000 + k + rows)
    wide = torch.randn(rows, k + 8, generator=g).to(dtype).to(DEVICE)
    x = wide[:, :k]  # rows with a stride beyond their width, as a view would have
    w = torch.randn(n, k, generator=g).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=g).to(dtype).to(DEVICE)
    _close_to_exact(skinny.skinny_linear(x, w, b), x, w, b)
    _close_to_exact(skinny.skinny_linear(x, w, None), x, w, None)


@pytest.mark.parametrize(
    "tile", [skinny.Tiles(dot=False, block_n=16, block_k=64), skinny.Tiles(block_n=64, block_k=128)]
)
def test_other_tiles_and_one_row_on_the_cuda_cores_give_the_same_sums(tile):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 200, generator=g).to(torch.bfloat16).to(DEVICE)
    w = torch.randn(72, 200, generator=g).to(torch.bfloat16).to(DEVICE)
    b = torch.randn(72, generator=g).to(torch.bfloat16).to(DEVICE)
    _close_to_exact(skinny.skinny_linear(x, w, b, tile), x, w, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_bits_do_not_depend_on_the_other_rows_of_its_bucket(dtype):
    """A decode row alone, and the same row among the 2 to 16 rows of a verify: the same bits (the
    tiles depend on the layer's shape and the row bucket only). Past 16 rows another bucket begins."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(80, 136, generator=g).to(dtype).to(DEVICE)
    b = torch.randn(80, generator=g).to(dtype).to(DEVICE)
    x = torch.randn(64, 136, generator=g).to(dtype).to(DEVICE)
    alone = torch.cat([skinny.skinny_linear(x[i : i + 1], w, b) for i in range(16)])
    for rows in (2, 5, 16):
        assert torch.equal(skinny.skinny_linear(x[:rows], w, b), alone[:rows])
    # the other rows' values change nothing either (a row reading its neighbours would)
    shuffled = torch.cat([x[:1], torch.randn(15, 136, generator=g).to(dtype).to(DEVICE)])
    assert torch.equal(skinny.skinny_linear(shuffled, w, b)[0], alone[0])
    wide = torch.cat([skinny.skinny_linear(x[:40], w, b)[:1], skinny.skinny_linear(x[:64], w, b)[:1]])
    assert torch.equal(wide[0], wide[1])  # 40 and 64 rows: one bucket


def test_tiles_leave_no_multiprocessor_a_lone_last_wave():
    for n in (1024, 4096, 6144, 28672, 128256):
        t = skinny.tiles(n, 4096, sms=132)
        assert 16 <= t.block_n <= 64
        assert t.block_n == 16 or -(-n // t.block_n) >= 2 * 132
        assert t.block_n == 64 or -(-n // (2 * t.block_n)) < 2 * 132  # the widest that still gives two each
    assert skinny.tiles(4096, 64).block_k == 64  # not a step wider than the inner dimension


def test_more_rows_than_the_kernel_takes_are_refused_by_it_and_served_by_the_layer():
    layer = torch.nn.Linear(24, 40).to(torch.bfloat16).to(DEVICE)
    x = torch.randn(65, 24).to(torch.bfloat16).to(DEVICE)
    with pytest.raises(ValueError, match="at most 64 rows"):
        skinny.skinny_linear(x, layer.weight, layer.bias)
    want = F.linear(x, layer.weight, layer.bias)
    assert skinny.use_skinny_linear(layer) == 1 and type(layer) is skinny.SkinnyLinear
    assert torch.equal(layer(x), want)  # F.linear itself past 64 rows
    _close_to_exact(layer(x[:3].view(1, 3, 24)).view(3, 40), x[:3], layer.weight, layer.bias)
    assert skinny.use_skinny_linear(layer, on=False) == 1 and type(layer) is torch.nn.Linear


def test_a_model_switched_to_it_keeps_its_state_and_its_greedy_tokens(model_dirs, monkeypatch):
    """A bfloat16 Llama on the kernel for every linear layer (its LM head too): the same state dict, and
    a prefill's greedy tokens and logits as on F.linear, within the roundings the two orders of summing
    give; float32 layers are not switched. The model loads with plain linear layers, as on a GPU (a CPU
    with AVX512-BF16 would load its bfloat16 layers as small-rows layers, which the switch leaves)."""
    import engine.runner.loader as loader

    monkeypatch.setattr(loader, "small_rows_serve", lambda dtype, device: False)
    path = model_dirs["LlamaForCausalLM"]
    config = load_config(path)
    model = load_model(path, config, torch.bfloat16, torch.device(DEVICE), 64)
    keys = sorted(model.state_dict())
    prompt = [5, 9, 17, 33, 65, 120, 7, 8, 200, 11, 3, 4]

    def logits():
        runner = ModelRunner(model, config, torch.device(DEVICE), torch.bfloat16, 4, num_blocks=32)
        return runner.forward([ForwardChunk(prompt, 0, list(range(32)), len(prompt))]).logits

    plain = logits()
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert skinny.use_skinny_linear(model) == linears > 0
    assert sorted(model.state_dict()) == keys
    got = logits()
    assert (got - plain).abs().max() <= 0.05 * plain.abs().max()
    assert (got.argmax(-1) == plain.argmax(-1)).float().mean() >= 0.9
    fp32 = load_model(path, config, torch.float32, torch.device(DEVICE), 64)
    assert skinny.use_skinny_linear(fp32) == 0


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_an_fp8_layer_on_it_multiplies_the_same_quantized_operands(rows):
    """``--quantization fp8``'s layer (e4m3 weights with a scale per row, activations quantized per
    token) switched to the kernel: the exact sum of the same quantized operands within a rounding, and
    within a rounding of the layer's own ``torch._scaled_mm``; more rows run the layer as it was."""
    from engine.quant.fp8 import Fp8Linear

    g = torch.Generator().manual_seed(rows)
    dense = torch.nn.Linear(160, 48, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        dense.weight.copy_(torch.randn(48, 160, generator=g))
    holder = torch.nn.Sequential(Fp8Linear.from_linear(dense)).to(DEVICE)
    layer = holder[0]
    x = torch.randn(rows, 160, generator=g).to(torch.bfloat16).to(DEVICE)
    want = layer(x)
    assert skinny.use_skinny_linear(holder) == 1 and type(layer) is skinny.SkinnyFp8Linear
    got = layer(x)
    xq, sx = layer.tokens(x)
    exact = (xq.double() * sx.double()) @ (layer.weight.double() * layer.weight_scale.double().view(-1, 1)).T
    exact += layer.bias.double()
    ulp = 2.0**-7
    magnitudes = (xq.double().abs() * sx.double()) @ (layer.weight.double().abs().T * layer.weight_scale.double())
    slack = 1e-6 * 160 * magnitudes
    assert bool(((got.double() - exact).abs() <= 2 * ulp * exact.abs() + slack + 1e-30).all())
    assert bool(((got.double() - want.double()).abs() <= 2 * ulp * want.double().abs() + slack + 1e-30).all())
    many = torch.randn(65, 160, generator=g).to(torch.bfloat16).to(DEVICE)
    on_kernel = layer(many)
    assert skinny.use_skinny_linear(holder, on=False) == 1 and type(layer) is Fp8Linear
    assert torch.equal(on_kernel, layer(many))  # past 64 rows: the layer's own product


@pytest.mark.parametrize("rows", [1, 7, 64, 65])
@pytest.mark.parametrize("group", [128, 32])
def test_an_int4_layer_on_it_multiplies_its_dequantized_weight(monkeypatch, rows, group):
    """``--quantization int4``'s layer, switched to the kernel: its integers re-laid from the CUDA
    kernel's tiles (here a packer of the same form: tests/test_int4.py) to bytes by rows, and its few
    rows multiplied by the same dequantized weight the dense path uses (within a rounding: the kernel
    rounds each weight to bfloat16 on a GPU, and Triton's interpreter does not); past 64 rows the dense
    path itself. Switched back, it is the kernel's tiles again, byte for byte."""
    from test_int4 import tiled_packer

    from engine.quant.int4 import Int4Linear, quantize_int4, tile_order

    g = torch.Generator().manual_seed(rows + group)
    K, N = 256, 48
    linear = torch.nn.Linear(K, N, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(N, K, generator=g) * 0.05)
    pack = tiled_packer(8, seed=group)
    layer = Int4Linear.from_linear(linear, group)
    q, _, _ = quantize_int4(linear.weight.detach(), group)
    layer.packed, layer.order = pack(q), tile_order(pack, 8, torch.device("cpu"))
    tiles_before = layer.packed.clone()
    holder = torch.nn.Sequential(layer).to(DEVICE)
    want_weight = layer.dequantized()
    monkeypatch.setattr(skinny, "_tile_pack", lambda q, inner_k_tiles: pack(q.cpu()).to(q.device))
    assert skinny.use_skinny_linear(holder) == 1 and type(layer) is skinny.SkinnyInt4Linear
    assert layer.packed.shape == (N, K // 2) and torch.equal(layer.integers(), q.to(layer.packed.device))
    x = torch.randn(rows, K, generator=g).to(torch.bfloat16).to(DEVICE)
    got = layer(x)
    exact = x.double() @ want_weight.double().T + layer.bias.double()
    rounding = 2.0**-8 * (x.double().abs() @ want_weight.double().abs().T)  # each weight's bfloat16 rounding
    assert bool(((got.double() - exact).abs() <= 2.0**-7 * exact.abs() + rounding + 1e-3).all())
    if rows > 64:
        want = (torch.nn.functional.linear(x, want_weight) + layer.bias).to(got.dtype)
        assert torch.equal(got, want)
    assert skinny.use_skinny_linear(holder, on=False) == 1 and type(layer) is Int4Linear
    assert torch.equal(layer.packed.cpu(), tiles_before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_an_int4_layer_from_pytorchs_own_packer_round_trips_and_agrees_with_its_kernel():
    """On CUDA with PyTorch's packer: the layer's integers re-laid by rows and back give its packed
    tiles byte for byte, and its few rows on the kernel agree with PyTorch's int4 kernel within
    bfloat16's rounding."""
    from engine.quant.int4 import Int4Linear, group_size_for

    torch.manual_seed(6)
    K, N = 4096, 1024
    linear = torch.nn.Linear(K, N, bias=False).to("cuda", torch.bfloat16)
    holder = torch.nn.Sequential(Int4Linear.from_linear(linear, group_size_for(K, N)))
    layer = holder[0]
    assert layer.order is not None
    x = torch.randn(8, K, device="cuda", dtype=torch.bfloat16)
    tiles, want = layer.packed.clone(), layer(x)
    assert skinny.use_skinny_linear(holder) == 1
    torch.testing.assert_close(layer(x).float(), want.float(), atol=3e-2, rtol=2e-2)
    assert skinny.use_skinny_linear(holder, on=False) == 1 and torch.equal(layer.packed, tiles)
