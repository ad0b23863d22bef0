#!/usr/bin/env bash
# The GPU checks in one run, for a machine lent for minutes (docs/benchmarks.md, "GPU step costs"):
# the step benchmark at the 8B shape (triton and sdpa attention, CUDA graphs on and off), then every
# GPU-marked test and the test files whose tensors live on CUDA when it exists.
#   OUT=DIR bash loadtest/gpu_checks.sh [SHAPES...]     (default shape: llama-3.1-8b)
# Missing Python packages (openai and pydantic for the tests' conftest) install from ./.whl if present.
set -u
OUT=${OUT:-/tmp/augur-gpu-checks}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
shapes=("${@:-llama-3.1-8b}")
{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/env.txt"
timeout "${BENCH_TIMEOUT:-200}" python3 -m loadtest.bench_gpu --shapes "${shapes[@]}" --attention-backends triton sdpa \
    --cuda-graphs on off --output "$OUT/steps.json" 2>&1 | tee "$OUT/bench.log"
timeout "${TESTS_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -o addopts="" -rfE $(python3 -c "import pytest_timeout" 2>/dev/null && echo --timeout 120) \
    tests/test_gpu_speculation.py tests/test_attention_backends.py tests/test_cuda_graphs.py tests/test_int4.py \
    tests/test_bench_gpu.py "tests/test_engine.py::test_logits_match_transformers_cuda" \
    tests/test_loading.py::test_cuda_greedy_matches_cpu tests/test_sampler.py::test_cuda_matches_cpu_and_seeds_reproduce \
    2>&1 | tee "$OUT/tests.log"
