"""The fused GPU kernels (engine/models/fused.py) against the eager expressions they replace.

On CPU tensors the kernels run in Triton's interpreter (conftest sets ``TRITON_INTERPRET=1`` without
CUDA); with CUDA, on the GPU. The kernels round to bfloat16 and float16 on the bits (``fused._round``):
a GPU compiler may fold a conversion and back away (an H200 did), so both are checked bit for bit on
both. Each check can fail: a kernel
that skipped the eager expression's rounding of a product, or read a neighbouring row, differs in the
bits these compare.
"""

from __future__ import annotations

import pytest
import torch
from test_gemma2 import build_gemma2_dir
from test_gemma3 import build_gemma3_dir
from test_mistral3 import build_dir as build_mistral3_dir
from test_moe import build_moe_dir

from engine.models.invariant import _act_mul, _rms_norm
from engine.models.llama import apply_rope
from engine.runner.loader import fused_ops_serve, load_config, load_model
from engine.runner.model_runner import ForwardChunk, ModelRunner

fused = pytest.importorskip("engine.models.fused", reason="needs Triton")

CUDA = torch.cuda.is_available()
DTYPES = [torch.bfloat16, torch.float16]
DEVICE = "cuda" if CUDA else "cpu"


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance in units of the last place between same-dtype tensors (finite values)."""
    bits = {torch.float16: torch.int16, torch.bfloat16: torch.int16}[a.dtype]
    ia, ib = a.view(bits).to(torch.int32), b.view(bits).to(torch.int32)
    ia = torch.where(ia < 0, -(ia & 0x7FFF), ia)  # sign-magnitude → a monotone integer line
    ib = torch.where(ib < 0, -(ib & 0x7FFF), ib)
    return int((ia - ib).abs().max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(128, 4, 2), (80, 2, 1), (64, 3, 3)])
def test_rope_gives_the_eager_expressions_bits(dtype, head_dim, heads, kv_heads):
    g = torch.Generator().manual_seed(head_dim)
    T, D = 7, head_dim
    width = (heads + 2 * kv_heads) * D
    wide = torch.randn(T, width + 16, generator=g).to(dtype).to(DEVICE)
    qkv = wide[:, :width]  # rows with a stride beyond their width, as a view would have
    cos = torch.randn(T, 1, D, generator=g).to(dtype).to(DEVICE)
    sin = torch.randn(T, 1, D, generator=g).to(dtype).to(DEVICE)
    q, k = fused.fused_rope(qkv, cos, sin, heads, kv_heads)
    q_ref, k_ref, _ = qkv.split([heads * D, kv_heads * D, kv_heads * D], dim=-1)
    assert torch.equal(q, apply_rope(q_ref.reshape(T, heads, D), cos, sin))
    assert torch.equal(k, apply_rope(k_ref.reshape(T, kv_heads, D), cos, sin))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unit_offset", [False, True], ids=["qwen3", "gemma3"])
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(128, 4, 2), (80, 2, 1)])
def test_rope_with_the_heads_norms_gives_the_two_kernels_bits(dtype, unit_offset, head_dim, heads, kv_heads):
    """Qwen3's and Gemma 3's q/k norms inside the RoPE kernel: the bits of fused_rms_norm per head
    followed by the eager rotation, whose own kernels they replace."""
    g = torch.Generator().manual_seed(head_dim + unit_offset)
    T, D = 6, head_dim
    width = (heads + 2 * kv_heads) * D
    qkv = (torch.randn(T, width + 8, generator=g) * 3).to(dtype).to(DEVICE)[:, :width]
    cos = torch.randn(T, 1, D, generator=g).to(dtype).to(DEVICE)
    sin = torch.randn(T, 1, D, generator=g).to(dtype).to(DEVICE)
    qw = (torch.randn(D, generator=g) * 0.5).to(dtype).to(DEVICE)
    kw = (torch.randn(D, generator=g) * 0.5).to(dtype).to(DEVICE)
    q, k = fused.fused_rope(qkv, cos, sin, heads, kv_heads, qw, kw, 1e-6, unit_offset)
    q_ref, k_ref, _ = qkv.split([heads * D, kv_heads * D, kv_heads * D], dim=-1)
    q_normed = fused.fused_rms_norm(q_ref.reshape(T, heads, D), qw, 1e-6, unit_offset)
    k_normed = fused.fused_rms_norm(k_ref.reshape(T, kv_heads, D), kw, 1e-6, unit_offset)
    assert torch.equal(q, apply_rope(q_normed, cos, sin))
    assert torch.equal(k, apply_rope(k_normed, cos, sin))
    # Each head took its own norm weights (q's for q, k's for k), and its own row's sum of squares.
    assert not torch.equal(k, apply_rope(fused.fused_rms_norm(k_ref.reshape(T, kv_heads, D), qw, 1e-6, unit_offset),
                                         cos, sin))  # fmt: skip
    one_q, one_k = fused.fused_rope(qkv[2:3], cos[2:3], sin[2:3], heads, kv_heads, qw, kw, 1e-6, unit_offset)
    assert torch.equal(one_q, q[2:3]) and torch.equal(one_k, k[2:3])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norms", [False, True], ids=["llama", "qwen3"])
def test_rope_writes_each_tokens_kv_where_the_attention_operator_would(dtype, norms):
    """With a pool and the tokens' slots, the RoPE kernel also stores each token's rotated k and its v
    in its slot of the layer's pool: the very rows write_rows stores, nothing else touched."""
    from engine.attention.kv_dtype import write_rows

    g = torch.Generator().manual_seed(7 + norms)
    T, D, heads, kv_heads, layers, num_slots = 5, 64, 4, 2, 3, 12
    width = (heads + 2 * kv_heads) * D
    qkv = torch.randn(T, width, generator=g).to(dtype).to(DEVICE)
    cos = torch.randn(T, 1, D, generator=g).to(dtype).to(DEVICE)
    sin = torch.randn(T, 1, D, generator=g).to(dtype).to(DEVICE)
    weight = lambda: torch.randn(D, generator=g).to(dtype).to(DEVICE)  # noqa: E731
    extra = (weight(), weight(), 1e-6, False) if norms else (None, None, 0.0, False)  # q/k norms, eps, offset
    pool = torch.randn(layers, 2, num_slots, kv_heads, D, generator=g).to(dtype).to(DEVICE)
    want = pool.clone()
    slots = torch.tensor([9, 0, 4, 11, 3], device=DEVICE)  # out of order, as a paged batch's are
    q, k = fused.fused_rope(qkv, cos, sin, heads, kv_heads, *extra, pool, 1, slots)
    q_ref, k_ref = fused.fused_rope(qkv, cos, sin, heads, kv_heads, *extra)
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    v = qkv[:, (heads + kv_heads) * D :].reshape(T, kv_heads, D)
    write_rows(want[1, 0], slots, k_ref, None)
    write_rows(want[1, 1], slots, v, None)
    assert torch.equal(pool, want)  # the two rows of each token, and every other slot and layer as it was


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unit_offset", [False, True], ids=["llama", "gemma"])
def test_norms_round_as_eager_and_each_row_alone(dtype, unit_offset):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 300, generator=g).to(dtype).to(DEVICE)
    delta = torch.randn(9, 300, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(300, generator=g) * 0.5).to(dtype).to(DEVICE)
    out = fused.fused_rms_norm(x, w, 1e-6, unit_offset)
    # Within one unit in the last place of eager torch's (the sum of squares is reduced in another order).
    assert _ulps(out, _rms_norm(x, w, 1e-6, unit_offset)) <= 1
    normed, total = fused.fused_add_rms_norm(x, delta, w, 1e-6, unit_offset)
    assert torch.equal(total, x + delta)  # the residual sum, rounded as torch rounds it
    assert torch.equal(normed, fused.fused_rms_norm(x + delta, w, 1e-6, unit_offset))
    # A row's result does not depend on the rows beside it.
    for i in (0, 4, 8):
        assert torch.equal(fused.fused_rms_norm(x[i : i + 1], w, 1e-6, unit_offset), out[i : i + 1])
        assert torch.equal(fused.fused_add_rms_norm(x[i : i + 1], delta[i : i + 1], w, 1e-6, unit_offset)[0],
                           normed[i : i + 1])  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_act_mul_rounds_the_activation_first(dtype, act):
    g = torch.Generator().manual_seed(2)
    gate_up = (torch.randn(5, 2 * 1500, generator=g) * 3).to(dtype).to(DEVICE)  # inner 1500: two programs a row
    out = fused.fused_act_mul(gate_up, act)
    ref = _act_mul(gate_up, act)
    assert out.shape == ref.shape
    # Close to eager torch everywhere (its tanh and exp are not Triton's: a last bit, and in GELU's far
    # negative tail, where torch's 1 + tanh(u) cancels, a few more of a tiny value), equal almost always.
    assert ((out.float() - ref.float()).abs() <= ref.float().abs() * 2**-9 + 2**-12).all()
    assert (out != ref).float().mean() < 0.1
    # Rounding the activation to the dtype before the product is what keeps it equal: the same product
    # taken in float32 throughout differs far more often.
    gate, up = gate_up.float().chunk(2, dim=-1)
    fp32 = torch.nn.functional.silu(gate) if act == "silu" else torch.nn.functional.gelu(gate, approximate="tanh")
    assert ((fp32 * up).to(dtype) != ref).float().mean() > 0.15


