#!/usr/bin/env bash
# The GPU checks in one run, for a machine lent for minutes (docs/benchmarks.md, "GPU step costs"):
# the step benchmark at the 8B shape (triton and sdpa attention, CUDA graphs on and off), then every
# GPU-marked test and the test files whose tensors live on CUDA when it exists (in parallel workers
# where pytest-xdist came in ./.whl); on request, the step costs by batch size, a prefill, the
# drafters and the controller's choice (loadtest.bench_gpu_scale, stage "scale"), the serving options that
# change the kernels (fused or eager small operators, batch-invariant, int4, FP8, LoRA) and the mixtures at their published shapes
# (loadtest.bench_gpu_variants, stage "variants"), the few-rows linear kernel against cuBLAS at each layer
# shape (loadtest.bench_gpu_skinny, stage "skinny"; SKINNY_ARGS="--dtype fp8" or "--dtype int4" for the
# quantized layers), a mixture layer's routing (fused and eager) and experts over a sweep of tiles at
# Qwen3-30B-A3B's and gpt-oss-20b's shapes (loadtest.bench_gpu_moe, stage "moe"), where each
# method's steps wait for the device on the demo pair (loadtest.device_waits: reads, builds and the syncs
# themselves, with their lines), the demo pair served (plain and the default, each with ordinary steps and
# with --async-scheduling on; loadtest.peers), and the kernel profile of a decode against chain verifies
# (loadtest.profile_gpu).
#   OUT=DIR [STAGES="bench tests waits served profile"] bash loadtest/gpu_checks.sh [SHAPES...]
# (default stages: bench tests; all of them: skinny moe scale variants bench tests waits served profile; default shape:
# llama-3.1-8b; SCALE_ARGS, VARIANTS_ARGS: more arguments for bench_gpu_scale and bench_gpu_variants, e.g.
# "--fused" to skip the former's fused on/off pair, "--variants int4 fp8 --moe-shapes" for two options alone). Missing Python packages (openai, pydantic,
# FastAPI, uvicorn, pyzmq, msgspec and their needs: that machine's image has none of them) install from
# ./.whl if present: `bash loadtest/gpu_wheels.sh` fills it here, and the device call carries it.
# Each failing test's traceback goes to $OUT/failures.log as it fails (tests/conftest.py), so a run
# cut short by its time limit still says why.
# In a 15-minute lease (a start costs 1-2 minutes), carrying .whl in every call: first
#   STAGES="moe variants tests" MOE_TIMEOUT=120 VARIANTS_TIMEOUT=220 VARIANTS_ARGS="--variants plain unfused
#   skinny --moe-shapes qwen3-30b-a3b gpt-oss-20b --moe-variants plain unfused" (timeout_s 560): the mixtures'
#   routing, layout and tile sweep, the fused kernels' gain at the 8B and mixture shapes, the few-rows kernel
#   in a whole decode, and the battery; then, with what is left, STAGES=skinny (each layer against cuBLAS),
#   STAGES=scale, or VARIANTS_ARGS="--shape qwen3-8b --variants plain unfused --moe-shapes" (Qwen3's q/k norms
#   inside RoPE's kernel). The C++ CPU kernels the tests need build in the background while the benchmarks run.
set -u
OUT=${OUT:-/tmp/augur-gpu-checks}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
shapes=("${@:-llama-3.1-8b}")
stages=" ${STAGES:-bench tests} "
{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/env.txt"
if [[ $stages == *" tests "* ]]; then
    # The C++ CPU kernels build on first use (~30-60 s); built here, no test's own time limit cuts a build
    # short (which would leave its lock for the next test to wait on). In the background: the benchmarks
    # use the GPU meanwhile, the build two CPU cores.
    python3 -c "from engine.attention.cpu_kernel import load_cpu_kernel; from engine.models.small_linear import \
load_small_linear; print('C++ CPU kernels built:', load_cpu_kernel(), load_small_linear())" >"$OUT/build.log" 2>&1 &
    build=$!
fi
[[ $stages == *" skinny "* ]] && timeout "${SKINNY_TIMEOUT:-120}" python3 -m loadtest.bench_gpu_skinny --shape "${shapes[0]}" \
    --output "$OUT/skinny.json" ${SKINNY_ARGS:-} 2>&1 | tee "$OUT/skinny.log"
[[ $stages == *" moe "* ]] && timeout "${MOE_TIMEOUT:-150}" python3 -m loadtest.bench_gpu_moe \
    --output "$OUT/moe.json" ${MOE_ARGS:-} 2>&1 | tee "$OUT/moe.log"
[[ $stages == *" scale "* ]] && timeout "${SCALE_TIMEOUT:-150}" python3 -m loadtest.bench_gpu_scale --shape "${shapes[0]}" \
    --output "$OUT/scale.json" ${SCALE_ARGS:-} 2>&1 | tee "$OUT/scale.log"
[[ $stages == *" variants "* ]] && timeout "${VARIANTS_TIMEOUT:-170}" python3 -m loadtest.bench_gpu_variants \
    --shape "${shapes[0]}" --output "$OUT/variants.json" ${VARIANTS_ARGS:-} 2>&1 | tee "$OUT/variants.log"
[[ $stages == *" bench "* ]] && timeout "${BENCH_TIMEOUT:-200}" python3 -m loadtest.bench_gpu --shapes "${shapes[@]}" --attention-backends triton sdpa \
    --cuda-graphs on off --output "$OUT/steps.json" 2>&1 | tee "$OUT/bench.log"
if [[ $stages == *" tests "* ]]; then
    wait "$build"
    cat "$OUT/build.log"
    export AUGUR_FAILURE_LOG=$OUT/failures.log
fi
# The short files first: a run cut at its limit has checked the most files. About 175 tests: eight workers,
# a file each at a time, ran them in 151 s on the H200 (2026-11-30; conftest sizes each worker's KV pools
# from its share of the GPU).
workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${TEST_WORKERS:-4} --dist loadfile")
[[ $stages == *" tests "* ]] && timeout "${TESTS_TIMEOUT:-330}" python3 -m pytest -q -p no:cacheprovider -o addopts="" -rfE $workers $(python3 -c "import pytest_timeout" 2>/dev/null && echo --timeout 120) \
    tests/test_fused.py tests/test_skinny_linear.py tests/test_batch_invariance_gpu.py tests/test_staging.py tests/test_sampler.py::test_cuda_matches_cpu_and_seeds_reproduce \
    tests/test_moe.py::test_the_gpu_kernels_on_a_gpu_keep_a_rows_bits_and_serve_graphs \
    tests/test_moe.py::test_the_layout_kernel_gives_row_blocks_values tests/test_moe.py::test_the_routing_kernel_routes_as_the_eager_router \
    "tests/test_engine.py::test_logits_match_transformers_cuda" tests/test_loading.py::test_cuda_greedy_matches_cpu \
    tests/test_deepseek_v3.py::test_on_a_gpu_latent_attention_runs_on_sdpa_and_matches_transformers \
    tests/test_gemma4.py::test_on_a_gpu_the_released_head_widths_run_on_the_triton_kernel tests/test_gemma4.py::test_the_triton_kernel_reads_each_layers_view_of_the_pool \
    tests/test_int4.py tests/test_bench_gpu.py tests/test_cuda_graphs.py tests/test_gpu_speculation.py \
    tests/test_attention_backends.py tests/test_run_ahead.py::test_run_ahead_through_graphs_on_gpu \
    tests/test_kv_cache_fp8.py::test_the_triton_kernel_reads_fp8_tiles tests/test_fp8_weights.py::test_the_layer_on_a_gpu_is_the_w8a8_product \
    tests/test_fp8_weights.py::test_the_token_kernel_gives_the_eager_quantizations_bits \
    tests/test_fp8_weights.py::test_the_block_kernel_is_the_dequantized_product \
    tests/test_gpt_oss.py::test_a_config_without_the_swiglu_constants_gets_the_models_own \
    tests/test_quantized_checkpoints.py::test_int4_checkpoint_groups_on_a_gpu \
    tests/test_lora.py::test_the_gpu_kernels_gather_each_rows_own_adapter_and_rows_stay_independent \
    tests/test_lora.py::test_the_engine_on_the_gpu_kernels_matches_peft_and_a_mixed_batch \
    tests/test_lora.py::test_a_prefills_many_rows_take_the_products_over_every_slot \
    tests/test_dflash.py::test_exact_through_graphs_on_gpu 2>&1 | tee "$OUT/tests.log"
[[ $stages == *" waits "* ]] && timeout "${WAITS_TIMEOUT:-180}" python3 -m loadtest.device_waits --device cuda \
    --output-md "$OUT/waits.md" 2>&1 | tee "$OUT/waits.log"
if [[ $stages == *" served "* ]]; then
    # `augur` as the peers tool starts it, without an installed package: python3 -c runs the CLI from the tree.
    mkdir -p /tmp/augur-bin
    printf '#!/bin/sh\nexec python3 -c "import sys; from server.launch import main; sys.exit(main())" "$@"\n' \
        >/tmp/augur-bin/augur
    chmod +x /tmp/augur-bin/augur
    PATH=/tmp/augur-bin:$PATH timeout "${SERVED_TIMEOUT:-240}" python3 -m loadtest.peers \
        --preset augur-plain --preset augur-plain-async --preset augur-default --preset augur-default-async \
        --num-prompts 16 --max-tokens 128 --concurrency 1 8 --no-progress --startup-timeout 120 \
        --log-dir "$OUT/logs" --output-md "$OUT/served.md" 2>&1
fi
if [[ $stages == *" profile "* ]]; then
    timeout "${PROFILE_TIMEOUT:-90}" python3 -m loadtest.profile_gpu --shape "${shapes[0]}" --widths 1 4 8 \
        ${PROFILE_JSON:+--output "$PROFILE_JSON"} 2>&1 | tee "$OUT/profile.log"
fi
