"""Checkpoints saved quantized, loaded by their quantization_config (engine/quant/checkpoint.py).

The fixtures in tests/fixtures/quant/ were written by the formats' own tools (compressed-tensors,
llm-compressor, GPTQModel, transformers' FP8 quantizer) from a tiny random Llama, each with the format
library's own dequantized weights beside it (``reference.safetensors``; tests/fixtures/quant/README.md
says which tool wrote what and how to write them again). Here:

- every quantized layer loads as the library's dequantized weight;
- the engine's greedy tokens equal transformers' on the dequantized model (the checkpoint's other
  tensors and the reference weights, saved plain), chunked prefill and a running batch included;
- at -tp 2 the logits equal one rank's; every proposer is greedy-exact on a quantized target;
  served through the SDK; a format or scheme not served, and re-quantizing, are clear errors.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from families import check_served
from safetensors.torch import load_file, save_file
from test_engine import hf_greedy, prompts, run_staggered
from test_step import prompts as repetitive_prompts
from tp_ranks import model_logits, sharded_logits
from transformers import PreTrainedTokenizerFast

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.quant.checkpoint import checkpoint_format
from engine.request.sampling_params import SamplingParams
from engine.runner.loader import iter_safetensors, load_config, load_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FIXTURES = Path(__file__).parent / "fixtures" / "quant"
NAMES = sorted(p.name for p in FIXTURES.iterdir() if (p / "reference.safetensors").is_file())


def checkpoint_dir(name: str, tmp_path: Path) -> Path:
    """A fixture's checkpoint alone: its ``reference.safetensors`` beside it would be read as a second
    file of the same weights (an error: engine/runner/loader.py ``iter_safetensors``)."""
    d = tmp_path / name
    shutil.copytree(FIXTURES / name, d, ignore=shutil.ignore_patterns("reference.safetensors"))
    return d


def quant_config(name: str) -> dict:
    return json.loads((FIXTURES / name / "config.json").read_text())["quantization_config"]


@pytest.fixture(scope="module")
def served_dirs(tmp_path_factory, tokenizer_dir) -> dict[str, tuple[Path, Path]]:
    """Per fixture: (the quantized checkpoint with the test tokenizer, the same model dequantized by
    the format's library and saved plain)."""
    out = {}
    for name in NAMES:
        root = tmp_path_factory.mktemp(name)
        quantized, plain = root / "quantized", root / "plain"
        shutil.copytree(FIXTURES / name, quantized, ignore=shutil.ignore_patterns("reference.safetensors"))
        reference = load_file(FIXTURES / name / "reference.safetensors")
        reader = checkpoint_format(quant_config(name))
        tensors = {}
        for key, tensor in iter_safetensors(quantized):  # the checkpoint's unquantized tensors
            module, _, suffix = key.rpartition(".")
            if suffix in reader.parts + reader.dropped and f"{module}.weight" in reference:
                continue
            tensors[key] = tensor
        tensors.update(reference)
        plain.mkdir()
        save_file({k: v.float().contiguous() for k, v in tensors.items()}, plain / "model.safetensors")
        config = json.loads((quantized / "config.json").read_text())
        config.pop("quantization_config")
        (plain / "config.json").write_text(json.dumps(config))
        for d in (quantized, plain):
            PreTrainedTokenizerFast.from_pretrained(tokenizer_dir).save_pretrained(d)
            transformers.GenerationConfig(bos_token_id=0, eos_token_id=1, pad_token_id=2).save_pretrained(d)
        out[name] = (quantized, plain)
    return out


def make(model_dir: Path, method: str | None = None, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 256)
    kw.setdefault("block_size", 4)
    kw.setdefault("dtype", "float32")
    return LLMEngine(EngineConfig(model=str(model_dir), device="cpu", speculative_method=method, **kw))


def test_every_format_is_covered():
    methods = {quant_config(n)["quant_method"] for n in NAMES}
    formats = {quant_config(n).get("format") for n in NAMES if quant_config(n)["quant_method"] == "compressed-tensors"}
    assert methods == {"gptq", "awq", "fp8", "compressed-tensors"}
    assert {"pack-quantized", "naive-quantized", "int-quantized", "float-quantized"} <= formats


@pytest.mark.parametrize("name", NAMES)
def test_layers_load_as_the_librarys_dequantized_weights(name, tmp_path):
    reference = load_file(FIXTURES / name / "reference.safetensors")
    reader = checkpoint_format(quant_config(name))
    got = dict(reader.read(iter_safetensors(checkpoint_dir(name, tmp_path))))
    assert reference and set(reference) <= set(got)
    for key, want in reference.items():
        torch.testing.assert_close(got[key].float(), want.float(), rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_tokens_equal_transformers_on_the_dequantized_model(served_dirs, name):
    quantized, plain = served_dirs[name]
    engine = make(quantized, max_num_batched_tokens=40)
    ps = prompts(4, seed=3, lo=8, hi=40)
    got = run_staggered(engine, ps, SamplingParams(temperature=0.0, max_tokens=10))
    ref = transformers.AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()
    for i, p in enumerate(ps):
        assert got[f"r{i}"] == hf_greedy(ref, p, 10), i


def test_sharded_logits_match_one_rank(served_dirs):
    """-tp 2: each rank cuts its slices from the dequantized weights (a packed tensor's rows are not
    a rank's rows)."""
    dirs = [served_dirs[n][0] for n in ("gptq-4bit-g32-asym-actorder", "awq-gemm-g32", "ct-w4a16-g32-asym")]
    for d, sharded in zip(dirs, sharded_logits(dirs, 2), strict=True):
        for want, have in zip(model_logits(d), sharded, strict=True):
            torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5, msg=str(d))


@pytest.mark.parametrize("method", ["draft", "ngram", "suffix", "lookahead", "layer-skip", "eagle"])
def test_every_proposer_is_greedy_exact_on_a_quantized_target(served_dirs, tmp_path, method):
    from test_eagle import write_eagle
    from test_layer_skip import write_skip

    from engine.models.layer_skip import LayerSkip

    target, plain = served_dirs["gptq-4bit-g32-asym-actorder"]
    kw = {
        "draft": dict(draft_model=str(served_dirs["ct-fp8-channel-dynamic"][0]), spec_tree_topk=2),  # quantized too
        "layer-skip": dict(layer_skip_config=write_skip(tmp_path, LayerSkip(frozenset({1}), frozenset()))),
        "eagle": dict(draft_model=str(write_eagle(plain, tmp_path / "eagle")), spec_tree_topk=2),
    }.get(method, {})
    ps = repetitive_prompts(6, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    plain_tokens = [o.outputs[0].delta_token_ids for o in make(target).generate(ps, params)]
    eng = make(target, method, num_kv_blocks=64, max_num_batched_tokens=40, **kw)
    pinned = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, num_draft_tokens=3)
    assert [o.outputs[0].delta_token_ids for o in eng.generate(ps, pinned)] == plain_tokens
    assert eng.spec_stats.num_drafts > 0


def test_served_through_the_sdk(served_dirs):
    quantized, _ = served_dirs["awq-gemm-g32"]
    check_served(quantized, make(quantized))


def test_what_is_not_served_is_a_clear_error(served_dirs, tmp_path):
    quantized, _ = served_dirs["gptq-4bit-g32-sym"]
    with pytest.raises(ValueError, match="cannot be re-quantized to nf4"):
        load_model(quantized, load_config(quantized), torch.float32, torch.device("cpu"), 64, quantization="nf4")
    cases = {
        "hqq": (quantized, {"quant_method": "hqq"}, "quantization method 'hqq' is not supported"),
        "nvfp4": (
            served_dirs["ct-w4a16-g32-sym"][0],
            {"weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}},
            "float weights of 4 bits are not supported",
        ),
        "gptq 3 bits": (quantized, {"bits": 3}, "GPTQ with 3 bits is not supported"),
    }
    for label, (src, change, message) in cases.items():
        d = tmp_path / label.replace(" ", "-")
        shutil.copytree(src, d)
        config = json.loads((d / "config.json").read_text())
        qc = config["quantization_config"]
        if "weights" in change:
            qc["config_groups"]["group_0"]["weights"] = change["weights"]
        else:
            qc.update(change)
        (d / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=message):
            load_model(d, load_config(d), torch.float32, torch.device("cpu"), 64)


# -- --quantization int4: a 4-bit checkpoint's own groups on the int4 kernels --------------------------------
INT4 = ("gptq-4bit-g32-sym", "awq-gemm-g32", "ct-w4a16-g32-asym", "gptq-4bit-g32-asym-actorder", "ct-w4a16-actorder")


@pytest.mark.parametrize("name", INT4)
def test_int4_serves_the_checkpoints_own_groups(name, tmp_path):
    """Every linear but the LM head becomes an int4-kernel layer holding the checkpoint's integers,
    scales and zero points: multiplied by the identity it gives the library's dequantized weight, but
    for the bfloat16 rounding of its scales and zero points (a wrong nibble or zero point is off by a
    whole step, a fifteenth of the group's range). Act order: the columns are stored in the groups'
    order and the inputs taken in it. The weights take about a quarter of their float32 bytes."""
    from engine.quant import Int4Linear

    d = checkpoint_dir(name, tmp_path)
    model = load_model(d, load_config(d), torch.float32, torch.device("cpu"), 64, pack=False, quantization="int4")
    reference = load_file(FIXTURES / name / "reference.safetensors")
    layers = {n: m for n, m in model.named_modules() if isinstance(m, Int4Linear)}
    assert len(layers) == 4 * model.num_layers  # qkv, o, gate_up and down of every layer
    for n, layer in layers.items():
        weight = layer(torch.eye(layer.in_features)).t()
        parts = {
            "qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
        }.get(n.rsplit(".", 1)[-1], (n.rsplit(".", 1)[-1],))  # fmt: skip
        prefix = "model." + n.rsplit(".", 1)[0]
        want = torch.cat([reference[f"{prefix}.{p}.weight"] for p in parts]).float()
        step = want.abs().max() / 15
        torch.testing.assert_close(weight, want, atol=0.1 * step, rtol=0.02)
    assert any(layer.perm is not None for layer in layers.values()) == ("actorder" in name)
    packed = sum(t.numel() * t.element_size() for layer in layers.values() for t in layer.buffers())
    dense = sum(layer.in_features * layer.out_features * 4 for layer in layers.values())
    assert packed < 0.2 * dense


def test_int4_where_the_groups_do_not_fit_stays_dequantized_and_other_widths_are_refused(llama_dir):
    """Groups of a size the kernels do not take (16 columns) leave the layer as it loaded (dequantized);
    32 columns make it an int4 layer; 8-bit and FP8 checkpoints are not re-quantized to 4 bits."""
    from torch import nn

    from engine.quant import Int4Linear
    from engine.quant.checkpoint import Int4Groups
    from engine.quant.int4 import install_checkpoint_int4

    model = load_model(llama_dir, load_config(llama_dir), torch.float32, torch.device("cpu"), 64, pack=False)
    q = torch.randint(0, 16, (64, 64), dtype=torch.uint8)
    groups = {
        "model.layers.0.self_attn.o_proj": Int4Groups(q, torch.rand(64, 4), torch.zeros(64, 4)),  # 16 columns
        "model.layers.1.self_attn.o_proj": Int4Groups(q, torch.rand(64, 2), torch.zeros(64, 2)),  # 32
    }
    assert install_checkpoint_int4(model, groups) == 1
    assert type(model.layers[0].self_attn.o_proj) is nn.Linear
    assert isinstance(model.layers[1].self_attn.o_proj, Int4Linear)
    for name in ("gptq-8bit-channel", "ct-fp8-block", "fp8-block-dynamic"):
        d = FIXTURES / name
        with pytest.raises(ValueError, match="cannot be re-quantized to int4"):
            load_model(d, load_config(d), torch.float32, torch.device("cpu"), 64, quantization="int4")


def test_int4_sharded_logits_match_one_rank(served_dirs):
    """-tp 2: a rank takes its rows of the column-parallel layers and its whole groups of the
    row-parallel ones; under act order those stay dequantized (a rank's inputs are no share of the
    permuted ones), within the kernels' bfloat16 rounding of one rank's."""
    dirs = [served_dirs[n][0] for n in ("gptq-4bit-g32-sym", "gptq-4bit-g32-asym-actorder")]
    for d, sharded in zip(dirs, sharded_logits(dirs, 2, quantization="int4"), strict=True):
        for want, have in zip(model_logits(d, quantization="int4"), sharded, strict=True):
            torch.testing.assert_close(have, want, rtol=3e-2, atol=3e-2, msg=str(d))


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_every_proposer_is_greedy_exact_on_an_int4_target(served_dirs, method):
    target = served_dirs["awq-gemm-g32"][0]
    kw = {"draft": dict(draft_model=str(served_dirs["ct-w4a16-g32-sym"][0]), spec_tree_topk=2)}.get(method, {})
    ps = repetitive_prompts(6, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    plain = make(target, quantization="int4", dtype="bfloat16")
    plain_tokens = [o.outputs[0].delta_token_ids for o in plain.generate(ps, params)]
    eng = make(target, method, quantization="int4", dtype="bfloat16", max_num_batched_tokens=40, **kw)
    pinned = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, num_draft_tokens=3)
    assert [o.outputs[0].delta_token_ids for o in eng.generate(ps, pinned)] == plain_tokens
    assert eng.spec_stats.num_drafts > 0


@pytest.mark.gpu
def test_int4_checkpoint_groups_on_a_gpu(served_dirs):
    """The repacked groups on CUDA's int4 kernel give the CPU kernel's logits (both bfloat16 activations)."""
    from tp_ranks import _chunks

    from engine.runner.model_runner import ModelRunner

    d = served_dirs["gptq-4bit-g32-sym"][0]
    config = load_config(d)
    logits = []
    for device in (torch.device("cpu"), torch.device("cuda")):
        model = load_model(d, config, torch.bfloat16, device, 256, pack=False, quantization="int4")
        runner = ModelRunner(model, config, device, torch.bfloat16, 16, num_blocks=8)
        logits.append([runner.forward(chunks).logits.float().cpu() for chunks in _chunks()])
    for want, got in zip(*logits, strict=True):
        torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)
