"""The real-shape step benchmark (``python -m loadtest.bench_gpu``) end to end, on toy shapes on CPU:
the same code a GPU run takes, writing every figure it reports."""

from __future__ import annotations

import json

import pytest
import torch

from loadtest import bench_gpu


def test_step_benchmark_runs_and_reports(tmp_path):
    out = tmp_path / "steps.json"
    device = "cuda" if torch.cuda.is_available() else "cpu"  # triton: interpreted on CPU (TRITON_INTERPRET=1)
    argv = ["--shapes", "tiny", "--device", device, "--dtype", "float32", "--context", "40", "--repeats", "2"]
    argv += ["--attention-backends", "sdpa", "triton"]
    assert bench_gpu.main(argv + ["--depths", "2", "4", "--alphas", "0.5", "0.9", "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["device"] and report["copy_bandwidth_gb_s"] > 0
    r, t = report["results"]
    assert (r["attention_backend"], t["attention_backend"]) == ("sdpa", "triton")
    assert (r["cuda_graphs"], t["cuda_graphs"]) == (False, True)  # graphs (on by default) need triton
    assert t["decode_ms"] > 0 and t["verify_tree_ms"] > 0
    assert r["shape"] == "tiny" and r["draft"] == "tiny-draft"
    assert r["decode_ms"] > 0 and r["hbm_bound_ms"] > 0 and r["verify_tree_ms"] > 0
    assert r["fraction_of_bound"] == pytest.approx(r["hbm_bound_ms"] / r["decode_ms"])
    assert r["verify_vs_decode"] == pytest.approx(r["verify_tree_ms"] / r["decode_ms"])
    assert {(s["alpha"], s["depth"]) for s in r["speculative"]} == {(0.5, 2), (0.5, 4), (0.9, 2), (0.9, 4)}
    # A step of depth k yields (1 - alpha^(k+1)) / (1 - alpha) tokens in k draft steps and one verify.
    s = next(s for s in r["speculative"] if s["alpha"] == 0.9 and s["depth"] == 4)
    step_ms = 4 * r["draft_decode_ms"] + r["chain_verify_ms"]["4"]
    assert s["tokens_per_s"] == pytest.approx((1 - 0.9**5) / 0.1 / step_ms * 1e3)


def test_real_shapes_build_as_published():
    """The shapes are the published ones: parameter counts from the configs, built on the meta device."""
    from engine.models import model_class_for

    counts = {}
    names = ("llama-3.1-8b", "qwen2.5-7b", "qwen3-8b", "gemma-2-9b", "llama-3.2-1b", "qwen3-30b-a3b", "gpt-oss-20b")
    for name in names:
        config = bench_gpu.model_config(name, max_positions=64)
        with torch.device("meta"):
            model = model_class_for(config)(config, 64)
        counts[name] = sum(p.numel() for p in model.parameters()) / 1e9
    assert counts["llama-3.1-8b"] == pytest.approx(8.03, abs=0.01)
    assert counts["qwen2.5-7b"] == pytest.approx(7.62, abs=0.01)
    assert counts["qwen3-8b"] == pytest.approx(8.19, abs=0.01)
    assert counts["gemma-2-9b"] == pytest.approx(9.24, abs=0.01)
    assert counts["llama-3.2-1b"] == pytest.approx(1.24, abs=0.01)
    assert counts["qwen3-30b-a3b"] == pytest.approx(30.53, abs=0.01)
    assert counts["gpt-oss-20b"] == pytest.approx(20.91, abs=0.01)


def test_serving_options_are_measured_against_their_own_bytes(tmp_path):
    """``loadtest.bench_gpu_variants`` on toy shapes: every option and a mixture get decode, verify and
    prefill figures; quantized weights are counted as the bytes they store, LoRA slots on top of the
    base, and a mixture's bound reads only the experts its tokens are routed to."""
    from loadtest import bench_gpu_variants

    out = tmp_path / "variants.json"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    argv = ["--shape", "tiny", "--moe-shapes", "tiny-moe", "--moe-variants", "plain", "unfused", "--device", device,
            "--dtype", "float32", "--context", "40", "--repeats", "2", "--prefill", "32", "--batch-sizes", "1", "3",
            "--output", str(out)]  # fmt: skip
    assert bench_gpu_variants.main(argv) == 0
    report = json.loads(out.read_text())
    got = {(r["shape"], r["variant"]): r for r in report["results"]}
    moe_runs = {("tiny-moe", v) for v in ("plain", "unfused")}
    assert set(got) == {("tiny", v) for v in bench_gpu_variants.VARIANTS} | moe_runs
    for r in got.values():
        assert set(r["decode"]) == {"1", "3"} and r["verify4_ms"] > 0 and r["prefill"]["ms"] > 0
        assert all(0 < d["fraction_of_bound"] and d["ms"] > 0 for d in r["decode"].values())
    plain = got["tiny", "plain"]["weights_gb"]
    assert got["tiny", "int4"]["weights_gb"] < 0.6 * plain and got["tiny", "fp8"]["weights_gb"] < 0.6 * plain
    assert got["tiny", "fp8-skinny"]["weights_gb"] == got["tiny", "fp8"]["weights_gb"]
    assert got["tiny", "lora"]["weights_gb"] > plain and set(got["tiny", "lora"]["decode_base_ms"]) == {"1", "3"}
    moe = got["tiny-moe", "plain"]
    assert 0 < moe["experts_gb"] < moe["weights_gb"]
    # 2 of 8 experts a token: one token reads a quarter of them, three tokens 1 - (3/4)^3 of them
    for B, share in (("1", 0.25), ("3", 1 - 0.75**3)):
        read = (moe["weights_gb"] - moe["experts_gb"] * (1 - share)) * 1e9 + int(B) * 40 * moe["kv_bytes_per_token"]
        assert moe["decode"][B]["memory_bound_ms"] == pytest.approx(read / report["copy_bandwidth_gb_s"] / 1e6)


def test_the_mixture_kernels_are_timed_at_every_tile_of_the_sweep(tmp_path):
    """``loadtest.bench_gpu_moe`` on the toy mixture (Triton's interpreter on CPU): the routing both
    ways, the experts at their own tiles and at each tile of the sweep, each tile's output beside the
    default's, and the best."""
    from loadtest import bench_gpu_moe

    out = tmp_path / "moe.json"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    argv = ["--shapes", "tiny-moe", "--device", device, "--tokens", "1", "5", "--block-n", "16", "32", "--block-k",
            "32", "64", "--stages", "3", "--l2-bytes", "1", "--repeats", "1", "--output", str(out)]  # fmt: skip
    assert bench_gpu_moe.main(argv) == 0
    report = json.loads(out.read_text())
    moe = report["shapes"]["tiny-moe"]
    assert (moe["experts"], moe["k"]) == (8, 2) and set(moe["tokens"]) == {"1", "5"}
    for row in moe["tokens"].values():
        assert row["routing_eager_us"] > 0 and row["routing_fused_us"] > 0 and row["default"]["us"] > 0
        assert 1 <= row["distinct_experts"] <= 8
        assert len(row["sweep"]) == 4 and all(r["max_diff"] < 1e-4 for r in row["sweep"])
        assert row["best"]["us"] == min(r["us"] for r in row["sweep"])


@pytest.mark.gpu
def test_kernel_profile_by_width(tmp_path, capsys):
    """``loadtest.profile_gpu`` (CUDA only): every width gets kernel times, the attention kernel among
    them, and a wall time per forward."""
    from loadtest import profile_gpu

    out = tmp_path / "profile.json"
    args = ["--shape", "tiny", "--widths", "1", "4", "--context", "40", "--repeats", "3", "--output", str(out)]
    assert profile_gpu.main(args) == 0
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"1", "4"}
    for r in results.values():
        assert r["wall_ms"] > 0
        assert any("paged_attention" in name for name in r["kernels"])
    assert "| **wall per forward** |" in capsys.readouterr().out


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8", "int4"])
def test_the_few_rows_kernel_is_timed_against_cublas_at_every_layer_shape(tmp_path, dtype):
    """``loadtest.bench_gpu_skinny`` on the toy shape (without CUDA in Triton's interpreter): every
    linear layer's shape, each row count against F.linear (fp8: ``torch._scaled_mm`` of the same e4m3
    operands; int4: PyTorch's int4 kernel on the same integers) with the kernel's result beside it,
    and at the swept row count every tile shape of the sweep (one row: on both kinds of cores) and the
    best."""
    from loadtest import bench_gpu_skinny

    pytest.importorskip("triton")
    out = tmp_path / "skinny.json"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    argv = ["--shape", "tiny", "--device", device, "--dtype", dtype, "--rows", "1", "3", "--sweep-rows", "1",
            "--block-n", "16", "32", "--block-k", "64", "--stages", "3", "--repeats", "1"]  # fmt: skip
    argv += ["--output", str(out)]
    assert bench_gpu_skinny.main(argv) == 0
    r = json.loads(out.read_text())
    assert r["errors"] == [] and r["copy_bandwidth_gb_s"] > 0
    shapes = bench_gpu_skinny.layer_shapes("tiny")
    assert {k: (v["out_features"], v["in_features"]) for k, v in r["layers"].items()} == shapes
    assert shapes["qkv"] == (4 * 16 + 2 * 2 * 16, 64) and shapes["lm_head"] == (512, 64)
    for layer in r["layers"].values():
        assert set(layer["by_rows"]) == {"1", "3"}
        for m, row in layer["by_rows"].items():
            assert row["cublas_us"] > 0 and row["kernel_us"] > 0 and row["max_abs_diff"] < 0.05
            assert ("sweep" in row) == (m == "1" and dtype != "int4")  # (int4's kernel: one tile shape)
        if dtype == "int4":
            continue
        sweep = layer["by_rows"]["1"]["sweep"]
        assert sorted((s["tiles"]["block_n"], s["tiles"]["dot"]) for s in sweep) == [
            (16, False), (16, True), (32, False), (32, True)]  # fmt: skip
        assert layer["by_rows"]["1"]["best"]["us"] == min(s["us"] for s in sweep)


def test_batch_scale_benchmark_runs_and_reports(tmp_path):
    """``loadtest.bench_gpu_scale`` on toy shapes: the decode by batch size against its bounds, a prefill,
    the drafters' steps (a DFlash block's one forward among them), the speculation table from them and
    the serving controller's depth beside it."""
    from loadtest import bench_gpu_scale

    out = tmp_path / "scale.json"
    argv = ["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--context", "40", "--repeats", "1"]
    argv += ["--batch-sizes", "1", "2", "--prefill", "48", "--depths", "2", "3", "--alphas", "0.6", "0.95"]
    argv += ["--fused", "off", "--skinny", "off", "--cuda-graphs", "off", "--output", str(out)]
    assert bench_gpu_scale.main(argv) == 0
    r = json.loads(out.read_text())
    assert r["errors"] == [] and r["copy_bandwidth_gb_s"] > 0 and r["matmul_tflops"] > 0
    assert set(r["fused"]) == {"off"} and r["fused"]["off"]["decode_ms"] > 0
    assert set(r["skinny"]) == {"off"} and r["skinny"]["off"]["tree_ms"] > 0
    assert [b["batch"] for b in r["batches"]] == [1, 2]
    for b in r["batches"]:
        bound = max(b["memory_bound_ms"], b["compute_bound_ms"])
        assert b["fraction_of_bound"] == pytest.approx(bound / b["decode_ms"])
        assert b["memory_bound_ms"] > 0 and b["compute_bound_ms"] > 0
    assert r["batches"][1]["compute_bound_ms"] == pytest.approx(2 * r["batches"][0]["compute_bound_ms"])
    assert r["prefill"]["tokens"] == 48 and r["prefill"]["ms"] > 0
    assert set(r["drafters"]) == {"tiny-draft", "eagle-3 head", "dflash drafter"}
    assert set(r["drafters"]["dflash drafter"]["level"].values()) == {0.0}  # a block in one forward
    for name, rows in r["speculation"].items():
        assert {(x["batch"], x["alpha"]) for x in rows} == {(1, 0.6), (1, 0.95), (2, 0.6), (2, 0.95)}
        d = r["drafters"][name]
        for x in rows:
            assert 0 <= x["controller_depth"] <= 3
            b = r["batches"][[1, 2].index(x["batch"])]
            B, k = str(x["batch"]), x["depth"]
            step = d["catch_up"][B] + (k - 1) * d["level"][B] + b["verify_ms"][str(k)]
            tokens = (1 - x["alpha"] ** (k + 1)) / (1 - x["alpha"])
            assert x["speedup"] == pytest.approx(tokens / step * b["decode_ms"])


def test_a_block_drafter_is_planned_deep_where_its_one_forward_drafts_every_depth():
    """The controller prices one more drafted position as a verify token plus, for a drafter that runs a
    forward a level, that forward: a block drafter (DFlash: ``per_level=False``) pays its one forward
    whatever the depth. With the H200's costs at the 8B shape (a 1.65 ms block forward, a 5.1 ms decode,
    verifies up to 7 tokens within 6% of it) it drafts the deepest chain at acceptance 0.6, where that
    chain returns 1.75x and one position 1.21x; priced as a forward a level it would draft one or two."""
    from loadtest.bench_gpu_scale import controller_depth

    decode = 5.11e-3
    verify = {k: decode * (1.0 + 0.01 * k) for k in range(1, 7)}
    assert controller_depth(1, 0.6, 6, decode, verify, 0.0, 1.65e-3, per_level=False) == 6
    assert controller_depth(1, 0.6, 6, decode, verify, 1.65e-3, 1.65e-3, per_level=True) <= 2
