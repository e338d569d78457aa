# lmserve: `make demo` runs the main job end to end, `make test` runs the tests. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: setup kenlm test lint demo clean proto ngram-english_lm ngram-books_lm ngram-mt_lm

# Idempotent: re-runs only when pyproject.toml changes. torch: the CPU build 2.13.0, installed first (pyproject.toml says why).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet 'torch==2.13.0'  # the CPU build, before the train extra's range can take a CUDA one
	$(PY) -m pip install --quiet -e '.[dev,decoders]'
	$(PY) -m pip install --quiet --no-deps 'pyctcdecode==0.5.0'  # pyproject.toml's decoders extra says why
	touch $(STAMP)

setup: $(STAMP) kenlm

# KenLM's lmplz (estimates ARPA models) and build_binary, compiled from the PyPI kenlm source package, whose Python
# module only queries, by `lm-rescore ngram install-tools` (rescoring/commands/kenlm_tools.py: the source is the version the
# venv's kenlm module was built from, so both read the same binary format). Idempotent: nothing happens once both
# binaries exist, and apt runs only when a build dependency is missing. Outside a checkout, lm-rescore finds them
# through LMSERVE_KENLM_BIN or PATH.
KENLM := .cache/kenlm

kenlm: $(KENLM)/bin/lmplz $(KENLM)/bin/build_binary

$(KENLM)/bin/lmplz $(KENLM)/bin/build_binary &: | $(STAMP)
	DEBS=$$($(PY) -c 'from lmserve.rescoring.commands.kenlm_tools import DEBIAN_PACKAGES; print(*DEBIAN_PACKAGES)'); \
	dpkg -s $$DEBS >/dev/null 2>&1 || { \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update -qq && \
		$$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$DEBS; }
	$(PY) -m lmserve.rescoring ngram install-tools --dest $(KENLM)/bin --jobs 2

# The gRPC contract's Python code (lmserve/v1, committed): regenerate after editing proto/**/*.proto.
proto: $(STAMP)
	$(PY) proto/generate.py

lint: setup
	$(PY) -m ruff check training rescoring server lmserve proto benchmarks tests
	$(PY) -m ruff format --check training rescoring server lmserve proto benchmarks tests

test: lint
	$(PY) -m pytest

# Lint and the tests not marked slow: no server or other process of ours, no training beyond a few steps, no trained
# bundles fixture, no shared data (tests/conftest.py says how tests are marked). About a minute on 2 free cores; `make
# test` (what CI runs) is the whole suite.
.PHONY: test-fast
test-fast: lint
	$(PY) -m pytest -m "not slow" -q

DATA ?= $${LMSERVE_DATA:-../shared/data}

