"""--quantization int4 / fp8 convert each linear layer as its weight loads (engine/quant/streamed.py):
the load never holds the full-precision model, and the served model is the one converting a fully
loaded model gives."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from engine.models import model_class_for
from engine.quant.fp8 import Fp8Linear, fp8_layer, quantize_linears_fp8
from engine.quant.int4 import Int4Linear, int4_layer, quantize_linears_int4
from engine.quant.streamed import StreamedLayers
from engine.runner.loader import iter_safetensors, load_config, load_model

CPU = torch.device("cpu")
QUANTIZE = {
    "int4": (int4_layer, quantize_linears_int4, Int4Linear),
    "fp8": (fp8_layer, quantize_linears_fp8, Fp8Linear),
}


def _converted_after(d, quantization: str):
    """The reference: the whole model loaded in full precision, then converted layer by layer."""
    model = load_model(d, load_config(d), torch.float32, CPU, 64, pack=False)
    QUANTIZE[quantization][1](model)
    return model


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
@pytest.mark.parametrize("quantization", ["int4", "fp8"])
def test_streamed_model_is_the_one_converted_after_a_full_load(model_dirs, arch, quantization):
    d = model_dirs[arch]
    streamed = load_model(d, load_config(d), torch.float32, CPU, 64, pack=False, quantization=quantization)
    after = _converted_after(d, quantization)
    kind = QUANTIZE[quantization][2]
    got = {n: type(m) for n, m in streamed.named_modules() if isinstance(m, (nn.Linear, kind))}
    assert got == {n: type(m) for n, m in after.named_modules() if isinstance(m, (nn.Linear, kind))}
    assert sum(t is kind for t in got.values()) == 4 * load_config(d).num_hidden_layers
    state, want = streamed.state_dict(), after.state_dict()
    assert state.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(state[name].view(torch.uint8), tensor.view(torch.uint8)), name


def test_no_more_than_a_layers_full_precision_weights_are_held_at_once(llama_dir):
    config = load_config(llama_dir)
    with torch.device("meta"):
        model = model_class_for(config)(config, 64)
    sizes = [m.weight.numel() * 4 for m in model.modules() if isinstance(m, nn.Linear)]
    layers = StreamedLayers(model, int4_layer, torch.float32)
    model = model.to_empty(device=CPU).to(torch.float32)
    model.init_buffers(64)
    model.load_weights(layers.intercept(iter_safetensors(llama_dir)))
    layers.finish()
    assert layers.converted == 4 * config.num_hidden_layers and layers.in_flight == 0
    # the checkpoint's names sort o_proj between k_proj and q_proj: q/k/v and o are in flight together
    assert 0 < layers.peak_bytes <= 2 * max(sizes[:-1]) < sum(sizes[:-1]) / 2


def test_a_missing_layer_weight_is_named(llama_dir, tmp_path):
    for f in llama_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    state = load_file(tmp_path / "model.safetensors")
    del state["model.layers.1.self_attn.v_proj.weight"]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing the weight of layers\.1\.self_attn\.qkv_proj"):
        load_model(tmp_path, load_config(tmp_path), torch.float32, CPU, 64, quantization="int4")


def test_a_family_reading_its_own_names_is_converted_after_its_load(tmp_path, tokenizer_dir):
    """Phi-3 loads its fused checkpoint tensors by name: converted after the load, as before."""
    import transformers

    config = transformers.Phi3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, pad_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.Phi3ForCausalLM(config).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["Phi3ForCausalLM"]
    model = load_model(tmp_path, load_config(tmp_path), torch.float32, CPU, 64, pack=False, quantization="int4")
    after = _converted_after(tmp_path, "int4")
    assert sum(isinstance(m, Int4Linear) for m in model.modules()) == 4 * config.num_hidden_layers
    for name, tensor in after.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