def _set_fused(model, on: bool) -> None:
    if on:
        model.use_fused_ops()
    else:
        for m in model.modules():
            if hasattr(m, "fused"):
                m.fused = False


def _logits(model, config, dtype, device, prompt) -> torch.Tensor:
    runner = ModelRunner(model, config, torch.device(device), dtype, 4, num_blocks=32)
    table = list(range(32))
    out = runner.forward([ForwardChunk(prompt, 0, table, len(prompt))]).logits
    return out


@pytest.fixture(scope="module")
def family_dirs(model_dirs, tmp_path_factory, tokenizer_dir):
    dirs = {arch: model_dirs[arch] for arch in ("LlamaForCausalLM", "Qwen3ForCausalLM")}  # Qwen3: q/k norms
    dirs["Gemma2ForCausalLM"] = build_gemma2_dir(tmp_path_factory.mktemp("gemma2") / "m", tokenizer_dir, std=0.08)
    # Gemma 3: q/k norms scaled by 1 + weight
    dirs["Gemma3ForCausalLM"] = build_gemma3_dir(tmp_path_factory.mktemp("gemma3"), tokenizer_dir, "text")
    # Qwen3-MoE: its routing on augur::moe_route (on CUDA the routing and layout kernels), q/k norms
    dirs["Qwen3MoeForCausalLM"] = build_moe_dir(tmp_path_factory.mktemp("moe"), tokenizer_dir, "Qwen3MoeForCausalLM")
    # Ministral 3: queries scaled by position after the fused RoPE (the scale steps up at position 8)
    dirs["Ministral3ForCausalLM"] = build_mistral3_dir(
        tmp_path_factory.mktemp("ministral3"), tokenizer_dir, "ministral3"
    )
    return dirs


