"""An FP8 KV cache (``--kv-cache-dtype fp8``, engine/attention/kv_dtype.py).

- Every attention path (the Python reference, the C++ CPU kernel's fused and gathered paths and its
  batch-invariant op, the Triton kernel in its interpreter, with and without split keys) writes the
  same bytes into an FP8 pool and computes attention over exactly ``stored * scale``: the reference
  over an FP8 pool equals the reference over a pool in the model's dtype holding those values; a
  scale applied in the wrong place, or not at all, fails it.
- A token takes half the bytes of bfloat16 (a quarter of float32), so the same memory holds twice
  the tokens; draft caches are FP8 too.
- The logits stay within the stated tolerance of the model's own cache (docs/quantization.md).
- The checkpoint's K/V scales (llm-compressor's ``self_attn.k_scale``, AutoFP8's
  ``k_proj.output_scale``; one per layer or per KV head, a rank's heads under tensor parallelism)
  are loaded and used.
- Every proposer stays greedy-exact against the FP8-cached target, in bfloat16; served through the SDK.
"""

from __future__ import annotations

import types

import pytest
import torch
from families import check_served
from safetensors.torch import load_file, save_file
from test_attention_backends import KINDS, random_batch
from test_engine import make_engine
from test_step import prompts as repetitive_prompts
from tp_ranks import _chunks

from conftest import build_model_dir, tiny_config
from engine.attention import kv_dtype, metadata_builder, paged_attention
from engine.attention.cpu_kernel import load_cpu_kernel
from engine.attention.sdpa import _paged_attention_impl
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.models.llama import LlamaAttention
from engine.parallel import TensorParallel
from engine.platform import triton_interpreted
from engine.request.sampling_params import SamplingParams
from engine.runner.loader import load_config, load_model
from engine.runner.model_runner import ModelRunner, kv_pool_blocks

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FP8 = kv_dtype.FP8
# Logits over an FP8 cache against the model's own cache: at most this share of the largest logit
# (E4M3 keeps 3 mantissa bits: each cached value is within 1/16 of itself; measured ~5% on these models).
LOGIT_TOLERANCE = 0.08


def fp8_batch(seed: int, kinds: list[str], dtype=torch.float32, spread: float = 1.0):
    """A random batch (test_attention_backends.random_batch) over an FP8 pool of the same cached values."""
    lists, positions, pool, q, k, v = random_batch(seed, kinds, 8, 2, 16, 4, dtype=dtype)
    return lists, positions, kv_dtype.quantize(pool.flatten(0, 2) * spread, None).view(pool.shape), q, k, v


def reference(lists, positions, pool, q, k, v, kv_scales=None):
    """The op's Python implementation on ``pool`` (a copy): (output, pool after the write)."""
    pool = pool.clone()
    meta = metadata_builder("sdpa")(**lists, positions=positions)
    D = q.shape[-1]
    out = _paged_attention_impl(
        q, k, v, pool, 0, meta.slot_mapping, meta.kv_slots, meta.mask, meta.q_index, D**-0.5, 0.0, None, kv_scales
    )  # fmt: skip
    return out, pool


@pytest.mark.parametrize("scaled", [False, True], ids=["unscaled", "scaled"])
def test_the_reference_attends_over_stored_times_scale(scaled):
    """Over an FP8 pool, attention is the model-dtype attention over ``stored * scale`` (the new rows
    quantized and dequantized), and the pool holds ``round(x / scale)``."""
    lists, positions, pool, q, k, v = fp8_batch(1, KINDS["mixed"])
    scales = torch.tensor([[0.5, 2.0], [0.25, 4.0]]) if scaled else None
    out, written = reference(lists, positions, pool, q, k, v, scales)

    k_s, v_s = (None, None) if scales is None else scales.unbind(0)
    plain = torch.stack([kv_dtype.dequantize(pool[0, i], s, torch.float32) for i, s in enumerate((k_s, v_s))])[None]
    k_rt = kv_dtype.dequantize(kv_dtype.quantize(k, k_s), k_s, torch.float32)
    v_rt = kv_dtype.dequantize(kv_dtype.quantize(v, v_s), v_s, torch.float32)
    want, want_pool = reference(lists, positions, plain, q, k_rt, v_rt)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)
    back = torch.stack([kv_dtype.dequantize(written[0, i], s, torch.float32) for i, s in enumerate((k_s, v_s))])
    torch.testing.assert_close(back, want_pool[0], atol=0, rtol=0)
    if scaled:  # the scales matter: the same pool read as unscaled is another attention
        unscaled, _ = reference(lists, positions, pool, q, k, v)
        assert (unscaled - out).abs().max() > 0.1


