"""ERNIE 4.5 against transformers on tiny random checkpoints, as transformers saves them: the dense
model (biases everywhere, an untied head) and the mixture (a float32 softmax router whose picks add a
learned expert bias, a shared expert, layer 0 dense). Both turn RoPE on interleaved pairs, which Augur
turns as halves after reordering the q and k rows as they load. Checked: logits through a chunked
prefill and paged decodes (and that without the reorder, or without the expert bias, they move far past
the tolerance), greedy tokens equal to ``generate``, two tensor-parallel ranks, a request's bfloat16
tokens alone and in a batch, speculation exact, the multi-token-prediction tensors passed over, and a
served completion."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from families import check_served, hf_eager, hf_logits, paged_logits
from safetensors.torch import load_file, save_file
from test_engine import prompts
from test_moe import (
    build_moe_dir,
    check_bf16_alone_equals_batch,
    check_greedy_matches_generate,
    check_speculation_is_plain,
    make,
)
from tp_ranks import model_logits, sharded_logits

from engine.models import ernie4_5

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ARCHS = ["Ernie4_5ForCausalLM", "Ernie4_5_MoeForCausalLM"]
FAR = 0.01  # fifty times the parity tolerance (2e-4): a difference no rounding explains


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ernie")
    return {arch: build_moe_dir(root / arch, tokenizer_dir, arch) for arch in ARCHS}


def copied(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def logits(model_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(transformers', Augur's) logits of a 30-token prompt: a 20-token prefill in two chunks, then one
    token at a time through the paged cache."""
    ids = prompts(1, seed=1, lo=30, hi=31)[0]
    return hf_logits(hf_eager(model_dir), ids), paged_logits(make(model_dir), ids)


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(dirs, arch):
    want, have = logits(dirs[arch])
    torch.testing.assert_close(have, want, atol=2e-4, rtol=2e-4)


def test_without_the_reorder_or_the_expert_bias_the_logits_are_far(dirs, monkeypatch, tmp_path):
    """The parity above holds only with the pairs reordered and the expert bias read: RoPE turned on the
    checkpoint's rows as they are, or the bias zeroed in the checkpoint, moves the logits far."""
    want, _ = logits(dirs["Ernie4_5ForCausalLM"])
    with monkeypatch.context() as m:
        m.setattr(ernie4_5, "pairs_as_halves", lambda t, head_dim: t)
        _, unordered = logits(dirs["Ernie4_5ForCausalLM"])
    assert (unordered - want).abs().max() > FAR
    moe = dirs["Ernie4_5_MoeForCausalLM"]
    unbiased = copied(moe, tmp_path / "unbiased")
    tensors = load_file(moe / "model.safetensors")
    biases = [k for k in tensors if k.endswith("moe_statics.e_score_correction_bias")]
    assert len(biases) == 3
    save_file(
        {k: torch.zeros_like(v) if k in biases else v for k, v in tensors.items()}, unbiased / "model.safetensors"
    )
    want, _ = logits(moe)
    _, have = logits(unbiased)
    assert (have - want).abs().max() > FAR


def test_greedy_matches_hf_generate(dirs):
    check_greedy_matches_generate(dirs["Ernie4_5_MoeForCausalLM"])


def test_sharded_logits_match_the_unsharded_model(dirs):
    """-tp 2: each rank its heads (their reordered q and k rows) and half of every expert; the router
    and its bias replicated."""
    ds = [dirs[a] for a in ARCHS]
    for arch, d, sharded in zip(ARCHS, ds, sharded_logits(ds, 2), strict=True):
        for want, have in zip(model_logits(d), sharded, strict=True):
            torch.testing.assert_close(have, want, rtol=1e-5, atol=3e-5, msg=lambda m, a=arch: f"{a}: {m}")


def test_in_bfloat16_a_requests_tokens_alone_equal_its_tokens_in_a_batch(dirs):
    check_bf16_alone_equals_batch(dirs["Ernie4_5_MoeForCausalLM"])


def test_speculation_gives_the_plain_decoders_tokens_and_mtp_tensors_are_passed_over(dirs, tmp_path):
    """The releases carry multi-token-prediction tensors (``model.mtp_*``), which are not read."""
    src = dirs["Ernie4_5_MoeForCausalLM"]
    target = copied(src, tmp_path / "with-mtp")
    tensors = load_file(src / "model.safetensors")
    tensors["model.mtp_block.0.self_attn.q_proj.weight"] = torch.ones(64, 64)
    tensors["model.mtp_emb_norm.0.weight"] = torch.ones(64)
    save_file(tensors, target / "model.safetensors")
    check_speculation_is_plain(target, "ngram", plain_dir=src)


def test_served_through_the_sdk(dirs):
    check_served(dirs["Ernie4_5_MoeForCausalLM"], make(dirs["Ernie4_5_MoeForCausalLM"]))


def test_nf4_and_quantized_checkpoints_are_refused(dirs, tmp_path):
    """NF4 takes the q and k matrices before they could be reordered, and a checkpoint stored quantized
    would reach the model unreordered: both are clear start-up errors, not wrong outputs."""
    import json

    with pytest.raises(ValueError, match="nf4 cannot load ERNIE 4.5"):
        make(dirs["Ernie4_5ForCausalLM"], quantization="nf4")
    quantized = copied(dirs["Ernie4_5ForCausalLM"], tmp_path / "gptq")
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True}
    (quantized / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantized ERNIE 4.5 checkpoint"):
        make(quantized)