# Train a small adaptive-softmax LSTM on PTB in sentence mode (how rescoring scores sentences), evaluate it, export it
# as a model bundle and score a few test sentences with the torch-free scorer; build a 3-gram that sees the bundle's
# tokens, tune rescoring weights on LibriSpeech dev_clean 30-best lists and rerank dev_other with them (the small PTB
# model does not help lists whose first pass already holds a strong LM: the tuning guard keeps the first pass). Then
# where rescoring pays off: ATIS 5-best lists from a first pass without an LM. The PTB model continues on train_atis's
# references (lm-train fit --init-from), a 4-gram is built on them, weights are tuned on train_atis's lists and
# applied to test_atis (its error analysis: var/rescore/test_atis.report.html), failing if either list got worse.
# Last, the shipped models/english_lm on TED-LIUM 3 (5-fold CV, with the 4-gram of its own text that make ngram-english_lm
# rebuilds): the neural LM's margin over the same recipe with the n-gram only, printed; the demo fails without one.
demo: setup
	rm -rf var/runs/demo
	$(VENV)/bin/lm-train fit configs/demo_ptb.toml --out var/runs/demo
	$(VENV)/bin/lm-train eval --checkpoint var/runs/demo --file "$(DATA)/ptb/ptb.test.txt.gz"
	$(VENV)/bin/lm-train export --checkpoint var/runs/demo --out var/bundles/demo
	zcat "$(DATA)/ptb/ptb.test.txt.gz" | head -3 | $(VENV)/bin/lm-rescore score --lm var/bundles/demo --per-token
	$(VENV)/bin/lm-rescore ngram build --order 3 --text "$(DATA)/ptb/ptb.train.txt.gz" --like var/bundles/demo \
		--out var/ngrams/demo_3gram
	$(VENV)/bin/lm-rescore tune "$(DATA)/librispeech-nbest/dev_clean.tar.gz" --metric wer --lm var/bundles/demo \
		--ngram var/ngrams/demo_3gram.bin --normalize ptb --features score,interp,length --fixed score \
		--bounds interp=0: --lambdas 0.2,0.3,0.4,0.5,0.6,0.7,0.8 --restarts 10 --cv 5 --require-folds 5 \
		--out var/rescore/demo.weights.json
	$(VENV)/bin/lm-rescore nbest "$(DATA)/librispeech-nbest/dev_other.tar.gz" --weights var/rescore/demo.weights.json \
		--out var/rescore/dev_other.rescored.jsonl --out-format jsonl --report var/rescore/dev_other.report.json \
		--html var/rescore/dev_other.report.html
	$(PY) -c 'import json, sys; r = json.load(open("var/rescore/dev_other.report.json")); \
		w = (r["1best"]["wer"], r["rescored"]["wer"]); print("dev_other WER 1-best %.2f, rescored %.2f" % w); \
		sys.exit("rescoring made dev_other worse" if w[1] > w[0] else 0)'
	$(VENV)/bin/lm-rescore references "$(DATA)/hyporadise/train_atis.json.gz" --normalize ptb --out var/atis/demo_train.txt
	rm -rf var/runs/demo_atis
	$(VENV)/bin/lm-train fit configs/adapt_atis_demo.toml --init-from var/runs/demo --out var/runs/demo_atis
	$(VENV)/bin/lm-train export --checkpoint var/runs/demo_atis --out var/bundles/demo_atis
	$(VENV)/bin/lm-rescore ngram build --order 4 --text var/atis/demo_train.txt --like var/bundles/demo_atis \
		--discount-fallback --out var/ngrams/demo_atis_4gram
	$(VENV)/bin/lm-rescore tune "$(DATA)/hyporadise/train_atis.json.gz" --metric wer --lm var/bundles/demo_atis \
		--ngram var/ngrams/demo_atis_4gram.bin --normalize ptb --features am_score,interp,length --fixed am_score \
		--bounds interp=0: --lambdas 0.3,0.5,0.7 --restarts 5 --cv 5 --require-folds 5 \
		--out var/rescore/demo_atis.weights.json
	$(VENV)/bin/lm-rescore nbest "$(DATA)/hyporadise/test_atis.json.gz" --weights var/rescore/demo_atis.weights.json \
		--out var/rescore/test_atis.rescored.jsonl --out-format jsonl --report var/rescore/test_atis.report.json \
		--html var/rescore/test_atis.report.html
	$(PY) -c 'import json, sys; r = json.load(open("var/rescore/test_atis.report.json")); \
		w = (r["1best"]["wer"], r["rescored"]["wer"], r["bootstrap"]["p_value"]); \
		print("test_atis WER 1-best %.2f, rescored %.2f (p = %.3f)" % w); \
		sys.exit("rescoring made test_atis worse" if w[1] > w[0] else 0)'
	$(MAKE) ngram-english_lm
	$(VENV)/bin/lm-rescore evaluate td3="$(DATA)/hyporadise/test_td3.json.gz" --metric wer --lm models/english_lm \
		--ngram var/ngrams/english_lm_4gram.bin --normalize librispeech --features prior,neural,ngram,oov_lm,length,nonword \
		--define prior=-1*rank --fixed prior --bounds neural=0:,ngram=0: --restarts 6 --penalty 0.01 --cv 5 \
		--no-overlap-check --quiet --out var/rescore/td3_margin.json
	$(PY) -c 'import json, sys; r = json.load(open("var/rescore/td3_margin.json"))["cross_validation"]["lists"]["td3"]; \
		s = r["systems"]; w = (s["ngram_only"]["wer"], s["recipe"]["wer"]); m = 100 * (w[0] - w[1]) / w[0]; \
		p = r["bootstrap"]["recipe_vs_ngram_only"]["p_value"]; \
		print("TED-LIUM 3, 5-fold CV, shipped models/english_lm: WER with the n-gram only %.2f, with the neural LM %.2f: " \
			"margin %.1f%% (p = %.3f)" % (*w, m, p)); sys.exit("the neural LM added nothing" if m <= 0 else 0)'

# The n-gram each shipped model (models/) is paired with, rebuilt from the shared data by one command each:
# `make ngram-english_lm` -> var/ngrams/english_lm_4gram.bin (a 4-gram of the model's own training text, in its
# vocabulary: other words are <unk>, so that per-word interpolation mixes distributions over the same words).
ngram-english_lm: setup
	$(VENV)/bin/lm-train prepare-english --data "$(DATA)/english-text" --out var/english-text
	$(VENV)/bin/lm-rescore ngram build --order 4 --text var/english-text/train.txt.gz --like models/english_lm \
		--memory 4G --out var/ngrams/english_lm_4gram

# The books LM's n-gram, LibriSpeech's domain: the 4-gram of gutenberg-large's training books with every word they use
# (not only the neural LM's 30k: 4.8% of LibriSpeech's dev words are outside those, and the n-gram's OOV feature then
# marks only what no book spells, such as a subword decoder's non-words). About 30 minutes and 4 GB of memory:
# var/ngrams/books_4gram.bin (1.5 GB).
ngram-books_lm: setup
	$(VENV)/bin/lm-train prepare-gutenberg --data "$(DATA)/gutenberg-large" --out var/gutenberg-large
	$(VENV)/bin/lm-rescore ngram build --order 4 --text var/gutenberg-large/train.txt.gz --normalize librispeech \
		--memory 4G --out var/ngrams/books_4gram

# The cased MT LM's n-gram: the 4-gram of english-text as written (sgd, cabnc, reuters: case, punctuation and digits
# kept), in the tokens models/mt_lm reads (whitespace-separated words; an open vocabulary, so every word is kept).
# About 2 minutes: var/ngrams/mt_lm_4gram.bin.
ngram-mt_lm: setup
	$(VENV)/bin/lm-train prepare-english --form written --data "$(DATA)/english-text" --out var/english-written
	$(VENV)/bin/lm-rescore ngram build --order 4 --text var/english-written/train.txt.gz --like models/mt_lm \
		--memory 4G --out var/ngrams/mt_lm_4gram

clean:
	rm -rf $(VENV) .cache var .pytest_cache .ruff_cache *.egg-info
