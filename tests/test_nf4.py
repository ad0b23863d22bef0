"""NF4 weights: the quantizer, the dequantizing linear, bitsandbytes-layout checkpoints, quantize-on-load."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.models.packed import pack_linears
from engine.quant.nf4 import (
    NF4_CODE,
    NF4Linear,
    NF4Weight,
    dequantize_nf4,
    dynamic_map,
    fuse_nf4,
    nf4_from_bnb,
    quantize_nf4,
)
from engine.request.sampling_params import SamplingParams
from engine.runner.loader import load_config, load_model
from engine.runner.model_runner import ForwardChunk

PROMPT = [5, 17, 42, 99, 7, 250, 31, 8, 64, 3]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CODE = torch.tensor(NF4_CODE)
HALF_GAP = float((CODE[1:] - CODE[:-1]).max() / 2)  # the most a scaled value can move to its nearest code


# -- the quantizer ------------------------------------------------------------------------------------
def test_code_book_is_nf4():
    assert len(NF4_CODE) == 16 and list(NF4_CODE) == sorted(NF4_CODE)
    assert NF4_CODE[0] == -1.0 and NF4_CODE[7] == 0.0 and NF4_CODE[15] == 1.0
    # QLoRA's construction: 8 positive and 7 negative quantiles of N(0, 1), and 0, scaled to [-1, 1].
    normal = torch.distributions.Normal(0.0, 1.0)
    offset = 0.9677083
    pos = normal.icdf(torch.linspace(offset, 0.5, 9, dtype=torch.float64)[:-1])
    neg = -normal.icdf(torch.linspace(offset, 0.5, 8, dtype=torch.float64)[:-1])
    expected = torch.cat([neg, torch.zeros(1, dtype=torch.float64), pos.flip(0)]) / pos.max()
    torch.testing.assert_close(CODE.double(), expected, atol=1e-6, rtol=0)


def test_hand_made_block_codes_and_absmax_are_exact():
    idx = torch.tensor([0, 15, 7, 3, 12, 9, 1, 14] * 8)  # 64 values: one block
    w = (2.5 * CODE[idx]).view(2, 32)
    w[0, 2] = 0.02  # nearer 0.0 (index 7) than 2.5 * 0.0796
    q = quantize_nf4(w)
    assert q.absmax.tolist() == [2.5] and q.shape == (2, 32) and q.blocksize == 64
    assert q.packed.dtype == torch.uint8 and q.packed.shape == (32,)
    assert q.packed[:4].tolist() == [0 << 4 | 15, 7 << 4 | 3, 12 << 4 | 9, 1 << 4 | 14]  # first value: high nibble
    unpacked = torch.stack([q.packed >> 4, q.packed & 15], dim=1).view(-1)
    assert torch.equal(unpacked.long(), idx)
    expected = (2.5 * CODE[idx]).view(2, 32)
    assert torch.equal(dequantize_nf4(q), expected)


@pytest.mark.parametrize("shape", [(48, 128), (7, 9), (33, 100)])  # whole blocks; odd count; a short last block
def test_round_trip_within_the_nf4_bound(shape):
    torch.manual_seed(0)
    w = torch.randn(shape) * 0.05
    q = quantize_nf4(w)
    n, bs = w.numel(), q.blocksize
    assert q.packed.numel() == math.ceil(n / 2) and q.absmax.numel() == math.ceil(n / bs)
    flat = F.pad(w.reshape(-1), (0, q.absmax.numel() * bs - n)).view(-1, bs)
    assert torch.equal(q.absmax, flat.abs().amax(dim=1))
    err = (dequantize_nf4(q) - w).reshape(-1)
    bound = (q.absmax.repeat_interleave(bs)[:n] * HALF_GAP) * (1 + 1e-6)
    assert (err.abs() <= bound).all()
    assert err.abs().mean() < 0.1 * w.abs().mean() * 2  # a typical NF4 error is well under the worst case


def test_nested_statistics_round_trip():
    torch.manual_seed(1)
    w = torch.randn(300, 256) * 0.02  # 1200 blocks of 64: four nested blocks of 256 and a short fifth
    plain, nested = quantize_nf4(w), quantize_nf4(w, nested=True)
    assert nested.absmax.dtype == torch.uint8 and nested.absmax.numel() == 1200
    assert nested.nested_absmax.shape == (5,) and torch.equal(nested.nested_code, dynamic_map())
    assert nested.nested_offset.item() == pytest.approx(plain.absmax.mean().item())
    assert torch.equal(nested.packed, plain.packed)  # the 4-bit codes depend on the exact absmax only
    decoded = nested.block_absmax()
    centered = plain.absmax - plain.absmax.mean()
    # the dynamic map's widest step in [0.1, 1] is 0.9 / 64: the decoded absmax moves less than half that
    per_block = centered.abs().view(-1).split(256)
    scale = torch.cat([b.max().expand(len(b)) for b in per_block])
    assert ((decoded - plain.absmax).abs() <= scale * 0.9 / 128 + 1e-7).all()
    err = (dequantize_nf4(nested) - w).abs().reshape(-1)
    assert (
        err <= decoded.repeat_interleave(64) * HALF_GAP + (decoded - plain.absmax).abs().repeat_interleave(64) + 1e-6
    ).all()


@pytest.mark.parametrize(
    "rows, nested",
    [((256, 256, 128), True), ((64, 16, 16), True), ((64, 16, 16), False), ((3, 5), False)],
    ids=["nested-aligned", "nested-unaligned", "plain", "mid-block"],
)
def test_fused_parts_dequantize_as_their_parts(rows, nested):
    torch.manual_seed(2)
    width = 64 if rows != (3, 5) else 7
    ws = [torch.randn(r, width) for r in rows]
    parts = [quantize_nf4(w, nested=nested) for w in ws]
    fused = fuse_nf4(parts)
    assert fused.shape == (sum(rows), width)
    if rows == (3, 5):  # parts ending mid-block are re-quantized: close, not exact
        torch.testing.assert_close(dequantize_nf4(fused), torch.cat(ws), atol=0.5, rtol=0)
        return
    assert torch.equal(dequantize_nf4(fused), torch.cat([dequantize_nf4(p) for p in parts]))
    assert fused.nested == (nested and all(r * width // 64 % 256 == 0 for r in rows[:-1]))


def test_nf4_linear_is_plain_linear_on_dequantized_weights():
    torch.manual_seed(3)
    w, b = torch.randn(96, 64), torch.randn(96)
    for nested in (False, True):
        q = quantize_nf4(w, nested=nested)
        layer = NF4Linear.from_weight(q, b)
        x = torch.randn(5, 64)
        assert torch.equal(layer(x), F.linear(x, dequantize_nf4(q), b))
        layer = layer.to(torch.bfloat16)  # statistics stay float32; the output follows the input's dtype
        for name in ("absmax", "nested_absmax", "nested_offset", "nested_code", "table"):
            t = getattr(layer, name)
            assert t is None or t.dtype in (torch.float32, torch.uint8), name
        y = layer(x.bfloat16())
        assert y.dtype == torch.bfloat16
        assert torch.equal(y, F.linear(x.bfloat16(), dequantize_nf4(q, torch.bfloat16), b.bfloat16()))
    holder = torch.nn.Sequential(layer, torch.nn.Linear(96, 8))
    assert pack_linears(holder) == 1 and holder[0] is layer  # CPU prepacking leaves NF4 layers alone


# -- checkpoints ---------------------------------------------------------------------------------------
def write_bnb_layout(src: Path, dst: Path, nested: bool, quantize_lm_head: bool = False) -> Path:
    """Copy a model directory, its linear weights saved as bitsandbytes saves NF4 weights
    (``QuantState.as_dict(packed=True)``'s names and JSON) by our own quantizer."""
    shutil.copytree(src, dst)
    weights = load_file(src / "model.safetensors")
    out = {}
    for key, w in weights.items():
        module = key.removesuffix(".weight")
        if not (
            key.endswith(".weight")
            and (module.split(".")[-1] in LINEARS or (quantize_lm_head and key == "lm_head.weight"))
        ):
            out[key] = w
            continue
        q = quantize_nf4(w, nested=nested)
        out[key] = q.packed.view(-1, 1)
        out[f"{key}.absmax"] = q.absmax
        out[f"{key}.quant_map"] = torch.tensor(NF4_CODE)
        info = {"quant_type": "nf4", "blocksize": 64, "dtype": "float32", "shape": list(w.shape)}
        if nested:
            out[f"{key}.nested_absmax"] = q.nested_absmax
            out[f"{key}.nested_quant_map"] = q.nested_code.clone()
            info.update(nested_blocksize=256, nested_dtype="float32", nested_offset=q.nested_offset.item())
        out[f"{key}.quant_state.bitsandbytes__nf4"] = torch.tensor(list(json.dumps(info).encode()), dtype=torch.uint8)
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "bitsandbytes",
        "load_in_4bit": True,
        "load_in_8bit": False,
        "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": nested,
        "bnb_4bit_compute_dtype": "float32",
        "llm_int8_skip_modules": None if quantize_lm_head else ["lm_head"],
    }
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def with_weights(src: Path, dst: Path, transform) -> Path:
    """Copy a model directory with ``transform(key, tensor)`` applied to every weight."""
    shutil.copytree(src, dst)
    weights = load_file(src / "model.safetensors")
    save_file({k: transform(k, v) for k, v in weights.items()}, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def dequantized(nested: bool, lm_head: bool = False):
    def transform(key: str, w: torch.Tensor) -> torch.Tensor:
        module = key.removesuffix(".weight")
        if key.endswith(".weight") and (module.split(".")[-1] in LINEARS or (lm_head and key == "lm_head.weight")):
            return dequantize_nf4(quantize_nf4(w, nested=nested))
        return w

    return transform


def engine_for(model_dir: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32", num_kv_blocks=64, block_size=4))


def forward_logits(model: torch.nn.Module, hf_config) -> torch.Tensor:
    """Logits of a prefill and a 5-token step of one sequence through a model runner."""
    from engine.runner.model_runner import ModelRunner

    runner = ModelRunner(model, hf_config, torch.device("cpu"), torch.float32, 4, compile=False)
    runner.allocate_kv(16)
    table = list(range(16))
    first = runner.forward([ForwardChunk(PROMPT, 0, table, len(PROMPT))]).logits
    step = runner.forward([ForwardChunk([3, 4, 5, 6, 7], len(PROMPT), table, 5)]).logits
    return torch.cat([first, step])


def engine_logits(engine: LLMEngine) -> torch.Tensor:
    table: list[int] = []
    engine.block_manager.reserve(table, 0, len(PROMPT) + 5)
    first = engine.runner.forward([ForwardChunk(PROMPT, 0, table, len(PROMPT))]).logits
    step = engine.runner.forward([ForwardChunk([3, 4, 5, 6, 7], len(PROMPT), table, 5)]).logits
    return torch.cat([first, step])


def greedy(engine: LLMEngine) -> list[int]:
    return engine.generate([PROMPT], GREEDY)[0].outputs[0].delta_token_ids


@pytest.mark.parametrize(
    "arch, nested, lm_head",
    [
        ("LlamaForCausalLM", False, False),
        ("LlamaForCausalLM", True, True),  # nested statistics; a quantized LM head too
        ("Qwen2ForCausalLM", True, False),  # q/k/v biases, tied embeddings
    ],
)
def test_bnb_layout_checkpoint_loads_as_nf4(tmp_path, model_dirs, arch, nested, lm_head):
    src = model_dirs[arch]
    quant = write_bnb_layout(src, tmp_path / "nf4", nested, quantize_lm_head=lm_head)
    ref = with_weights(src, tmp_path / "ref", dequantized(nested, lm_head))
    engine, plain = engine_for(quant), engine_for(ref)
    layers = [m for m in engine.runner.model.modules() if isinstance(m, NF4Linear)]
    assert len(layers) == 4 * 2 + (1 if lm_head else 0)  # qkv, o, gate_up, down per layer
    assert all(isinstance(m, NF4Linear) for m in (engine.runner.model.lm_head,)) == lm_head
    assert not any(isinstance(m, torch.nn.Linear) for m in engine.runner.model.layers.modules())
    torch.testing.assert_close(engine_logits(engine), engine_logits(plain), atol=1e-5, rtol=1e-5)
    assert greedy(engine) == greedy(plain)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"bnb_4bit_quant_type": "fp4"}, "'fp4' is not supported"),
        ({"load_in_4bit": False, "load_in_8bit": True}, "8-bit"),
        ({"quant_method": "hqq"}, r"'hqq' is not supported \(supported: bitsandbytes NF4, gptq, awq"),
    ],
)
def test_other_quantizations_are_refused(tmp_path, llama_dir, change, match):
    d = write_bnb_layout(llama_dir, tmp_path / "q", nested=False)
    config = json.loads((d / "config.json").read_text())
    config["quantization_config"].update(change)
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=match):
        engine_for(d)


