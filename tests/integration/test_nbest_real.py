"""The n-best readers on the real sets in ../shared/data: counts and baselines from its README."""

import jiwer
import pytest

from lmserve.rescoring.nbest import NBestList, detect_format, read_nbest, write_nbest

pytestmark = pytest.mark.integration


def one_best_wer(nbest) -> float:
    return 100 * jiwer.wer([e.references[0] for e in nbest], [e.hypotheses[0].text for e in nbest])


def test_librispeech_dev_other_straight_from_the_tarball(shared_data, tmp_path):
    path = shared_data / "librispeech-nbest" / "dev_other.tar.gz"
    assert detect_format(path) == "espnet"
    nbest = read_nbest(path)
    assert len(nbest) == 2864 and {len(e.hypotheses) for e in nbest} == {30} and nbest.num_hypotheses == 85920
    assert all(len(e.references) == 1 for e in nbest)
    assert sum(len(e.references[0].split()) for e in nbest) == 50948
    assert sum(h.text == "" for e in nbest for h in e.hypotheses) == 5
    assert nbest.feature_names() == ["score", "decoder", "ctc", "lm"]
    assert round(one_best_wer(nbest), 2) == 3.61
    for hyp in nbest.entries[0].hypotheses:  # the total is the weighted sum of its parts (README, to 1e-3)
        f = hyp.features
        assert f["score"] == pytest.approx(0.6 * f["decoder"] + 0.4 * f["ctc"] + 0.6 * f["lm"], abs=1e-3)
    assert nbest.by_id("116-288045-0000").hypotheses[0].features["lm"] == -115.2517
    part = NBestList(nbest.entries[:200])  # the layout as written reads back the same (a slice, to stay fast)
    write_nbest(part, tmp_path / "dev_other", "espnet")
    assert read_nbest(tmp_path / "dev_other").entries == part.entries


def test_wsj_hyporadise(shared_data):
    nbest = read_nbest(shared_data / "wsj-nbest" / "dev.json")
    assert len(nbest) == 418 and nbest.num_hypotheses == 2090 and nbest.feature_names() == ["score"]
    assert sum(len(e.references[0].split()) for e in nbest) == 6967
    assert round(one_best_wer(nbest), 2) == 6.32


def test_joshua_kbest_with_four_references(shared_data):
    folder = shared_data / "joshua-bn-en"
    nbest = read_nbest(folder / "output.gold", references=[folder / f"reference.en.{r}" for r in range(4)])
    assert len(nbest) == 100 and nbest.num_hypotheses == 805
    assert {len(e.references) for e in nbest} == {4}
    assert sum(len(e.hypotheses) == 10 for e in nbest) == 56
    first = nbest.entries[0].hypotheses[0]
    assert first.features["lm_0"] == -27.184 and first.features["total"] == -227.217
    assert first.features["OOVPenalty"] == 2.0
    assert nbest.entries[0].references[0] == "rabindranath was born in a pirali brahmin family of kolkata ."
    assert sum(len(e.hypotheses[0].text.split()) for e in nbest) == 1394  # the 1-best length the README gives
