# lmserve: `make demo` runs the main job end to end, `make test` runs the tests. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: setup test lint demo clean

# Idempotent: re-runs only when pyproject.toml changes. torch is pinned to the CPU build 2.13.0 in pyproject.toml.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

lint: setup
	$(PY) -m ruff check training rescoring server benchmarks tests
	$(PY) -m ruff format --check training rescoring server benchmarks tests

test: lint
	$(PY) -m pytest

DATA ?= $${LMSERVE_DATA:-../shared/data}

# Train a small adaptive-softmax LSTM on PTB in sentence mode (how rescoring scores sentences), evaluate it, export it
# as a model bundle and score a few test sentences with the torch-free scorer.
demo: setup
	rm -rf var/runs/demo
	$(VENV)/bin/lm-train fit configs/demo_ptb.toml --out var/runs/demo
	$(VENV)/bin/lm-train eval --checkpoint var/runs/demo --file "$(DATA)/ptb/ptb.test.txt.gz"
	$(VENV)/bin/lm-train export --checkpoint var/runs/demo --out var/bundles/demo
	zcat "$(DATA)/ptb/ptb.test.txt.gz" | head -3 | $(VENV)/bin/lm-rescore score --lm var/bundles/demo --per-token

clean:
	rm -rf $(VENV) var .pytest_cache .ruff_cache *.egg-info