def test_fp4_tensors_are_refused(tmp_path, llama_dir):
    d = write_bnb_layout(llama_dir, tmp_path / "q", nested=False)
    w = load_file(d / "model.safetensors")
    key = "model.layers.0.mlp.down_proj.weight.quant_state.bitsandbytes__"
    w[key + "fp4"] = w.pop(key + "nf4")
    save_file(w, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="quant type 'fp4' is not supported"):
        engine_for(d)


def test_missing_quantized_part_is_named(tmp_path, llama_dir):
    d = write_bnb_layout(llama_dir, tmp_path / "q", nested=True)
    w = load_file(d / "model.safetensors")
    for k in [k for k in w if k.startswith("model.layers.1.self_attn.k_proj.")]:
        del w[k]
    save_file(w, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing the weight of layers\.1\.self_attn\.qkv_proj \(shard k\)"):
        engine_for(d)


# -- quantize on load ------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_quantize_on_load_matches_dequantized_checkpoint(tmp_path, model_dirs, arch):
    src = model_dirs[arch]
    ref = with_weights(src, tmp_path / "ref", dequantized(nested=False))
    config = load_config(src)
    model = load_model(src, config, torch.float32, torch.device("cpu"), 64, quantization="nf4")
    assert sum(isinstance(m, NF4Linear) for m in model.modules()) == 4 * 2
    assert model.lm_head is None or type(model.lm_head) is torch.nn.Linear  # the LM head stays full precision
    plain = load_model(ref, load_config(ref), torch.float32, torch.device("cpu"), 64)
    torch.testing.assert_close(forward_logits(model, config), forward_logits(plain, config), atol=1e-5, rtol=1e-5)


def test_quantize_on_load_through_the_engine_greedy(tmp_path, llama_dir):
    """NF4 layers inside a running engine: greedy decoding equals a plain model's on the dequantized
    weights (the layers are swapped in after loading, which is what load_model does before)."""
    ref = engine_for(with_weights(llama_dir, tmp_path / "ref", dequantized(nested=False)))
    engine = engine_for(llama_dir)
    model = engine.runner.model
    for layer in model.layers:
        for parent, name in (
            (layer.self_attn, "qkv_proj"),
            (layer.self_attn, "o_proj"),
            (layer.mlp, "gate_up_proj"),
            (layer.mlp, "down_proj"),
        ):
            lin = getattr(parent, name)
            setattr(parent, name, NF4Linear.from_weight(quantize_nf4(lin.weight), lin.bias))
    assert greedy(engine) == greedy(ref)


def test_engine_config_quantization_reaches_the_model(llama_dir):
    engine = LLMEngine(
        EngineConfig(model=str(llama_dir), device="cpu", num_kv_blocks=32, block_size=4, quantization="nf4")
    )
    assert any(isinstance(m, NF4Linear) for m in engine.runner.model.modules())


def test_quantization_flag_and_validation():
    from server.cli import build_parser, engine_config_from_args

    args = build_parser().parse_args(["generate", "--model", "m", "--quantization", "nf4", "--prompt", "x"])
    assert engine_config_from_args(args).quantization == "nf4"
    assert EngineConfig(model="m").quantization is None
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(model="m", quantization="int3")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--model", "m", "--quantization", "fp4", "--prompt", "x"])


# -- bitsandbytes itself -------------------------------------------------------------------------------
@pytest.mark.parametrize("compress_statistics", [False, True])
@pytest.mark.parametrize("shape", [(64, 128), (96, 64), (7, 9), (300, 1100)])
def test_bitsandbytes_output_dequantizes_identically(shape, compress_statistics):
    import bitsandbytes.functional as bnb_f

    torch.manual_seed(4)
    w = torch.randn(shape)
    packed, state = bnb_f.quantize_4bit(w, blocksize=64, compress_statistics=compress_statistics, quant_type="nf4")
    # Read through our checkpoint reader from exactly what bitsandbytes serializes.
    tensors = {"weight": packed, **state.as_dict(packed=True)}
    q = nf4_from_bnb("layer", tensors)
    assert q.nested == compress_statistics
    assert torch.equal(dequantize_nf4(q), bnb_f.dequantize_4bit(packed, state))
    ours = quantize_nf4(w, nested=compress_statistics)
    assert torch.equal(ours.packed, packed.view(-1))  # the same 4-bit codes, nibble order and padding
    if compress_statistics:
        assert torch.equal(ours.nested_absmax, state.state2.absmax) and torch.equal(ours.nested_code, state.state2.code)
        # bitsandbytes' C kernel rounds a few near-ties of the 8-bit statistics the other way: one step
        step = float(state.state2.absmax.max()) * 0.9 / 64
        torch.testing.assert_close(ours.block_absmax(), q.block_absmax(), atol=step, rtol=0)
        if state.absmax.numel() > 1:  # (one block: its centered absmax is 0, which bitsandbytes scales by 0/0)
            assert (ours.absmax != state.absmax).float().mean() < 0.01
    else:
        assert torch.equal(ours.absmax, state.absmax)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bitsandbytes_half_precision_dequantizes_identically(dtype):
    import bitsandbytes.functional as bnb_f

    torch.manual_seed(5)
    w = torch.randn(128, 192).to(dtype)
    packed, state = bnb_f.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    q = nf4_from_bnb("layer", {"weight": packed, **state.as_dict(packed=True)})
    assert torch.equal(dequantize_nf4(q, dtype), bnb_f.dequantize_4bit(packed, state))


def test_dynamic_map_matches_bitsandbytes():
    import bitsandbytes.functional as bnb_f

    assert torch.equal(dynamic_map(), bnb_f.create_dynamic_map())


def test_nf4_weight_survives_a_device_round_trip():
    q = quantize_nf4(torch.randn(16, 64), nested=True)
    layer = NF4Linear.from_weight(q).to("cpu")
    assert isinstance(layer.quantized_weight(), NF4Weight)
    assert torch.equal(layer.dequantize(), dequantize_nf4(q))


@pytest.mark.parametrize("double_quant", [False, True])
def test_checkpoint_saved_by_bitsandbytes_matches_its_model(tmp_path, llama_dir, double_quant):
    """A transformers model whose linears are bitsandbytes ``Linear4bit`` layers, saved from its own
    state dict (bitsandbytes' serializer), loads here and gives that model's logits."""
    import bitsandbytes as bnb
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear) and name != "lm_head":
                layer = bnb.nn.Linear4bit(
                    child.in_features, child.out_features, bias=child.bias is not None, compute_dtype=torch.float32,
                    compress_statistics=double_quant, quant_type="nf4",
                )  # fmt: skip
                layer.weight = bnb.nn.Params4bit(
                    child.weight.data.clone(), requires_grad=False, compress_statistics=double_quant, quant_type="nf4"
                )
                setattr(parent, name, layer.to("cpu"))  # quantizes
    assert model.model.layers[0].self_attn.q_proj.weight.quant_state is not None
    out = shutil.copytree(llama_dir, tmp_path / "bnb")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, out / "model.safetensors", {"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=double_quant
    ).to_dict()
    (out / "config.json").write_text(json.dumps(config))
    engine = engine_for(out)
    assert isinstance(engine.runner.model.layers[0].self_attn.qkv_proj, NF4Linear)
    with torch.no_grad():
        ref = model(torch.tensor([PROMPT])).logits[0]
    table: list[int] = []
    engine.block_manager.reserve(table, 0, len(PROMPT))
    got = engine.runner.forward([ForwardChunk(PROMPT, 0, table, len(PROMPT))]).logits
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
