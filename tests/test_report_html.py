"""The HTML error analysis: what the page carries (statuses, alignments, confusions, lengths, features, plots), that it
fetches nothing, and the --html flags of tune and nbest."""

import json
import re

import numpy as np
import pytest
from conftest import make_sentences
from test_rescore import corrupted_lists

from lmserve.rescoring.commands.cli import main as rescore_main
from lmserve.rescoring.nbest import Hypothesis, NBestEntry, NBestList, write_nbest
from lmserve.rescoring.ngram import build_ngram
from lmserve.rescoring.report_html import build_html
from lmserve.rescoring.rescore import Setup, report, reranked


def page_data(page: str) -> dict:
    match = re.search(r'<script type="application/json" id="data">(.*?)</script>', page, re.S)
    return json.loads(match.group(1).replace("<\\/", "</"))


def assert_offline(page: str) -> None:
    """No fetch of anything: no external scripts, styles, images or links to load."""
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", page)
    assert "<link" not in page and "@import" not in page and "fetch(" not in page


def lists() -> NBestList:
    """Four utterances whose outcome is known: improved, worsened, unchanged, and changed to an equal hypothesis."""

    def entry(i, ref, texts, extra):
        hyps = [
            Hypothesis(t, {"am": -float(k), "lm": float(e)}) for k, (t, e) in enumerate(zip(texts, extra, strict=True))
        ]
        return NBestEntry(f"u{i}", hyps, [ref])

    return NBestList(
        [
            entry(0, "a b c d", ["a x c", "a b c d"], [0, 5]),  # 1-best: S + D; chosen: perfect
            entry(1, "e f g", ["e f g", "e f g h"], [0, 5]),  # 1-best perfect, chosen inserts h
            entry(2, "i j", ["i j", "i k"], [5, 0]),  # unchanged
            entry(3, "k l m", ["k l x", "k y m"], [0, 5]),  # one substitution either way
        ],
        "toy",
    )


def toy_page(plots=()):
    nbest = lists()
    setup = Setup(["am", "lm"], weights={"am": 1.0, "lm": 1.0})
    ranked, chosen = reranked(nbest, setup, None)
    rep = report(nbest, chosen, "wer", bootstrap_samples=50)
    rep["normalisation"] = "exact"
    return build_html(rep, nbest, ranked, chosen, plots), chosen


def test_page_carries_statuses_alignments_and_tables():
    page, chosen = toy_page()
    assert chosen.tolist() == [1, 1, 0, 1]
    assert_offline(page)
    data = page_data(page)
    utts = data["utterances"]
    assert [(u["s1"], u["sc"], u["k"]) for u in utts] == [(2, 0, 2), (0, 1, 2), (0, 0, 1), (1, 1, 2)]
    assert utts[0]["a1"] == [["=", ["a"], ["a"]], ["S", ["b"], ["x"]], ["=", ["c"], ["c"]], ["D", ["d"], []]]
    assert utts[1]["ac"][-1] == ["I", [], ["h"]]
    # the reranked hypotheses with their original rank and every feature (the combined score included)
    assert data["features"] == ["am", "lm", "rescore"]
    assert utts[0]["h"] == [[2, "a b c d", [-1.0, 5.0, 4.0]], [1, "a x c", [0.0, 0.0, 0.0]]]
    pairs = {(r, h): (a, b) for r, h, a, b in data["confusions"]}
    assert pairs[("b", "x")] == (1, 0) and pairs[("d", "")] == (1, 0) and pairs[("", "h")] == (0, 1)
    assert pairs[("m", "x")] == (1, 0) and pairs[("l", "y")] == (0, 1)
    first_bin = data["by_length"][0]
    assert first_bin["utterances"] == 4 and first_bin["words"] == 12
    assert first_bin["first"] == pytest.approx(100 * 3 / 12) and first_bin["rescored"] == pytest.approx(100 * 2 / 12)
    # the filters the page offers, decided in its script from these records
    for name in ("all", "changed", "improved", "worsened", "unchanged"):
        assert f"{name}: u =>" in page
    assert data["report"]["rescored"]["wer"] == pytest.approx(100 * 2 / 12)
    assert "Neural LM scores" in page and "sorted-asc" in page


