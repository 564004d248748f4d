# trainlab: the two commands that matter are `make demo` and `make test`.
# Both build their own environment (.venv) first, so each works on a fresh clone.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
# The lock `make setup` installs (devtools/lock.py; `make lock` writes every lock):
# every package pinned and hashed for Linux x86_64, CPython 3.11, torch's CPU
# build, which lies on disk on our machines (pip's find-links); PyPI's torch of
# the same version is the multi-GB CUDA build. requirements/cuda.txt is the GPU
# nodes' lock (cluster/Dockerfile).
LOCK   ?= requirements/cpu.txt
PIP_VERSION := 26.3
PYTEST_ARGS ?=

export PYTHONDONTWRITEBYTECODE := 1
export RAY_USAGE_STATS_ENABLED := 0
export MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR := false

.PHONY: setup lock test test-all test-deps test-fast lint demo bench clean gpu-wheels gpu-check notebook screenshots

setup: $(STAMP)

# Each step says what it does first: the whole setup takes a minute or two. The
# lock installs exactly (--require-hashes: every package pinned, every file
# checked); trainlab itself then goes in without its dependencies (they are the lock's).
$(STAMP): $(LOCK)
	@echo "setup 1/4: creating $(VENV) (Python: $(PYTHON))"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "setup 2/4: pip $(PIP_VERSION)"
	@$(PIP) install -qq "pip==$(PIP_VERSION)"
	@echo "setup 3/4: installing the lock $(LOCK) (torch, ray, mlflow, ...: the largest step)"
	@# -qq: errors only. A machine whose pip config names extra indexes lacking some
	@# packages would otherwise print a "Location ... is ignored" WARNING per package.
	@$(PIP) install -qq --require-hashes -r $(LOCK)
	@echo "setup 4/4: installing trainlab (editable, its dependencies from the lock)"
	@$(PIP) install --quiet --no-deps -e .
	@touch $(STAMP)
	@echo "setup done: $(VENV)"

# Re-resolve requirements/*.txt from pyproject.toml and requirements/*.in (uv pip
# compile, pins kept where still allowed; `make test` fails while a lock is stale).
# LOCK_ARGS go to uv, e.g. LOCK_ARGS=--upgrade, or where torch's CPU wheel is not on
# disk: LOCK_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu".
LOCK_ARGS ?=
lock: $(STAMP)
	$(PY) -m devtools.lock $(LOCK_ARGS)

test: setup test-deps
	$(VENV)/bin/pytest --durations=30 $(PYTEST_ARGS)

# Everything, the `extended` tests included (see pyproject's pytest markers).
test-all: setup test-deps
	$(VENV)/bin/pytest -m 'extended or not extended' $(PYTEST_ARGS)

# What the tests need beyond the lock: a real headless browser for the MLflow UI
# test (Debian's chromium) and PostgreSQL's server binaries for the tracking server
# tests (initdb/pg_ctl, on PATH or under /usr/lib/postgresql/*/bin, as
# trainlab.track.server looks), installed with apt when absent; without them make
# test fails (a test that skips on a fresh machine checks nothing there).
test-deps:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || { \
	  echo "test setup: installing chromium (Debian's package) for the MLflow UI test"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }
	@command -v initdb >/dev/null 2>&1 || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || { \
	  echo "test setup: installing postgresql (Debian's package) for the tracking server tests"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null; }

test-fast: setup
	$(VENV)/bin/pytest tests/unit $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check platform devtools tests data_prep trainers cluster

demo: setup
	$(PY) -m devtools.demo

bench: setup
	$(PY) -m devtools.bench

# The README's screenshots of the MLflow UI (docs/images/: the runs view, a run's
# loss chart), taken by the UI test in a real headless browser, never by hand.
screenshots: setup test-deps
	TRAINLAB_SCREENSHOTS=docs/images $(VENV)/bin/pytest -q \
	  tests/unit/track/test_track_ui.py -k in_a_browser

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
	@# The lock's pins (without hashes: pip would then want one for trainlab itself).
	sed -n 's/^\([A-Za-z0-9][^ ]*==[^ ]*\).*/\1/p' $(LOCK) > $(VENV)/lock-pins.txt
	$(PIP) install --quiet -c $(VENV)/lock-pins.txt -e ".[dev,notebook]"
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
