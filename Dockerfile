# Augur for GPU hosts (and, with another torch index, for machines without one).
#
#   docker build -t augur .                                   # CUDA: torch 2.13.0 from PyPI (CUDA 13 build)
#   docker build -t augur:cu128 --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#   docker build -t augur:cpu --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .
#   docker run --gpus all -p 8000:8000 -v augur-cache:/cache augur
#
# torch is the one the tests run: the base image brings none, and the project is installed by the
# Makefile's `install` target (the same step as the README's `make serve` / `make test`), which installs
# the pinned torch (2.13.0) when torch is missing, then `pip install -e .` (plus `[EXTRAS]`).
#
# CUDA: the torch wheels bundle their CUDA runtime, cuDNN and NCCL, so the host needs only an NVIDIA
# driver new enough for them (and the NVIDIA Container Toolkit). PyPI's torch 2.13.0 for Linux x86_64 is
# the CUDA 13 build (it depends on the nvidia-*-cu13 packages), which needs driver >= 580. For an older
# driver take the same torch built for CUDA 12 from PyTorch's wheel index (TORCH_INDEX_URL=.../cu126 or
# .../cu128: any driver >= 525, by CUDA's minor-version compatibility), or .../cpu for no GPU. Nothing
# else in the image depends on the CUDA version.

ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE}

# Where `make install` takes torch from (empty: PyPI). Only torch comes from it; the rest from PyPI.
ARG TORCH_INDEX_URL=
# Extras of the project to install: none by default (`--build-arg EXTRAS=test` adds the test tools).
ARG EXTRAS=
# uid of the `augur` user: match the owner of bind-mounted model and cache directories.
ARG AUGUR_UID=1000

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

# make runs the install. A C/C++ compiler is what Triton (the attention kernels) builds its launchers
# with and what torch.compile (the engine's compiled forwards) builds CPU kernels with, at first use.
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends make g++ \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/augur
# Only what the install needs (pyproject's readme is README.md): a local .venv or .git never enters the image.
COPY pyproject.toml Makefile README.md ./
COPY engine/ engine/
COPY server/ server/
COPY loadtest/ loadtest/
COPY configs/ configs/

RUN make install VENV=none EXTRAS="${EXTRAS}" TORCH_INDEX_URL="${TORCH_INDEX_URL}"

RUN useradd --create-home --uid "${AUGUR_UID}" --shell /usr/sbin/nologin augur \
    && mkdir -p /models /cache/augur /cache/huggingface \
    && chown -R augur:augur /models /cache

# The demo pair ships in the image (engine/assets/demo); `augur demo build` writes into $AUGUR_HOME. Hub ids
# are looked up in $HF_HOME/hub. The compilers' caches live in the volume too, so a restarted container
# swaps its compiled forwards in within seconds instead of compiling them again.
ENV AUGUR_HOME=/cache/augur \
    HF_HOME=/cache/huggingface \
    TORCHINDUCTOR_CACHE_DIR=/cache/torchinductor \
    TORCH_EXTENSIONS_DIR=/cache/torch_extensions
VOLUME ["/models", "/cache"]

USER augur
EXPOSE 8000

# /health is 200 once the model is loaded (the forwards compile in the background after that). A large
# checkpoint takes a while to load: failures in the start period do not count.
HEALTHCHECK --interval=30s --timeout=5s --start-period=10m --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4).status != 200)"]

ENTRYPOINT ["augur", "serve"]
CMD ["--host", "0.0.0.0", "--port", "8000"]
