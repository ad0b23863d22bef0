"""FP8 weights on FP8 products (``--quantization fp8``, engine/quant/fp8.py).

- A layer's product is the W8A8 one: the per-token e4m3 activations times the per-row e4m3 weights,
  scaled; the batch-invariant path computes the same product, and a row's output there does not
  depend on the rows beside it.
- An FP8 checkpoint written by llm-compressor (tensor or channel scales) is served with its own e4m3
  bytes and scales, not re-quantized; a block-scaled one keeps its dequantized weights; a 4-bit one
  is not re-quantized to FP8.
- A full-precision checkpoint quantized at load: logits near the full-precision model's, ``-tp 2``
  logits near one rank's (each rank scales its own columns), every proposer greedy-exact on it
  (bfloat16, batch-invariant), served through the SDK.
"""

from __future__ import annotations

import pytest
import torch
from families import check_served
from safetensors.torch import load_file
from test_quantized_checkpoints import FIXTURES
from test_step import prompts as repetitive_prompts
from tp_ranks import _chunks, model_logits, sharded_logits

from conftest import build_model_dir
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.models.invariant import load_invariant_kernels
from engine.quant.fp8 import FP8, Fp8Linear, quantize_rows, quantize_tokens
from engine.request.sampling_params import SamplingParams
from engine.runner.loader import load_config, load_model
from engine.runner.model_runner import ModelRunner

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# W8A8 against the full-precision model: at most this share of the largest logit. E4M3 keeps about two
# significant digits of every weight and activation, and these 64-wide random models average little of
# that noise away: measured 11-13% (--quantization int4 measures 31-33% on the same models).
LOGIT_TOLERANCE = 0.2


def test_the_product_is_the_w8a8_one_and_rows_are_independent_under_invariance():
    g = torch.Generator().manual_seed(0)
    w, b, x = torch.randn(48, 64, generator=g), torch.randn(48, generator=g), torch.randn(5, 64, generator=g) * 3
    layer = Fp8Linear(*quantize_rows(w), b)
    w8, sw = quantize_rows(w)
    x8, sx = quantize_tokens(x)
    want = (x8.float() * sx) @ (w8.float() * sw[:, None]).t() + b
    torch.testing.assert_close(layer(x), want, atol=1e-4, rtol=1e-5)
    assert layer.weight.dtype == FP8 and (w8.float() * sw[:, None] - w).abs().max() > 0  # really 8 bits
    assert load_invariant_kernels()
    layer.invariant = True
    together = layer(x)
    torch.testing.assert_close(together, want, atol=1e-4, rtol=1e-5)
    for i in range(x.shape[0]):
        assert torch.equal(layer(x[i : i + 1]), together[i : i + 1])


@pytest.mark.parametrize("name", ["ct-fp8-channel-dynamic", "ct-fp8-tensor-static", "ct-naive-fp8"])
def test_an_fp8_checkpoint_is_served_with_its_own_bytes(name):
    d = FIXTURES / name
    stored = load_file(d / "model.safetensors")
    model = load_model(d, load_config(d), torch.float32, torch.device("cpu"), 64, pack=False, quantization="fp8")
    layers = {n: m for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    assert len(layers) == 4 * model.num_layers
    for n, layer in layers.items():
        parts = {
            "qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
        }.get(n.rsplit(".", 1)[-1], (n.rsplit(".", 1)[-1],))  # fmt: skip
        prefix = "model." + n.rsplit(".", 1)[0]
        want = torch.cat([stored[f"{prefix}.{p}.weight"] for p in parts])
        assert torch.equal(layer.weight.view(torch.uint8), want.view(torch.uint8)), n
        scales = torch.cat(
            [stored[f"{prefix}.{p}.weight_scale"].float().reshape(-1).expand(stored[f"{prefix}.{p}.weight"].shape[0])
             for p in parts]
        )  # fmt: skip
        assert torch.equal(layer.weight_scale.reshape(-1), scales), n


def test_block_scales_stay_dequantized_and_4_bits_are_not_requantized():
    for name in ("ct-fp8-block", "fp8-block-dynamic"):
        d = FIXTURES / name
        model = load_model(d, load_config(d), torch.float32, torch.device("cpu"), 64, pack=False, quantization="fp8")
        assert not any(isinstance(m, Fp8Linear) for m in model.modules())
    d = FIXTURES / "gptq-4bit-g32-sym"
    with pytest.raises(ValueError, match="cannot be re-quantized to fp8"):
        load_model(d, load_config(d), torch.float32, torch.device("cpu"), 64, quantization="fp8")


def test_a_full_precision_model_quantized_at_load_stays_near_it(llama_dir):
    config = load_config(llama_dir)
    cpu = torch.device("cpu")
    fp8 = load_model(llama_dir, config, torch.float32, cpu, 256, pack=False, quantization="fp8")
    assert sum(isinstance(m, Fp8Linear) for m in fp8.modules()) == 4 * fp8.num_layers
    full = load_model(llama_dir, config, torch.float32, cpu, 256, pack=False)
    runners = [ModelRunner(m, config, cpu, torch.float32, 16, num_blocks=8) for m in (fp8, full)]
    for chunks in _chunks():
        got, want = (r.forward(chunks).logits for r in runners)
        err = (got - want).abs().max()
        assert 0 < err <= LOGIT_TOLERANCE * want.abs().max()


def test_sharded_logits_stay_near_one_rank(llama_dir):
    """-tp 2: a rank quantizes its own columns of a row-parallel layer (the weights' rows and the
    activations' tokens over its share of the inputs), so the two are neighbours within FP8's rounding."""
    (sharded,) = sharded_logits([llama_dir], 2, quantization="fp8")
    for want, have in zip(model_logits(llama_dir, quantization="fp8"), sharded, strict=True):
        assert 0 < (have - want).abs().max() <= LOGIT_TOLERANCE * want.abs().max()


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_every_proposer_is_greedy_exact_on_an_fp8_target(llama_dir, tmp_path, tokenizer_dir, method):
    kw = {
        "draft": lambda: dict(
            draft_model=str(build_model_dir(tmp_path / "draft", tokenizer_dir, "LlamaForCausalLM", seed=4)),
            spec_tree_topk=2,
        ),
    }.get(method, dict)()
    common = dict(model=str(llama_dir), device="cpu", dtype="bfloat16", quantization="fp8", num_kv_blocks=256,
                  block_size=4)  # fmt: skip
    ps = repetitive_prompts(6, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    plain = LLMEngine(EngineConfig(**common))
    assert plain.batch_invariant
    want = [o.outputs[0].delta_token_ids for o in plain.generate(ps, params)]
    eng = LLMEngine(EngineConfig(**common, speculative_method=method, max_num_batched_tokens=40, **kw))
    pinned = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, num_draft_tokens=3)
    assert [o.outputs[0].delta_token_ids for o in eng.generate(ps, pinned)] == want
    assert eng.spec_stats.num_drafts > 0


def test_served_through_the_sdk(llama_dir):
    engine = LLMEngine(EngineConfig(model=str(llama_dir), device="cpu", dtype="float32", quantization="fp8",
                                    num_kv_blocks=256, block_size=4))  # fmt: skip
    check_served(llama_dir, engine, quantization="fp8")
