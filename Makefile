# trainlab: the two commands that matter are `make demo` and `make test`.
# Both build their own environment (.venv) first, so each works on a fresh clone.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
# The CPU build of torch lies on disk on our machines; asking for any other spec
# pulls a multi-GB CUDA build. A machine with an NVIDIA GPU gets the default build.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

export PYTHONDONTWRITEBYTECODE := 1
export RAY_USAGE_STATS_ENABLED := 0
export MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR := false

.PHONY: setup test test-all test-fast lint demo bench clean gpu-wheels gpu-check notebook

setup: $(STAMP)

# Each step says what it does first: the whole setup takes a minute or two.
$(STAMP): pyproject.toml
	@echo "setup 1/4: creating $(VENV) (Python: $(PYTHON))"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "setup 2/4: upgrading pip"
	@$(PIP) install --quiet --upgrade pip
	@echo "setup 3/4: installing $(TORCH_SPEC) (the largest step)"
	@$(PIP) install --quiet "$(TORCH_SPEC)"
	@echo "setup 4/4: installing trainlab and its dependencies (ray, mlflow, ...)"
	@$(PIP) install --quiet -e ".[dev]"
	@touch $(STAMP)
	@echo "setup done: $(VENV)"

test: setup
	$(VENV)/bin/pytest $(PYTEST_ARGS)

# Everything, the `extended` tests included (see pyproject's pytest markers).
test-all: setup
	$(VENV)/bin/pytest -m 'extended or not extended' $(PYTEST_ARGS)

test-fast: setup
	$(VENV)/bin/pytest tests/unit $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check platform devtools tests data_prep trainers cluster

demo: setup
	$(PY) -m devtools.demo

bench: setup
	$(PY) -m devtools.bench

# JupyterLab over .venv (its python3 kernel imports trainlab), on 127.0.0.1 with
# token auth (Jupyter's default: the URL it prints carries a fresh token),
# notebooks/ open. The `notebook` extra is installed on first use only, so
# `make test`/`make demo` stay lean. Notebooks: docs/notebooks.md.
NOTEBOOK_PORT  ?= 8888
# Expanded once (`:=`), so the URL printed below carries the token Jupyter gets.
ifndef NOTEBOOK_TOKEN
NOTEBOOK_TOKEN := $(shell $(PYTHON) -c 'import secrets; print(secrets.token_urlsafe(24))')
endif
NOTEBOOK_STAMP := $(VENV)/.notebook-installed

$(NOTEBOOK_STAMP): $(STAMP)
	$(PIP) install --quiet -e ".[dev,notebook]"
	touch $(NOTEBOOK_STAMP)

notebook: $(NOTEBOOK_STAMP)
	@echo "notebooks: open http://127.0.0.1:$(NOTEBOOK_PORT)/lab?token=$(NOTEBOOK_TOKEN)"
	@$(VENV)/bin/jupyter lab --ServerApp.ip=127.0.0.1 --ServerApp.port=$(NOTEBOOK_PORT) \
		--ServerApp.open_browser=False --ServerApp.root_dir=notebooks \
		--IdentityProvider.token=$(NOTEBOOK_TOKEN) $(if $(filter 0,$(shell id -u)),--allow-root)

# The prepared GPU check (devtools/gpu_check.py; README "GPU check"). The GPU
# machine has no network and only its own python3 (3.12) with torch, numpy,
# pyarrow, tokenizers, pyyaml, safetensors and transformers: no .venv, no Ray.
# gpu-wheels (here, with network): the wheels of what else the check imports
# (pydantic and its dependencies) for CPython 3.12 manylinux x86-64 into
# .gpu-wheels (ignored; fails over 30 MiB). Carry that folder to the GPU machine.
# gpu-check (there): exits 2 without a CUDA GPU; installs .gpu-wheels offline into
# .gpu-site, then runs the check (< 8 min): JSON to $OUT/gpu-check.json, else ./gpu-check.json.
GPU_PYTHON ?= python3
GPU_WHEELS := .gpu-wheels
GPU_SITE   := .gpu-site

gpu-wheels: setup
	$(PY) devtools/gpu_check.py --download-wheels $(GPU_WHEELS)

gpu-check:
	PYTHONPATH=platform:.:$(GPU_SITE) $(GPU_PYTHON) devtools/gpu_check.py --wheels $(GPU_WHEELS) --site $(GPU_SITE)

clean:
	rm -rf $(VENV) runs data/demo bench-results.json
