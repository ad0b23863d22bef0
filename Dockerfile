# Augur for GPU hosts (and, with VARIANT=cpu, for machines without one).
#
#   docker build -t augur .                                   # CUDA: torch comes with the base image
#   docker build -t augur:cpu --build-arg VARIANT=cpu .       # CPU: python:3.11-slim, torch from PyPI
#   docker run --gpus all -p 8000:8000 -v augur-cache:/cache augur
#
# The project is installed by the Makefile's `install` target, the same step as the README's
# `make serve` / `make test`: it installs torch 2.13.0 only when torch is not importable (so the CUDA
# base image's torch is kept as it is), then `pip install -e .` (plus `[EXTRAS]` when given, e.g. `--build-arg EXTRAS=test`).
#
# VARIANT=cpu: the slim base has no torch, so `make install` installs torch==2.13.0 from PyPI. On x86_64
# that wheel bundles the CUDA libraries (several GB); for the small CPU-only wheel, build from a base
# image that already has it (e.g. --build-arg CPU_BASE_IMAGE=<an image with the CPU wheel installed>).

ARG VARIANT=gpu
ARG BASE_IMAGE=pytorch/pytorch:2.6.0-cuda12.4-cudnn9-runtime
ARG CPU_BASE_IMAGE=python:3.11-slim

# One stage per variant; BuildKit builds (and pulls) only the one `base-${VARIANT}` names.
FROM ${BASE_IMAGE} AS base-gpu
FROM ${CPU_BASE_IMAGE} AS base-cpu

FROM base-${VARIANT}

# Extras of the project to install. The default is the README's (`test`: pytest, openai, ruff). An
# empty value would make the Makefile run `pip install -e ".[]"`, which pip rejects.
ARG EXTRAS=
# uid of the `augur` user: match the owner of bind-mounted model and cache directories.
ARG AUGUR_UID=1000

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends make \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/augur
# Only what the install needs (pyproject's readme is README.md): a local .venv or .git never enters the image.
COPY pyproject.toml Makefile README.md ./
COPY engine/ engine/
COPY server/ server/
COPY loadtest/ loadtest/
COPY configs/ configs/

RUN make install VENV=none EXTRAS="${EXTRAS}"

RUN useradd --create-home --uid "${AUGUR_UID}" --shell /usr/sbin/nologin augur \
    && mkdir -p /models /cache/augur /cache/huggingface \
    && chown -R augur:augur /models /cache

# The demo pair is built into $AUGUR_HOME on first start; hub ids are looked up in $HF_HOME/hub.
ENV AUGUR_HOME=/cache/augur \
    HF_HOME=/cache/huggingface
VOLUME ["/models", "/cache"]

USER augur
EXPOSE 8000

# /health is 200 once the model is loaded. The first start of the demo builds the pair before the server
# listens (minutes), and a large checkpoint takes a while to load: failures in the start period do not count.
HEALTHCHECK --interval=30s --timeout=5s --start-period=20m --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4).status != 200)"]

ENTRYPOINT ["augur", "serve"]
CMD ["--host", "0.0.0.0", "--port", "8000"]
