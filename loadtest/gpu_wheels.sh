#!/usr/bin/env bash
# Wheels for the lent GPU machine, whose image has torch, Triton and transformers but not the server's
# packages: downloads into ./.whl (git ignores it) the versions this checkout's .venv runs, for CPython
# 3.12 on x86-64 Linux, without their dependencies. The list is closed by hand: it holds each package's
# needs that the image lacks or has too old (a missing one shows as an ImportError there).
#   bash loadtest/gpu_wheels.sh        then, on the device: carry .whl; loadtest/gpu_checks.sh installs them
set -eu
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PACKAGES=(
    openai httpx2 httpcore2 truststore jiter distro sniffio  # the SDK the tests drive the server with
    fastapi starlette opentelemetry-api sse-starlette uvicorn h11 anyio idna  # the server
    pydantic pydantic_core annotated-types typing-inspection typing_extensions
    pyzmq msgspec llguidance  # the engine process's sockets and messages; structured outputs
    peft accelerate psutil  # PEFT's adapters, which the LoRA tests build and compare against
)
mkdir -p .whl
platforms=()
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 manylinux_2_26_x86_64 manylinux_2_27_x86_64 \
    manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux_2_35_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
for name in "${PACKAGES[@]}"; do
    version=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d .whl "$name==$version" 2>&1 | grep -v '^WARNING: Location' || true
done
# The battery's workers (loadtest/gpu_checks.sh runs the GPU tests in parallel): not the project's needs,
# so pinned here rather than read from the .venv.
for spec in pytest-xdist==3.8.0 execnet==2.1.2; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d .whl "$spec" \
        2>&1 | grep -v '^WARNING: Location' || true
done
printf '%s wheels in .whl (%s)\n' "$(ls .whl | wc -l)" "$(du -sh .whl | cut -f1)"
