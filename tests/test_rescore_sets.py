"""benchmarks.rescore_sets finds the sets it is judged on beyond its own: every WMT22 pair of the data folder, every
further HyPoradise test list, and ``--extra`` lists; ATIS keeps its own protocol, and a name is never taken twice."""

import pytest

from benchmarks import rescore_sets


@pytest.fixture
def data(tmp_path, monkeypatch):
    monkeypatch.setattr(rescore_sets, "DATA", tmp_path)
    for pair in ("zh-en", "ja-en"):
        (tmp_path / "wmt22-en" / pair).mkdir(parents=True)
        (tmp_path / "wmt22-en" / pair / f"generaltest2022.{pair}.hyp.SYS.en").write_text("a\n")
    (tmp_path / "wmt22-en" / "notes").mkdir()  # no system outputs: not a pair
    (tmp_path / "hyporadise").mkdir()
    for name in ("test_atis", "test_chime4", "test_lrs2", "train_atis"):
        (tmp_path / "hyporadise" / f"{name}.json.gz").write_bytes(b"")
    return tmp_path


def test_every_pair_with_system_outputs(data):
    assert rescore_sets.wmt22_pairs() == ["ja-en", "zh-en"]


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