def test_values_saturate_at_the_largest_fp8():
    x = torch.tensor([[[1000.0, -1000.0, 3.0, 0.0]]])
    assert kv_dtype.quantize(x, torch.tensor([2.0])).float().tolist() == [[[448.0, -448.0, 1.5, 0.0]]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kinds", ["decodes", "mixed"])
@pytest.mark.parametrize("scaled", [False, True], ids=["unscaled", "scaled"])
def test_the_cpu_kernel_writes_the_same_bytes_and_attends_alike(dtype, kinds, scaled):
    """The C++ kernel's fused path (decodes, trees, short chunks), its gathered path (long chunks) and
    the batch-invariant op against the reference: the same pool bytes, outputs within float rounding."""
    assert load_cpu_kernel()
    lists, positions, pool, q, k, v = fp8_batch(5, KINDS[kinds] + ["chunk"] * (kinds == "mixed"), dtype)
    if kinds == "mixed":  # one chunk past the fused path's 32 queries: the gathered path runs
        lists["q_lens"][-1] = 40
        T = sum(lists["q_lens"])
        q, k, v = (
            torch.randn(T, x.shape[1], 16, generator=torch.Generator().manual_seed(2)).to(dtype) for x in (q, k, v)
        )
        positions = torch.cat([positions[: T - 40], torch.arange(40) + lists["ctx_lens"][-1]])
        need = -(-(lists["ctx_lens"][-1] + 40) // 4)
        lists["block_tables"][-1] = list(range(pool.shape[2] // 4, pool.shape[2] // 4 + need))
        pool = torch.cat([pool, torch.zeros(1, 2, need * 4, 2, 16).to(FP8)], 2)
    scales = torch.tensor([[0.5, 2.0], [0.25, 4.0]]) if scaled else None
    want, want_pool = reference(lists, positions, pool, q, k, v, scales)
    meta = metadata_builder("sdpa")(**lists, positions=positions)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for op in (torch.ops.augur.paged_attention, torch.ops.augur.paged_attention_rows):
        got_pool = pool.clone()
        args = (q, k, v, got_pool, 0, meta.slot_mapping, meta.kv_slots, meta.mask, meta.q_index, 16**-0.5, 0.0)
        got = op(*args, kv_scales=scales)
        assert torch.equal(kv_dtype.raw(got_pool), kv_dtype.raw(want_pool)), op
        torch.testing.assert_close(got.float(), want.float(), **tol)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("scaled", [False, True], ids=["unscaled", "scaled"])
def test_the_triton_kernel_reads_fp8_tiles(splits, scaled):
    """The Triton kernel (interpreted on a CPU) converts FP8 tiles as it loads them and applies the
    scales to the scores (K) and the output (V), in one key range and in split ranges combined."""
    pytest.importorskip("triton")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not triton_interpreted():
        pytest.skip("Triton's interpreter is not on (TRITON_INTERPRET=1)")
    lists, positions, pool, q, k, v = fp8_batch(9, KINDS["mixed"] + ["tree"])
    scales = torch.tensor([[0.5, 2.0], [0.25, 4.0]]) if scaled else None
    want, want_pool = reference(lists, positions, pool, q, k, v, scales)
    got_pool = pool.to(device)
    meta = metadata_builder("triton")(**lists, positions=positions.to(device), device=device, num_splits=splits)
    dev = [x.to(device) for x in (q, k, v)]
    got = paged_attention(*dev, got_pool, 0, meta, 16**-0.5, kv_scales=None if scales is None else scales.to(device))
    assert torch.equal(kv_dtype.raw(got_pool).cpu(), kv_dtype.raw(want_pool))
    torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=2e-5)


# -- the pool -----------------------------------------------------------------------------------------
def runner(model_dir, dtype, kv_cache_dtype, num_blocks=8) -> ModelRunner:
    config = load_config(model_dir)
    model = load_model(model_dir, config, dtype, torch.device("cpu"), 256, pack=False)
    return ModelRunner(
        model, config, torch.device("cpu"), dtype, 16, num_blocks=num_blocks, kv_cache_dtype=kv_cache_dtype
    )


def test_a_token_takes_half_the_bytes_and_the_pool_holds_twice_the_tokens(llama_dir):
    runners = {
        (dt, kvd): runner(llama_dir, dt, kvd) for dt in (torch.float32, torch.bfloat16) for kvd in ("auto", "fp8")
    }
    fp8 = runners[torch.bfloat16, "fp8"]
    assert fp8.kv_cache.dtype == FP8 and runners[torch.float32, "fp8"].kv_cache.dtype == FP8
    assert 2 * fp8.kv_bytes_per_token == runners[torch.bfloat16, "auto"].kv_bytes_per_token
    assert 4 * fp8.kv_bytes_per_token == runners[torch.float32, "auto"].kv_bytes_per_token
    assert 2 * fp8.kv_cache.nbytes == runners[torch.bfloat16, "auto"].kv_cache.nbytes  # same blocks, half the bytes
    # Sized from memory (a share small enough to be sized by it, not by the CPU's cap on a full batch):
    sizing = types.SimpleNamespace(block_size=16, kv_cache_memory_fraction=1e-4, max_num_seqs=10**9)
    blocks = {kvd: kv_pool_blocks(runners[torch.bfloat16, kvd], 0, sizing, 256) for kvd in ("auto", "fp8")}
    assert blocks["fp8"] == pytest.approx(2 * blocks["auto"], rel=0.02)


def test_logits_stay_within_the_stated_tolerance(llama_dir):
    for dtype in (torch.float32, torch.bfloat16):
        own, fp8 = runner(llama_dir, dtype, "auto"), runner(llama_dir, dtype, "fp8")
        for chunks in _chunks():
            want = own.forward(chunks).logits.float()
            got = fp8.forward(chunks).logits.float()
            err = (got - want).abs().max()
            assert 0 < err <= LOGIT_TOLERANCE * want.abs().max(), (dtype, err)


# -- scales from the checkpoint ------------------------------------------------------------------------
def with_kv_scales(src, dst, tensors: dict[str, torch.Tensor]):
    """A copy of checkpoint ``src`` with ``tensors`` added."""
    import shutil

    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    save_file({**weights, **tensors}, dst / "model.safetensors")
    return dst


def test_checkpoint_scales_are_loaded_and_used(llama_dir, tmp_path):
    config = load_config(llama_dir)
    layers = config.num_hidden_layers
    k_scales = torch.tensor([0.05, 0.1])  # per KV head
    scaled = with_kv_scales(
        llama_dir,
        tmp_path / "llm-compressor",
        {
            **{f"model.layers.{i}.self_attn.k_scale": k_scales * (i + 1) for i in range(layers)},
            **{f"model.layers.{i}.self_attn.v_scale": torch.tensor(0.02 * (i + 1)) for i in range(layers)},
        },
    )
    autofp8 = with_kv_scales(
        llama_dir,
        tmp_path / "autofp8",
        {
            **{f"model.layers.{i}.self_attn.k_proj.output_scale": k_scales * (i + 1) for i in range(layers)},
            **{
                f"model.layers.{i}.self_attn.v_proj.output_scale": torch.tensor([0.02 * (i + 1)]) for i in range(layers)
            },
        },
    )
    want = torch.stack([torch.stack([k_scales * (i + 1), torch.full((2,), 0.02 * (i + 1))]) for i in range(layers)])
    for d in (scaled, autofp8):
        r = runner(d, torch.float32, "fp8")
        got = torch.stack([layer.self_attn.kv_scales for layer in r.model.layers])
        torch.testing.assert_close(got, want)
        chunks = next(iter(_chunks()))
        logits = r.forward(chunks).logits
        unscaled = runner(llama_dir, torch.float32, "fp8").forward(chunks).logits
        assert not torch.equal(logits, unscaled)
        own = runner(llama_dir, torch.float32, "auto").forward(chunks).logits
        assert (logits - own).abs().max() <= LOGIT_TOLERANCE * own.abs().max()


def test_a_ranks_heads_keep_their_scales():
    config = tiny_config("LlamaForCausalLM", num_key_value_heads=4)
    attn = LlamaAttention(config, 0, False, False, False, tp=TensorParallel(rank=1, size=2))
    attn.set_kv_scale("k", torch.tensor([1.0, 2.0, 3.0, 4.0]))
    attn.set_kv_scale("v", torch.tensor(0.5))
    assert attn.kv_scales.tolist() == [[3.0, 4.0], [0.5, 0.5]]
    with pytest.raises(ValueError, match="one or 4 expected"):
        attn.set_kv_scale("k", torch.ones(3))


def test_an_unknown_cache_dtype_is_refused():
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \['auto', 'fp8'\]"):
        EngineConfig(model="m", kv_cache_dtype="int8")


# -- served, and speculating ---------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["draft", "ngram", "layer-skip", "eagle"])
def test_every_proposer_is_greedy_exact_on_an_fp8_cache(llama_dir, tmp_path, tokenizer_dir, method):
    """In bfloat16 (batch-invariant, as a CPU serves it), a drafting engine's greedy tokens equal the
    plain engine's over the same FP8 cache; a draft model's own cache is FP8 too."""
    from test_eagle import write_eagle
    from test_layer_skip import write_skip

    from engine.models.layer_skip import LayerSkip

    kw = {
        "draft": lambda: dict(
            draft_model=str(build_model_dir(tmp_path / "draft", tokenizer_dir, "LlamaForCausalLM", seed=4)),
            spec_tree_topk=2,
        ),
        "layer-skip": lambda: dict(layer_skip_config=write_skip(tmp_path, LayerSkip(frozenset({1}), frozenset()))),
        "eagle": lambda: dict(draft_model=str(write_eagle(llama_dir, tmp_path / "eagle")), spec_tree_topk=2),
    }.get(method, dict)()
    common = dict(dtype="bfloat16", kv_cache_dtype="fp8", num_kv_blocks=256, block_size=4)
    ps = repetitive_prompts(6, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    plain = LLMEngine(EngineConfig(model=str(llama_dir), device="cpu", **common))
    assert plain.runner.kv_cache.dtype == FP8 and plain.batch_invariant
    want = [o.outputs[0].delta_token_ids for o in plain.generate(ps, params)]
    eng = LLMEngine(
        EngineConfig(
            model=str(llama_dir), device="cpu", speculative_method=method, max_num_batched_tokens=40, **common, **kw
        )
    )
    if method == "draft":
        assert eng.proposer.runner.kv_cache.dtype == FP8
    pinned = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, num_draft_tokens=3)
    assert [o.outputs[0].delta_token_ids for o in eng.generate(ps, pinned)] == want
    assert eng.spec_stats.num_drafts > 0


def test_served_through_the_sdk(llama_dir):
    check_served(llama_dir, make_engine(llama_dir, kv_cache_dtype="fp8"), kv_cache_dtype="fp8")


def test_the_flag_reaches_the_engine(llama_dir):
    from server.cli import build_parser, engine_config_from_args

    args = build_parser().parse_args(["serve", "--model", str(llama_dir), "--kv-cache-dtype", "fp8"])
    assert engine_config_from_args(args).kv_cache_dtype == "fp8"
