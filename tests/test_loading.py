"""Model loading: sharded checkpoints, the offline hub cache, dtypes, the bench command."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
import transformers

from conftest import build_model_dir
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.request.sampling_params import SamplingParams
from engine.runner.model_runner import ForwardChunk

PROMPT = [5, 17, 42, 99, 7, 250, 31]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def greedy_tokens(model: str, **kw) -> list[int]:
    engine = LLMEngine(EngineConfig(model=model, device="cpu", num_kv_blocks=32, block_size=4, **kw))
    return engine.generate([PROMPT], GREEDY)[0].outputs[0].delta_token_ids


def test_sharded_checkpoint_loads_like_single_file(tmp_path, llama_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="100KB")
    for f in llama_dir.iterdir():
        if not f.name.startswith("model") and f.is_file():
            shutil.copy(f, sharded / f.name)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    assert greedy_tokens(str(sharded)) == greedy_tokens(str(llama_dir))


def test_hub_id_resolves_from_local_cache_offline(tmp_path, monkeypatch, llama_dir):
    # The Hugging Face cache layout: models--{org}--{name}/refs/main → snapshots/{commit}/files.
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--tiny-org--tiny-llama"
    shutil.copytree(llama_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert greedy_tokens("tiny-org/tiny-llama") == greedy_tokens(str(llama_dir))


def prompt_logits(engine: LLMEngine) -> torch.Tensor:
    """The logits of every position of PROMPT, from one prefill through the engine's runner."""
    table = engine.block_manager.fork([]) or []
    assert engine.block_manager.reserve(table, 0, len(PROMPT)) is not None
    return engine.runner.forward([ForwardChunk(PROMPT, 0, table, len(PROMPT))]).logits.float()  # [len(PROMPT), vocab]


def test_bfloat16_runs_and_mostly_agrees(llama_dir):
    """bf16 is what runs (weights, KV pool, runner), and its logits are float32's within bf16's
    rounding: close, not equal (equal would mean float32 ran)."""
    engines = {
        dtype: LLMEngine(EngineConfig(model=str(llama_dir), device="cpu", num_kv_blocks=32, block_size=4, dtype=dtype))
        for dtype in ("float32", "bfloat16")
    }
    bf16 = engines["bfloat16"]
    assert bf16.runner.dtype == bf16.runner.kv_cache.dtype == torch.bfloat16
    assert {p.dtype for p in bf16.runner.model.parameters() if p.is_floating_point()} == {torch.bfloat16}
    ref, got = (prompt_logits(engines[d]) for d in ("float32", "bfloat16"))
    assert not torch.equal(got, ref)
    # bf16 keeps 8 bits of mantissa (relative step 2^-8); two layers of rounding, logits of scale ~1.
    torch.testing.assert_close(got, ref, atol=0.05, rtol=0.05)
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8
    assert greedy_tokens(str(llama_dir), dtype="bfloat16")[:2] == greedy_tokens(str(llama_dir))[:2]


