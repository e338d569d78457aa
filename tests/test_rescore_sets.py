"""benchmarks.rescore_sets finds the sets it is judged on beyond its own: every further HyPoradise test list, and
``--extra`` lists; ATIS keeps its own protocol, and a name is never taken twice."""

import json
import sys
from pathlib import Path

import pytest

from benchmarks import rescore_sets


@pytest.fixture
def data(tmp_path, monkeypatch):
    monkeypatch.setattr(rescore_sets, "DATA", tmp_path)
    (tmp_path / "hyporadise").mkdir()
    for name in ("test_atis", "test_chime4", "test_lrs2", "train_atis"):
        (tmp_path / "hyporadise" / f"{name}.json.gz").write_bytes(b"")
    return tmp_path


def test_further_hyporadise_lists_and_extras(data):
    sets = rescore_sets.hyporadise_sets(["mine=/lists/mine.jsonl"])
    assert list(sets)[:4] == ["chime4", "td3", "swbd", "wsj"]  # the four first: the transfer's pool
    assert sets["lrs2"] == data / "hyporadise" / "test_lrs2.json.gz"
    assert str(sets["mine"]) == "/lists/mine.jsonl"
    assert "atis" not in sets and len(sets) == 6


@pytest.mark.parametrize("extra", ["wsj=/x.json", "lrs2=/x.json", "noname", "=/x.json"])
def test_an_extra_needs_a_new_name_and_a_path(data, extra):
    with pytest.raises(SystemExit, match="expected NAME=PATH"):
        rescore_sets.hyporadise_sets([extra])


def tiny_sets(tmp_path, monkeypatch, names: dict[str, int]) -> tuple[Path, list[str]]:
    """HyPoradise-format lists of the tiny LMs' words under tmp_path/hyporadise (name: entries, each the reference
    and a corrupted copy, the copy first in a third of them), the benchmark pointed there; the LM text and the
    command-line arguments that give every LM of the benchmark the tiny bundle and a 3-gram of that text."""
    from conftest import make_sentences

    from lmserve.rescoring.nbest import Hypothesis, NBestEntry, NBestList, write_nbest
    from lmserve.rescoring.ngram import build_ngram

    (tmp_path / "hyporadise").mkdir()
    for seed, (name, n) in enumerate(names.items()):
        entries = []
        for i, ref in enumerate(make_sentences(n, seed=seed + 5)):
            texts = [ref, " ".join(["w39", *ref.split()[1:]])][:: 1 if i % 3 else -1]
            hyps = [Hypothesis(t, {"am_score": -float(k)}, k + 1) for k, t in enumerate(texts)]
            entries.append(NBestEntry(str(i), hyps, [ref]))
        write_nbest(NBestList(entries), tmp_path / "hyporadise" / f"{name}.json.gz", "hyporadise")
    monkeypatch.setattr(rescore_sets, "DATA", tmp_path)
    monkeypatch.setattr(rescore_sets, "NORMALIZE", "lower")  # the tiny LMs' words: w0, w1, ...
    text = tmp_path / "train.txt"
    text.write_text("\n".join(make_sentences(300, seed=1)) + "\n")
    build_ngram((s.split() for s in make_sentences(300, seed=1)), 3, tmp_path / "lm3", discount_fallback=True)
    run = ["--lm-text", str(text), "--folds", "2", "--threads", "1", "--cache-dir", str(tmp_path / "cache")]
    return text, [*run, "--results", str(tmp_path / "r")]


@pytest.mark.slow  # trains the tiny bundles
def test_atis_runs_end_to_end_with_its_keys(bundles, tmp_path, monkeypatch):
    """The atis task through to rescore_atis.json on tiny lists, the same tiny LMs in every part (a local name once
    hid the tuning function from it, and it stopped before any figure)."""
    text, run = tiny_sets(tmp_path, monkeypatch, {"train_atis": 40, "test_atis": 20})
    bundle, ngram = str(bundles[("full", 0.0)][1]), str(tmp_path / "lm3.bin")
    lms = ["--jackknife-lm", bundle, "--jackknife-ngram", ngram, "--jackknife-text", str(text), "--test-lm", bundle]
    lms += ["--test-ngram", ngram, "--general-lm", bundle, "--general-ngram", ngram]
    monkeypatch.setattr(sys, "argv", ["rescore_sets", "atis", *lms, *run])
    rescore_sets.main()
    result = json.loads((tmp_path / "r" / "rescore_atis.json").read_text())
    assert set(result["metrics"]) == {"wer_1best", "wer_rescored", "p_value", "wer_rescored_general_lms"}
    assert set(result["details"]) == {"general", "adapted"} and "jackknife" in result["protocol"]


@pytest.mark.slow  # trains the tiny bundles
def test_hyporadise_runs_end_to_end_with_its_keys(bundles, tmp_path, monkeypatch):
    """The hyporadise task on four tiny sets and a further one: cross-validation and transfer files, every set's
    figures under the keys the summary reads."""
    sets = {"test_chime4": 30, "test_td3": 30, "test_swbd": 30, "test_wsj": 30, "test_lrs2": 30}
    _, run = tiny_sets(tmp_path, monkeypatch, sets)
    four = {name: tmp_path / "hyporadise" / f"test_{name}.json.gz" for name in ("chime4", "td3", "swbd", "wsj")}
    monkeypatch.setattr(rescore_sets, "HYPORADISE", four)
    lms = ["--lm", str(bundles[("full", 0.0)][1]), "--ngram", str(tmp_path / "lm3.bin")]
    monkeypatch.setattr(sys, "argv", ["rescore_sets", "hyporadise", *lms, *run])
    rescore_sets.main()
    cv = json.loads((tmp_path / "r" / "rescore_hyporadise_cv.json").read_text())["metrics"]
    moved = json.loads((tmp_path / "r" / "rescore_hyporadise_transfer.json").read_text())["metrics"]
    for name in ("chime4", "td3", "swbd", "wsj", "lrs2"):
        assert {f"{name}_wer_rescored", f"{name}_wer_rescored_guarded", f"{name}_folds_improved"} <= set(cv)
        assert {f"{name}_wer_1best", f"{name}_wer_rescored"} <= set(moved)
