"""Backward LMs (``data.direction = backward``) and ``lm-rescore annotate``, which puts their scores into lists: the
training text read backwards, the bundle that says so and scores sentences reversed, the uses it refuses, and the
list feature that evaluation counts as the neural LM's."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from conftest import fit_and_export, tiny_config_text, write_splits

from lmserve.core.bundle import BundleError
from lmserve.rescoring.commands.cli import main as rescore_main
from lmserve.rescoring.evaluation import Recipe, feature_groups, variants
from lmserve.rescoring.nbest import read_nbest
from lmserve.rescoring.rescore import LanguageModels
from lmserve.rescoring.scorer import Scorer
from lmserve.training.corpus import EncodedCorpus, directed

SENTENCES = ["w1 w2 w3", "w4 w5", "w3 w3 w1 w7"]


def test_a_corpus_read_backwards_is_its_last_sentence_first_each_last_word_first():
    ids = np.array([1, 2, 3, 4, 5, 6], dtype=np.uint16)
    corpus = EncodedCorpus("x", ids, np.array([0, 3, 5, 6]), oov=0)
    backward = directed(corpus, "backward")
    assert [backward.sentence(i).tolist() for i in range(backward.num_sentences)] == [[6], [5, 4], [3, 2, 1]]
    assert directed(corpus, "forward") is corpus
    again = backward.reversed()
    assert np.array_equal(again.ids, ids) and np.array_equal(again.offsets, corpus.offsets)


@pytest.fixture(scope="module")
def backward_bundle(tmp_path_factory):
    root = tmp_path_factory.mktemp("backward")
    text = tiny_config_text(write_splits(root), "sentence", "full", data={"direction": "backward"}, train={"epochs": 1})
    return fit_and_export(root, "backward", text)[1]


@pytest.mark.slow  # (trains a model)
def test_a_backward_bundle_scores_each_sentence_last_word_first(backward_bundle, tmp_path):
    manifest = json.loads((backward_bundle / "manifest.json").read_text())
    assert manifest["direction"] == "backward"
    assert manifest["training"]["config"]["data"]["direction"] == "backward"
    forward = tmp_path / "forward"  # the same graphs read as a forward model
    shutil.copytree(backward_bundle, forward)
    del manifest["direction"]
    (forward / "manifest.json").write_text(json.dumps(manifest))
    backward_scores = Scorer(backward_bundle, threads=1).score(SENTENCES)
    reversed_scores = Scorer(forward, threads=1).score([" ".join(s.split()[::-1]) for s in SENTENCES])
    for b, f in zip(backward_scores, reversed_scores, strict=True):
        assert b.logprob == pytest.approx(f.logprob, abs=1e-6) and b.words == f.words
    nbest = Scorer(backward_bundle, threads=1).score_nbest([SENTENCES])[0]
    assert [s.logprob for s in nbest] == pytest.approx([s.logprob for s in backward_scores], abs=1e-5)


@pytest.mark.slow
def test_a_backward_lm_is_refused_where_words_are_read_in_order(backward_bundle):
    from lmserve.rescoring.decoders.lm import DecoderLM

    with pytest.raises(BundleError, match="backward LM .* lm-rescore annotate"):
        DecoderLM.local(backward_bundle)
    with pytest.raises(BundleError, match="cannot give rescoring's LM features"):
        LanguageModels.load(backward_bundle, None)


@pytest.mark.slow
def test_a_model_continued_from_a_backward_one_reads_backwards_unless_its_config_says(backward_bundle, tmp_path):
    from lmserve.training.adapt import adapted_config, initial_checkpoint

    corpus = write_splits(tmp_path)
    config = tmp_path / "adapt.toml"
    config.write_text(tiny_config_text(corpus, "sentence", "full"))
    start = initial_checkpoint(str(backward_bundle))
    assert adapted_config(str(config), [], start).data.direction == "backward"
    assert adapted_config(str(config), ['data.direction="forward"'], start).data.direction == "forward"


def write_list(path, texts_per_entry):
    lines = []
    for i, texts in enumerate(texts_per_entry):
        hyps = [{"text": t, "features": {"score": -float(k)}, "rank": k + 1} for k, t in enumerate(texts)]
        lines.append(json.dumps({"id": f"u{i}", "hypotheses": hyps, "references": [texts[0]], "document": "d"}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.slow
def test_annotate_adds_the_lms_sentence_scores_as_a_feature_and_keeps_the_rest(backward_bundle, tmp_path, capsys):
    listed = write_list(tmp_path / "list.jsonl", [SENTENCES, SENTENCES[::-1][:2]])
    out = tmp_path / "annotated.jsonl"
    argv = ["annotate", str(listed), "--lm", str(backward_bundle), "--feature", "neural_backward", "--threads", "1"]
    assert rescore_main([*argv, "--out", str(out)]) == 0
    assert "2 entries, 5 hypotheses with feature 'neural_backward' (backward LM" in capsys.readouterr().err
    before, after = read_nbest(listed), read_nbest(out)
    expected = Scorer(backward_bundle, threads=1).score([h.text for e in before for h in e.hypotheses])
    got = [h.features.pop("neural_backward") for e in after for h in e.hypotheses]
    assert got == pytest.approx([s.logprob for s in expected], abs=1e-5)
    assert after.entries == before.entries  # ranks, scores, references and documents as they were

    assert rescore_main(["annotate", str(out), "--lm", str(backward_bundle), "--feature", "neural_backward",
                         "--out", str(tmp_path / "twice.jsonl")]) == 2  # fmt: skip
    assert "already carries feature 'neural_backward'" in capsys.readouterr().err
    assert rescore_main([*argv[:4], "--feature", "backward", "--out", str(tmp_path / "x.jsonl")]) == 2
    assert "expected a name that starts with 'neural_'" in capsys.readouterr().err
    assert rescore_main([*argv, "--out", str(tmp_path / "x.json")]) == 2
    assert "give a path that ends in .jsonl" in capsys.readouterr().err
    assert not any((tmp_path / name).exists() for name in ("twice.jsonl", "x.jsonl", "x.json"))


def test_a_backward_subword_model_is_refused_before_training(tiny_corpus):
    from lmserve.core.tomlconfig import ConfigError
    from lmserve.training.config import config_from_dict

    raw = {"data": {"train": str(tiny_corpus["train"]), "direction": "backward"}, "vocab": {"type": "subword"}}
    with pytest.raises(ConfigError, match="data.direction = backward is for word vocabularies"):
        config_from_dict(raw, "x.toml")


def test_a_neural_feature_the_list_carries_counts_as_the_neural_lms_in_the_baselines():
    assert feature_groups("neural_backward", {}, has_lm=True) == {"neural"}
    recipe = Recipe(features=("score", "neural", "neural_backward", "ngram", "length"), fixed="score")
    found, _ = variants(recipe, has_lm=True, has_ngram=True)
    assert found["ngram_only"].recipe.features == ("score", "ngram", "length")
    assert found["no_lm"].recipe.features == ("score", "length")