def test_bleu_lists_get_sentence_bleu():
    nbest = NBestList(
        [
            NBestEntry("s0", [Hypothesis("the a cat sat", {"x": 0.0}), Hypothesis("the cat sat", {"x": 1.0})],
                       ["the cat sat", "a cat sat"]),
            NBestEntry("s1", [Hypothesis("dogs run", {"x": 1.0}), Hypothesis("dog runs", {"x": 0.0})],
                       ["dogs run", "the dogs run"]),
        ],
        "mt",
    )  # fmt: skip
    setup = Setup(["x"], weights={"x": 1.0})
    ranked, chosen = reranked(nbest, setup, None)
    rep = report(nbest, chosen, "bleu", bootstrap_samples=20)
    data = page_data(build_html(rep, nbest, ranked, chosen))
    s0, s1 = data["utterances"]
    assert s0["k"] == 2 and s0["sc"] == 100.0 and s0["s1"] < 100.0
    assert s1["k"] == 1 and s1["s1"] == s1["sc"] == 100.0
    assert "by_length" not in data and "confusions" not in data


def test_tune_and_nbest_write_html(tmp_path):
    dev, test = tmp_path / "dev.jsonl", tmp_path / "test.jsonl"
    write_nbest(corrupted_lists(40, 21, "dev"), dev, "jsonl")
    write_nbest(corrupted_lists(40, 22, "test"), test, "jsonl")
    weights, tune_html, nbest_html = tmp_path / "w.json", tmp_path / "tune.html", tmp_path / "nbest.html"
    tune = ["tune", str(dev), "--metric", "wer", "--features", "am,extra", "--restarts", "1", "--quiet"]
    assert rescore_main([*tune, "--out", str(weights), "--html", str(tune_html)]) == 0
    page = tune_html.read_text()
    assert_offline(page)
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(images) == 1  # no λ plot without interp: one figure of the dev metric around the optimum
    assert "weight" in page and len(page_data(page)["utterances"]) == 40
    args = ["nbest", str(test), "--weights", str(weights), "--out", str(tmp_path / "out.jsonl"), "--quiet"]
    assert rescore_main([*args, "--html", str(nbest_html), "--report", str(tmp_path / "r.json")]) == 0
    data = page_data(nbest_html.read_text())
    rep = json.loads((tmp_path / "r.json").read_text())
    assert data["report"]["rescored"] == rep["rescored"]
    chosen_ranks = np.array([u["k"] for u in data["utterances"]])
    assert (chosen_ranks != 1).sum() == rep["changed_choices"]


def test_tune_html_plots_the_metric_against_lambda_and_every_weight(bundles, tmp_path):
    build_ngram((x.split() for x in make_sentences(300, seed=1)), 3, tmp_path / "lm3", discount_fallback=True)
    dev, page = tmp_path / "dev.jsonl", tmp_path / "tune.html"
    write_nbest(corrupted_lists(30, 21, "dev"), dev, "jsonl")
    args = ["tune", str(dev), "--lm", str(bundles[("full", 0.0)][1]), "--ngram", str(tmp_path / "lm3.bin")]
    args += ["--metric", "wer", "--features", "am,interp,length", "--lambdas", "0.3,0.7", "--restarts", "0"]
    assert rescore_main([*args, "--quiet", "--out", str(tmp_path / "w.json"), "--html", str(page)]) == 0
    html = page.read_text()
    assert len(re.findall(r'src="data:image/png;base64,', html)) == 2
    assert "dev metric against λ" in html and "dev metric against each weight around the optimum" in html
    assert page_data(html)["report"]["normalisation"] == "exact"


def test_lists_of_systems_show_the_chosen_systems():
    def hyp(text, x, a, b):
        return Hypothesis(text, {"x": x, "sys_A": a, "sys_B": b})

    nbest = NBestList(
        [
            NBestEntry("0", [hyp("the a cat sat", 0.0, 1.0, 0.0), hyp("the cat sat", 1.0, 0.0, 1.0)], ["the cat sat"]),
            NBestEntry("1", [hyp("dogs run", 1.0, 1.0, 1.0)], ["dogs run"]),
        ],
        "wmt",
    )
    setup = Setup(["x"], weights={"x": 1.0})
    ranked, chosen = reranked(nbest, setup, None)
    data = page_data(build_html(report(nbest, chosen, "bleu", bootstrap_samples=20), nbest, ranked, chosen))
    assert [u["y"] for u in data["utterances"]] == [["B"], ["A", "B"]]
    assert data["systems"] == [["B", 1, 2], ["A", 2, 1]]  # [system, 1-best count, chosen count], most chosen first