ARCHS = [
    "LlamaForCausalLM", "Qwen3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Qwen3MoeForCausalLM",
    "Ministral3ForCausalLM",
]  # fmt: skip


@pytest.mark.parametrize("arch", ARCHS)
def test_a_model_on_the_fused_kernels_matches_its_eager_forward(family_dirs, arch, monkeypatch):
    dtype = torch.bfloat16
    path = family_dirs[arch]
    config = load_config(path)
    model = load_model(path, config, dtype, torch.device(DEVICE), 64)
    assert any(getattr(m, "fused", False) for m in model.modules()) == fused_ops_serve(torch.device(DEVICE), dtype)
    prompt = [5, 9, 17, 33, 65, 120, 7, 8, 200, 11]
    _set_fused(model, False)
    eager = _logits(model, config, dtype, DEVICE, prompt)
    _set_fused(model, True)
    assert all(m.fused for m in model.modules() if hasattr(m, "fused") and not _kept_eager(m))
    rope, ropes = torch.ops.augur.fused_rope, []
    monkeypatch.setattr(torch.ops.augur, "fused_rope", lambda *a: ropes.append(1) or rope(*a))
    got = _logits(model, config, dtype, DEVICE, prompt)
    assert len(ropes) == config.num_hidden_layers  # (every layer's attention turned q and k on the kernel)
    # The norms may differ from torch's in a last bit, and the difference travels: close, not equal.
    assert (got - eager).abs().max() <= 0.05 * eager.abs().max()
    assert (got.argmax(-1) == eager.argmax(-1)).float().mean() >= 0.9


