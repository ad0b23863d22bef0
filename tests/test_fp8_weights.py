"""FP8 weights on FP8 products (``--quantization fp8``, engine/quant/fp8.py).

- A layer's product is the W8A8 one: the per-token e4m3 activations times the per-row e4m3 weights,
  scaled; the batch-invariant path computes the same product, and a row's output there does not
  depend on the rows beside it.
- An FP8 checkpoint written by llm-compressor or transformers' quantizer is served with its own e4m3
  bytes and scales, not re-quantized (per tensor, row or 128 x 128 block); a 4-bit one is not
  re-quantized to FP8.
- Block scales that vary along a row run weight-only on a Triton kernel (its interpreter here): the
  checkpoint's dequantized product, whole blocks and a partial last one, one row or many.
- A full-precision checkpoint quantized at load: logits near the full-precision model's, ``-tp 2``
  logits near one rank's (each rank scales its own columns), every proposer greedy-exact on it
  (bfloat16, batch-invariant), served through the SDK.
"""

from __future__ import annotations

import pytest
import torch
from families import check_served
from safetensors.torch import load_file
from test_quantized_checkpoints import FIXTURES, checkpoint_dir
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


@pytest.mark.parametrize(
    "name", ["ct-fp8-channel-dynamic", "ct-fp8-tensor-static", "ct-naive-fp8", "ct-fp8-block", "fp8-block-dynamic"]
)
def test_an_fp8_checkpoint_is_served_with_its_own_bytes(name, tmp_path):
    """Each layer holds the checkpoint's e4m3 bytes and its scales, spread over their rows: one per row
    where a row has one (a tensor's, a channel's, a block's in a layer at most 128 inputs wide), one
    per row and block where they vary along it (the block fixtures' down projections: two blocks)."""
    from engine.quant.fp8_block import Fp8BlockLinear

    d = checkpoint_dir(name, tmp_path)
    stored = load_file(d / "model.safetensors")
    model = load_model(d, load_config(d), torch.float32, torch.device("cpu"), 64, pack=False, quantization="fp8")
    layers = {n: m for n, m in model.named_modules() if isinstance(m, Fp8Linear | Fp8BlockLinear)}
    assert len(layers) == 4 * model.num_layers
    assert any(isinstance(m, Fp8BlockLinear) for m in layers.values()) == ("block" in name)
    for n, layer in layers.items():
        parts = {
            "qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
        }.get(n.rsplit(".", 1)[-1], (n.rsplit(".", 1)[-1],))  # fmt: skip
        prefix = "model." + n.rsplit(".", 1)[0]
        want = torch.cat([stored[f"{prefix}.{p}.weight"] for p in parts])
        assert torch.equal(layer.weight.view(torch.uint8), want.view(torch.uint8)), n
        scales = []
        for p in parts:
            scale = stored.get(f"{prefix}.{p}.weight_scale", stored.get(f"{prefix}.{p}.weight_scale_inv")).float()
            scale = scale.reshape(1, 1) if scale.dim() == 0 else scale.reshape(scale.shape[0], -1)
            rows = stored[f"{prefix}.{p}.weight"].shape[0]
            scales.append(scale.repeat_interleave(-(-rows // scale.shape[0]), 0)[:rows])
        want_scale = torch.cat(scales)
        got_scale = layer.weight_scale.reshape(-1, 1) if isinstance(layer, Fp8Linear) else layer.weight_scale
        assert torch.equal(got_scale, want_scale), n


def test_4_bits_are_not_requantized():
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


@pytest.mark.gpu
def test_the_layer_on_a_gpu_is_the_w8a8_product():
    """On CUDA the product runs on the FP8 tensor cores (torch._scaled_mm, a scale per row: sm90+)."""
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(256, 512, generator=g), torch.randn(7, 512, generator=g)
    layer = Fp8Linear(*quantize_rows(w), None).cuda()
    w8, sw = quantize_rows(w)
    x8, sx = quantize_tokens(x)
    want = (x8.float() * sx) @ (w8.float() * sw[:, None]).t()
    got = layer(x.cuda().bfloat16()).float().cpu()
    torch.testing.assert_close(got, want, atol=2e-2 * want.abs().max().item(), rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_the_token_kernel_gives_the_eager_quantizations_bits(dtype):
    """engine/quant/fp8_tokens.py (CUDA's path; Triton's interpreter on CPU tensors): every row's scale and
    e4m3 bytes as the eager quantize_tokens gives them: rows over six decades of magnitude, one of
    zeros, values in e4m3's subnormal range, negative zeros, and rows longer than a block."""
    pytest.importorskip("triton")
    from engine.platform import triton_interpreted
    from engine.quant.fp8_tokens import quantize_tokens_kernel

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not triton_interpreted():
        pytest.skip("needs CUDA or Triton's interpreter")
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(6, 2500, generator=g) * torch.logspace(-6, 3, 6)[:, None]).to(dtype)
    x[2] = 0.0
    x[3, ::7] *= 1e-4
    x[4, :5] = -0.0
    want_q, want_s = quantize_tokens(x)
    got_q, got_s = quantize_tokens_kernel(x.to(device))
    assert torch.equal(got_s.cpu(), want_s)
    assert torch.equal(got_q.cpu().view(torch.uint8), want_q.view(torch.uint8))


def block_weight(n: int, k: int, seed: int = 0):
    """A weight of e4m3 values with a float32 scale per 128 x 128 block (DeepSeek-V3's layout)."""
    g = torch.Generator().manual_seed(seed)
    w8 = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(FP8)
    blocks = torch.rand(-(-n // 128), -(-k // 128), generator=g) * 0.01 + 0.001
    return w8, blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_the_block_kernel_is_the_dequantized_product(dtype, rows):
    from engine.quant.checkpoint import expand_blocks, rows_of_blocks
    from engine.quant.fp8_block import block_fp8_matmul

    w8, blocks = block_weight(200, 320)  # two whole blocks and a partial one along a row
    x = torch.randn(rows, 320, generator=torch.Generator().manual_seed(1)).to(dtype)
    want = x.float() @ (w8.float() * expand_blocks(blocks, w8.shape, (128, 128))).t()
    device = "cuda" if torch.cuda.is_available() else "cpu"  # compiled on a GPU, else the interpreter
    scales = rows_of_blocks(blocks, 200, 128)
    got = block_fp8_matmul(x.to(device), w8.to(device), scales.to(device), (1, 128)).cpu()
    assert got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol * want.abs().max().item(), rtol=tol)


def test_a_block_scaled_layer_is_served_from_its_bytes_and_rows_stay_independent(tmp_path, tokenizer_dir):
    """Layers wider than a block: the checkpoint's stored form goes in through the model's own fusing
    (q/k/v and gate/up stacked, as install_checkpoint_fp8 assembles them), runs on the kernel, and
    gives the model its dequantized weights give; under the batch-invariant mode a row's output
    does not depend on the rows beside it."""
    from engine.quant.checkpoint import expand_blocks, rows_of_blocks
    from engine.quant.fp8 import install_checkpoint_fp8
    from engine.quant.fp8_block import Fp8BlockLinear

    overrides = dict(hidden_size=256, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2)
    d = build_model_dir(tmp_path / "wide", tokenizer_dir, "LlamaForCausalLM", **overrides)
    config, cpu = load_config(d), torch.device("cpu")
    full = load_model(d, config, torch.float32, cpu, 256, pack=False)
    served = load_model(d, config, torch.float32, cpu, 256, pack=False)
    stored = {}
    names = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
             "mlp.up_proj", "mlp.down_proj")  # fmt: skip
    for i in range(config.num_hidden_layers):
        for j, name in enumerate(names):
            n, k = {"q": (256, 256), "k": (128, 256), "v": (128, 256), "o": (256, 256), "g": (384, 256),
                    "u": (384, 256), "d": (256, 384)}[name.split(".")[1][0]]  # fmt: skip
            w8, blocks = block_weight(n, k, seed=10 * i + j)
            stored[f"model.layers.{i}.{name}"] = (w8, rows_of_blocks(blocks, n, 128))
            target, shard = full.weight_target(full.checkpoint_name(f"model.layers.{i}.{name}.weight"))
            param = full.get_parameter(target)
            slot = param if shard is None else full.weight_slot(target, param, shard)
            with torch.no_grad():
                slot.copy_(w8.float() * expand_blocks(blocks, w8.shape, (128, 128)))
    assert install_checkpoint_fp8(served, stored, None, 128) == 4 * config.num_hidden_layers
    assert isinstance(served.layers[0].mlp.down_proj, Fp8BlockLinear)
    assert isinstance(served.layers[1].self_attn.qkv_proj, Fp8BlockLinear)
    runners = [ModelRunner(m, config, cpu, torch.float32, 16, num_blocks=8) for m in (served, full)]
    for chunks in _chunks():
        got, want = (r.forward(chunks).logits for r in runners)
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
    layer = served.layers[0].mlp.down_proj
    assert load_invariant_kernels()
    layer.invariant = True
    x = torch.randn(6, 384, generator=torch.Generator().manual_seed(3))
    together = layer(x)
    for i in range(6):
        assert torch.equal(layer(x[i : i + 1]), together[i : i + 1])


@pytest.mark.parametrize("quantization", ["fp8", "int4"])
def test_a_mixtures_router_stays_in_full_precision(tmp_path, quantization):
    """Its scores choose the experts: --quantization fp8 and int4 leave the router as loaded, as
    quantized checkpoints do (16 experts: a shape both products take; the stacked experts are not
    linear layers)."""
    import transformers
    from torch import nn

    from engine.quant import Int4Linear

    config = transformers.Qwen3MoeConfig(
        vocab_size=384, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=16, num_experts_per_tok=2,
        max_position_embeddings=128, architectures=["Qwen3MoeForCausalLM"],
    )  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "moe")
    d = tmp_path / "moe"
    model = load_model(d, load_config(d), torch.float32, torch.device("cpu"), 64, pack=False, quantization=quantization)
    assert type(model.layers[0].mlp.gate) is nn.Linear and model.layers[0].mlp.gate.out_features == 16
    assert isinstance(model.layers[0].self_attn.qkv_proj, Fp8Linear if quantization == "fp8" else Int4Linear)
