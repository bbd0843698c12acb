# The two set-up commands: `make run` and `make test` (see README.md).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# torch is pinned and installed first: a bare `torch` requirement resolved by pip pulls a multi-GB
# CUDA build, while 2.13.0 is the CPU build available on these machines.
TORCH  := torch==2.13.0

.PHONY: run test install install-dev native lint docs clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.torch: | $(BIN)/python
	$(BIN)/pip install --quiet $(TORCH)
	touch $@

install: $(VENV)/.torch
	$(BIN)/pip install --quiet -e .

install-dev: $(VENV)/.torch
	$(BIN)/pip install --quiet $(TORCH) -e '.[dev,molecules,hf,docs,tensorboard,series,pointclouds]'

# The documentation site (MkDocs, strict: a broken link or reference, or a public name without a
# docstring, fails it) into site/. The variables silence the MkDocs 2 notice some plugins print.
MKDOCS := NO_MKDOCS_2_WARNING=1 DISABLE_MKDOCS_2_WARNING=true $(BIN)/mkdocs build --strict

# The native CPU kernels, compiled at set-up rather than on the first forward (docs/native.md). Where
# they cannot be built the library runs its Python kernels, so set-up goes on, unless
# GEOATTN_NATIVE=require asks for the failure.
native: install
	$(BIN)/geoattn native build || [ "$$GEOATTN_NATIVE" != require ]

run: native
	$(BIN)/geoattn quickstart

lint: install-dev
	$(BIN)/ruff check .

test: install-dev
	$(BIN)/ruff check .
	$(MKDOCS)
	$(BIN)/python -m pytest -q

docs: install-dev
	$(MKDOCS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache site
