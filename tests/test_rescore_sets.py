"""benchmarks.rescore_sets finds the sets it is judged on beyond its own: every further HyPoradise test list, and
``--extra`` lists; ATIS keeps its own protocol, and a name is never taken twice."""

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


def _lists(n: int = 120, seed: int = 0):
    """n two-hypothesis lists, the first pass right on 70% of them; feature ``good`` marks the right hypothesis,
    ``noise`` is random."""
    import numpy as np

    from lmserve.rescoring.nbest import Hypothesis, NBestEntry, NBestList

    rng = np.random.default_rng(seed)
    entries = []
    for i in range(n):
        right, wrong = f"word{i} is right", f"word{i} was wrong here"
        first_right = rng.random() < 0.7
        texts = [right, wrong] if first_right else [wrong, right]
        entries.append(
            NBestEntry(
                f"u{i}",
                [
                    Hypothesis(t, {"good": float(t == right), "noise": float(rng.normal())}, rank=k + 1)
                    for k, t in enumerate(texts)
                ],
                references=[right],
            )
        )
    return NBestList(entries, "synthetic")


@pytest.mark.parametrize("feature", ["good", "noise"])
def test_kfold_with_the_guard_nested(feature):
    """With the guard nested, a fold keeps the first pass unless every fold of its training part gains: a feature
    that knows the answer is adopted in every fold, random noise in none (the first pass's WER, exactly)."""
    from lmserve.rescoring.evaluation import kfold
    from lmserve.rescoring.rescore import Setup

    nbest = _lists()
    setup = Setup.parse(f"prior,{feature}", ["prior=-1*rank"])
    figures, details = kfold(nbest, None, setup, "wer", 5, "prior", {"restarts": 2}, guard=5)
    assert details["guard"] == "5 of 5 folds of each training part must gain"
    if feature == "good":
        assert figures["wer_rescored"] == 0.0 and figures["folds_improved"] == 5
    else:
        assert figures["wer_rescored"] == figures["wer_1best"] > 0
        assert all(fold["weights"] == {"prior": 1.0, "noise": 0.0} for fold in details["per_fold"])