def test_kv_pool_sized_from_memory_fraction(llama_dir):
    engine = LLMEngine(EngineConfig(model=str(llama_dir), device="cpu", max_num_seqs=4, max_model_len=64))
    # On CPU the pool takes no more than a full batch of max_model_len sequences needs.
    assert engine.runner.num_blocks == 4 * (64 // 16 + 1)
    assert engine.runner.kv_cache.shape[2] == engine.runner.num_blocks * 16


def test_max_model_len_beyond_pool_is_an_error(llama_dir):
    with pytest.raises(ValueError, match="KV pool holds"):
        LLMEngine(EngineConfig(model=str(llama_dir), device="cpu", num_kv_blocks=2, block_size=4, max_model_len=64))


def test_missing_weights_are_named(tmp_path, tokenizer_dir):
    d = build_model_dir(tmp_path / "m", tokenizer_dir, "LlamaForCausalLM")
    from safetensors.torch import load_file, save_file

    w = load_file(d / "model.safetensors")
    del w["model.layers.1.mlp.up_proj.weight"]
    save_file(w, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing"):
        greedy_tokens(str(d))


def test_a_second_copy_of_the_weights_is_an_error_not_a_reload(tmp_path, llama_dir):
    """Without an index every *.safetensors file is read: one holding tensors another holds (a stray
    copy, a reference beside a checkpoint) is named, where it used to overwrite the first silently."""
    d = tmp_path / "m"
    shutil.copytree(llama_dir, d)
    shutil.copy(d / "model.safetensors", d / "zz-copy.safetensors")
    with pytest.raises(ValueError, match=r"is in both model\.safetensors and zz-copy\.safetensors"):
        greedy_tokens(str(d))


def test_bench_command_reports_ratios(tmp_path, llama_dir):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "server.cli", "bench", "--model", str(llama_dir), "--device", "cpu",
         "--num-prompts", "4", "--max-tokens", "4", "--concurrency", "1", "2", "--prompt-lens", "4", "12",
         "--num-kv-blocks", "64", "--output", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    import json

    report = json.loads(out.read_text())
    assert [r["concurrency"] for r in report["results"]] == [1, 2]
    for r in report["results"]:
        assert r["output_tokens"] == 16 and r["augur_tokens_per_s"] > 0
        assert r["ratio_vs_batched"] == pytest.approx(r["augur_tokens_per_s"] / r["hf_batched_tokens_per_s"])
    assert "vs batch" in proc.stdout
    memory = report["memory"]
    element = 2 if report["dtype"] in ("torch.bfloat16", "torch.float16") else 4  # auto: bf16 where the CPU has units
    # 64 blocks of 16 tokens x 2 layers x K/V x 2 KV heads x head dim 16
    assert memory["weights_bytes"] > 0 and memory["kv_pool_bytes"] == 64 * 16 * 2 * 2 * 2 * 16 * element
    assert memory["peak_bytes"] > memory["weights_bytes"] and "memory: weights" in proc.stdout


def test_bench_measures_run_ahead_against_ordinary_steps(tmp_path, llama_dir):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "server.cli", "bench", "--model", str(llama_dir), "--device", "cpu", "--no-hf",
         "--num-prompts", "4", "--max-tokens", "6", "--concurrency", "1", "3", "--prompt-lens", "4", "12",
         "--num-kv-blocks", "64", "--async-scheduling", "--repeats", "2", "--output", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    for r in json.loads(out.read_text())["results"]:
        assert r["output_tokens"] == 24 and r["ordinary_tokens_per_s"] > 0
        assert r["ratio_vs_ordinary"] == pytest.approx(r["augur_tokens_per_s"] / r["ordinary_tokens_per_s"])
    assert "vs ordinary" in proc.stdout


@pytest.mark.gpu
def test_cuda_greedy_matches_cpu(llama_dir):
    cpu = greedy_tokens(str(llama_dir))
    cfg = EngineConfig(model=str(llama_dir), device="cuda", dtype="float32", num_kv_blocks=32, block_size=4)
    engine = LLMEngine(cfg)
    assert engine.generate([PROMPT], GREEDY)[0].outputs[0].delta_token_ids == cpu
    assert torch.cuda.is_available()


def test_speculative_bench_reports_every_cell(tmp_path, tiny_demo):
    out = tmp_path / "spec.json"
    proc = subprocess.run(
        [sys.executable, "-m", "server.cli", "bench", "--speculative", "--model", str(tiny_demo / "target"),
         "--draft-model", str(tiny_demo / "draft"), "--device", "cpu", "--num-prompts", "2", "--max-tokens", "4",
         "--concurrency", "1", "2", "--temperatures", "0", "1", "--num-speculative-tokens", "2",
         "--dtypes", "float32", "bfloat16", "--fresh-runs", "2", "--num-kv-blocks", "128", "--output", str(out),
         "--repeats", "2"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    import json

    report = json.loads(out.read_text())
    rows = report["results"]
    assert report["repeats"] == 2 and "2 interleaved rounds" in proc.stdout
    assert all(r["repeats"] == 2 for r in rows if "@" not in r["method"])
    cells = {(r["dtype"], r["temperature"], r["concurrency"], r["method"]) for r in rows}
    for d in ("float32", "bfloat16"):
        for t in (0.0, 1.0):
            for c in (1, 2):
                assert {(d, t, c, m) for m in ("plain", "trees", "chains")} <= cells
            assert {(d, t, 1, "trees@K2"), (d, t, 1, "chains@K2")} <= cells
    for r in rows:
        assert r["tokens"] == 8 and r["mean_acceptance_length"] >= 1.0
        if r["method"] == "plain":
            assert r["ratio_vs_plain"] == 1.0 and r["mean_acceptance_length"] == 1.0
    assert len(report["fresh_runs_mean_acceptance_length"]) == 2
    assert report["default"] == "chains"  # on a CPU
    assert "worst cell of the default (chains)" in proc.stdout and "fresh engines" in proc.stdout


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM"])  # untied + tied output, q/k/v biases
def test_prepacked_cpu_linears_match_plain_ones(model_dirs, arch):
    """Models too small to be packed by default run the same with packed weights (1 and 5 rows)."""
    from engine.models.packed import PackedLinear, packing_supported
    from engine.runner.model_runner import ForwardChunk

    if not packing_supported(torch.float32, torch.device("cpu")):
        pytest.skip("oneDNN is not available")
    # (the batch-variant layers: the invariant mode puts every linear on its own kernel instead)
    kw = dict(device="cpu", num_kv_blocks=32, block_size=4, batch_invariant="off")
    plain = LLMEngine(EngineConfig(model=str(model_dirs[arch]), **kw))
    packed = LLMEngine(EngineConfig(model=str(model_dirs[arch]), **kw))
    packed.runner.model.pack_for_cpu()
    assert any(isinstance(m, PackedLinear) for m in packed.runner.model.modules())
    assert not any(isinstance(m, torch.nn.Linear) for m in packed.runner.model.modules())
    for eng in (plain, packed):
        table: list[int] = []
        eng.block_manager.reserve(table, 0, 12)
        eng._table = table
    logits = []
    for eng in (plain, packed):
        first = eng.runner.forward([ForwardChunk(PROMPT, 0, eng._table, len(PROMPT))]).logits
        step = eng.runner.forward([ForwardChunk([3, 4, 5, 6, 7], len(PROMPT), eng._table, 5)]).logits
        logits.append(torch.cat([first, step]))
    torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-4)
    assert greedy_tokens(str(model_dirs[arch])) == [
        o for o in packed.generate([PROMPT], GREEDY)[0].outputs[0].delta_token_ids
    ]
