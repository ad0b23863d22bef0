"""int4 weights on PyTorch's int4 matmul kernels (``--quantization int4``): the kernels multiply by
the dequantized weights (bfloat16 activations and statistics), and an engine on them computes what a
model holding those weights in full precision does, and speculates exactly."""

from __future__ import annotations

import pytest
import torch
from test_engine import make_engine, prompts
from torch import nn

from engine.config import EngineConfig
from engine.quant import Int4Linear, dequantize_int4, quantize_int4
from engine.quant.int4 import group_size_for
from engine.request.sampling_params import SamplingParams
from engine.runner.model_runner import ForwardChunk

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def reference(x: torch.Tensor, linear: nn.Linear, group: int) -> torch.Tensor:
    """``x @ dequantize(quantize(W)).T + b`` in float32, from what the kernel sees: bfloat16
    activations, bfloat16 scales and zero points (``(q - 8) * scale + zero``)."""
    q, scale, lo = quantize_int4(linear.weight.detach(), group)
    s, zero = scale.bfloat16().float(), (lo + 8 * scale).bfloat16().float()
    w = dequantize_int4(q, s, zero - 8 * s)
    b = None if linear.bias is None else linear.bias.float()
    return nn.functional.linear(x.bfloat16().float(), w, b)


def test_quantize_round_trip():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 256, generator=g) * torch.rand(32, 1, generator=g) * 3
    w[3, :64] = 0.25  # a constant group: scale clamps, values come back exactly
    q, scale, lo = quantize_int4(w, 64)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15 and scale.shape == (32, 4)
    err = (dequantize_int4(q, scale, lo) - w).abs().reshape(32, 4, 64)
    assert (err <= scale[..., None] / 2 + 1e-6).all()
    assert err[3, 0].max() == 0
    assert (q.reshape(32, 4, 64).amax(-1) == 15).sum() > 100  # the groups use the whole range


def test_group_sizes():
    assert group_size_for(4096, 14336) == 128
    assert group_size_for(96, 64) == 32
    assert group_size_for(80, 64) is None  # inputs not in groups of 32
    assert group_size_for(128, 40) is None  # rows not a multiple of 16


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(256, 384), (96, 64)])
def test_kernel_multiplies_by_the_dequantized_weight(bias, shape):
    K, N = shape
    torch.manual_seed(1)
    linear = nn.Linear(K, N, bias=bias).to(DEVICE)
    group = group_size_for(K, N)
    x = torch.randn(3, 5, K, device=DEVICE)
    want = reference(x, linear, group)
    got = Int4Linear.from_linear(linear, group)(x)
    assert got.shape == (3, 5, N) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)  # the kernel's output is bfloat16
    assert (linear(x) - want).abs().max() > 0.1  # while 4 bits change the result by more
    linear, x = linear.to(torch.bfloat16), x.to(torch.bfloat16)
    got = Int4Linear.from_linear(linear, group)(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), reference(x, linear, group), atol=1e-2, rtol=1e-2)