def test_a_model_writes_its_kv_in_ropes_kernel_with_the_bits_the_attention_operator_writes(model_dirs, monkeypatch):
    """On the triton attention backend (Triton's interpreter here) a fused model writes the new K/V in
    RoPE's kernel: the same logits and the same pool, bit for bit, as with the operator's two copies."""
    from engine.attention.triton_paged import TritonMetadata

    path = model_dirs["Qwen3ForCausalLM"]
    config = load_config(path)
    dtype = torch.bfloat16
    model = load_model(path, config, dtype, torch.device(DEVICE), 64)
    _set_fused(model, True)
    prompt = [5, 9, 17, 33, 65, 120, 7, 8, 200, 11]
    outs, pools, writes = [], [], []
    real = TritonMetadata.kv_write_slots
    for fold in (True, False):

        def slots(meta, kv_pool, fold=fold):
            got = real(meta, kv_pool) if fold else None
            writes.append(got is not None)
            return got

        monkeypatch.setattr(TritonMetadata, "kv_write_slots", slots)
        runner = ModelRunner(model, config, torch.device(DEVICE), dtype, 4, num_blocks=32, attention_backend="triton")
        table = list(range(32))
        runner.forward([ForwardChunk(prompt, 0, table, len(prompt))])
        outs.append(runner.forward([ForwardChunk([42], len(prompt), table, 1)]).logits)
        pools.append(runner.kv_cache.clone())
    assert any(writes) and not all(writes)  # the first pass wrote in RoPE's kernel, the second did not
    assert torch.equal(outs[0], outs[1]) and torch.equal(pools[0], pools[1])


def _kept_eager(module) -> bool:
    from engine.models.llama import LlamaMLP

    return isinstance(module, LlamaMLP) and module.act_name not in fused.FUSED_ACTIVATIONS


def test_the_loader_turns_them_on_for_half_precision_cuda_only():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert fused_ops_serve(cuda, torch.bfloat16) and fused_ops_serve(cuda, torch.float16)
    assert not fused_ops_serve(cuda, torch.float32)  # float32 keeps the eager expressions
    assert not fused_ops_serve(cpu, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"])
def test_fused_kernels_inside_captured_graphs_on_gpu(family_dirs, arch):
    """A bfloat16 model on CUDA serves on the fused kernels (Qwen3's q/k norms inside RoPE's; Qwen3-MoE's
    routing and row layout), and its captured graphs replay what the eager forward computes."""
    path = family_dirs[arch]
    config = load_config(path)
    model = load_model(path, config, torch.bfloat16, torch.device("cuda"), 64)
    assert all(m.fused for m in model.modules() if hasattr(m, "fused"))
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    kw = dict(num_blocks=64, attention_backend="triton")
    graphed = ModelRunner(model, config, cuda, bf16, 4, cuda_graph_max_seqs=2, **kw)
    eager = ModelRunner(model, config, cuda, bf16, 4, **kw)
    assert graphed.graphs is not None
    outs = []
    for runner in (graphed, eager):
        table = list(range(40, 64))  # past the blocks a graph's warm-up writes
        runner.forward([ForwardChunk(list(range(3, 23)), 0, table, 1)])
        outs.append(runner.forward([ForwardChunk([7], 20, table, 1)]).logits)
    assert graphed.graphs.graphs  # the decode replayed a captured graph
    # The matrix products of a 20-token prefill padded to a graph's 32 rows may round otherwise than
    # eager's 20 (cuBLAS picks kernels by shape): close, the same argmax.
    assert (outs[0] - outs[1]).abs().max() <= 0.05 * outs[1].abs().max()
    assert torch.equal(outs[0].argmax(-1), outs[1].argmax(-1))