def tiled_packer(inner_k_tiles: int, seed: int, tile_local: bool = True):
    """A packer in the CUDA kernel's form (``q [N, K]`` → ``[N/8, K/tk, 32, inner_k_tiles/2]`` int32, each
    8-row by ``tk``-input tile's nibbles in some order, eight to an int32, low nibble first) whose order
    within a tile is a random permutation: the same in every tile, or, with ``tile_local=False``, not."""
    tk = 16 * inner_k_tiles
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(8 * tk, generator=g)  # memory slot → element of the tile

    def pack(q: torch.Tensor) -> torch.Tensor:
        N, K = q.shape
        tiles = q.reshape(N // 8, 8, K // tk, tk).permute(0, 2, 1, 3).reshape(N // 8, K // tk, 8 * tk)
        slots = tiles[..., perm].clone()
        if not tile_local:
            slots[-1, -1] = slots[-1, -1].roll(1)
        words = slots.to(torch.int64).reshape(N // 8, K // tk, 32, inner_k_tiles // 2, 8)
        word = (words << (4 * torch.arange(8))).sum(-1)
        return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)

    return pack


@pytest.mark.parametrize("inner_k_tiles", [2, 8])
def test_the_packed_layout_is_read_off_the_packer(inner_k_tiles):
    """The dense path for many rows on CUDA reads its integers straight from the packed weight, in the
    order read off the packer at load (probes that spell each element's position): whatever the tile's
    permutation, every integer comes back in place; a layout that is not one tile repeated is refused."""
    from engine.quant.int4 import tile_order, unpack_tiles

    pack = tiled_packer(inner_k_tiles, seed=inner_k_tiles)
    order = tile_order(pack, inner_k_tiles, torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    N, K = 48, 3 * 16 * inner_k_tiles
    q = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    assert torch.equal(unpack_tiles(pack(q), order, N, K), q)
    other = tile_order(tiled_packer(inner_k_tiles, seed=99), inner_k_tiles, torch.device("cpu"))
    assert not torch.equal(unpack_tiles(pack(q), other, N, K), q)  # the order matters
    with pytest.raises(ValueError, match="not one tile"):
        tile_order(tiled_packer(inner_k_tiles, seed=1, tile_local=False), inner_k_tiles, torch.device("cpu"))


def test_many_rows_multiply_by_the_same_dequantized_weight():
    """From DENSE_ROWS rows a layer with a tile order multiplies on the dense GEMM by its weight
    dequantized from the packed form: the same integers and statistics the kernel uses, so its rows
    agree with the kernel's (CPU's, here) within bfloat16's rounding; the batch-invariant mode stays on
    the kernel at every row count."""
    from engine.quant.int4 import DENSE_ROWS, tile_order

    torch.manual_seed(2)
    K, N = 256, 96
    linear = nn.Linear(K, N, bias=True)
    group = group_size_for(K, N)
    layer = Int4Linear.from_linear(linear, group)
    x = torch.randn(DENSE_ROWS + 3, K)
    kernel = layer(x)
    assert layer.order is None  # a CPU's kernel takes every row count
    inner_k_tiles = 8
    pack = tiled_packer(inner_k_tiles, seed=5)
    q, _, _ = quantize_int4(linear.weight.detach(), group)
    dense = Int4Linear.from_linear(linear, group)
    dense.packed = pack(q)
    dense.order = tile_order(pack, inner_k_tiles, torch.device("cpu"))
    got = dense(x)
    torch.testing.assert_close(got, reference(x, linear, group), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got, kernel, atol=1e-2, rtol=1e-2)
    assert (linear(x) - got).abs().max() > 0.1  # the quantized weight, not the original
    assert not torch.equal(got, kernel)
    dense.invariant, dense.packed = True, layer.packed  # the kernel's own packing back: the kernel's bits
    assert torch.equal(dense(x), kernel)


def test_a_packer_whose_layout_cannot_be_read_leaves_every_row_count_on_the_kernel(caplog):
    """Where the CUDA packer cannot be probed (here: it has no CPU kernel), the layer keeps no tile order
    and runs every row count on the int4 kernel, as before the dense path; a warning says so."""
    from engine.quant.int4 import _cuda_tile_order

    with caplog.at_level("WARNING", logger="engine.quant.int4"):
        assert _cuda_tile_order(torch.device("cpu"), 8) is None
    assert "many rows stay on the kernel" in caplog.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_many_rows_on_cuda_agree_with_the_kernel():
    """On CUDA, the layout read off PyTorch's packer: a prefill's rows on the dense path equal, within
    bfloat16's rounding, the same rows run through the int4 kernel a few at a time."""
    from engine.quant.int4 import DENSE_ROWS

    torch.manual_seed(4)
    K, N = 4096, 1024
    linear = nn.Linear(K, N, bias=False).to("cuda", torch.bfloat16)
    layer = Int4Linear.from_linear(linear, group_size_for(K, N))
    x = torch.randn(DENSE_ROWS * 2, K, device="cuda", dtype=torch.bfloat16)
    dense = layer(x)
    few = torch.cat([layer(x[i : i + 8]) for i in range(0, x.shape[0], 8)])
    torch.testing.assert_close(dense.float(), few.float(), atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(dense.float(), reference(x, linear, group_size_for(K, N)), atol=3e-2, rtol=2e-2)


def test_engine_on_int4_computes_the_dequantized_model(llama_dir):
    """Every linear but the LM head becomes int4, and a forward's logits are those of the same model
    holding the dequantized weights in full precision (the reference's linears swapped by hand), up
    to bfloat16 activations: 20 times closer to them than to the unquantized model's."""
    engine = make_engine(llama_dir, device=str(DEVICE), quantization="int4")
    model = engine.runner.model
    assert type(model.lm_head) is not Int4Linear
    assert all(isinstance(m, Int4Linear) for n, m in model.named_modules() if n.endswith(("_proj", "proj")))
    ref = make_engine(llama_dir, device=str(DEVICE), batch_invariant="off")  # nn.Linear layers to edit
    for name, module in list(ref.runner.model.named_modules()):
        if isinstance(module, nn.Linear) and name != "lm_head":
            group = group_size_for(module.in_features, module.out_features)
            # In place: on a GPU the engine's captured graphs hold this tensor's address.
            module.weight.data.copy_(dequantize_int4(*quantize_int4(module.weight.detach(), group)))
    ids = prompts(1, seed=2, lo=20, hi=21)[0]
    logits = []
    for e in (engine, ref):
        table = e.block_manager.fork([]) or []
        assert e.block_manager.reserve(table, 0, len(ids)) is not None
        out = [e.runner.forward([ForwardChunk(ids[:12], 0, table, 12)]).logits]
        out += [e.runner.forward([ForwardChunk(ids[t : t + 1], t, table, 1)]).logits for t in range(12, len(ids))]
        logits.append(torch.cat(out))
    plain = make_engine(llama_dir, device=str(DEVICE)).runner.forward([ForwardChunk(ids, 0, list(range(8)), 20)])
    assert (logits[0] - logits[1]).abs().max() < (plain.logits - logits[1]).abs().max() / 20


def test_speculating_on_int4_is_plain_int4_decoding(llama_dir):
    """A full-precision draft (the model itself, unquantized) for the int4 target: exactly the int4
    target's greedy output."""
    ps = prompts(3, seed=5, lo=5, hi=25)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, num_draft_tokens=3)
    plain = make_engine(llama_dir, quantization="int4").generate(ps, params)
    spec = make_engine(
        llama_dir, quantization="int4", speculative_method="draft", draft_model=str(llama_dir), num_speculative_tokens=3
    )
    got = spec.generate(ps, params)
    assert [o.outputs[0].delta_token_ids for o in got] == [o.outputs[0].delta_token_ids for o in plain]
    assert spec.spec_stats.num_accepted_tokens > 0


def test_config_accepts_int4():
    assert EngineConfig(model="m", quantization="int4").quantization == "int4"
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(model="m", quantization="int3")


def test_bench_memory_report_counts_packed_weights(llama_dir):
    """``augur bench``'s memory line: the int4 engine's weights (packed, with their statistics) are
    well under the float32 model's; its KV pool is the same."""
    from engine.offline.measure import memory_report

    plain, int4 = (memory_report(make_engine(llama_dir, quantization=q)) for q in (None, "int4"))
    assert int4["weights_bytes"] < 0.6 * plain["weights_bytes"]
    assert int4["kv_pool_bytes"] == plain["kv_pool_bytes"] > 0


def test_nf4_checkpoint_is_not_requantized(tmp_path, llama_dir):
    """A checkpoint bitsandbytes saved in NF4 refuses ``--quantization int4`` before anything loads."""
    from test_nf4 import write_bnb_layout

    quant = write_bnb_layout(llama_dir, tmp_path / "nf4", nested=False)
    with pytest.raises(ValueError, match="cannot be re-quantized to int4"):
        make_engine(quant, quantization="int4")
