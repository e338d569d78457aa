"""`lm-rescore tune` and `nbest` on a real k-best list with a real n-gram: the Joshua bn-en list and its own 5-gram."""

import json

import pytest

from lmserve.rescoring.commands.cli import main as rescore_main

pytestmark = pytest.mark.integration


def test_joshua_kbest_tuned_and_reranked_with_its_5gram(shared_data, tmp_path, capsys):
    folder = shared_data / "joshua-bn-en"
    refs = [str(folder / f"reference.en.{k}") for k in range(4)]
    weights = tmp_path / "joshua.weights.json"
    common = ["--references", *refs, "--ngram", str(folder / "lm.gz"), "--quiet"]
    tune_args = ["tune", str(folder / "output.gold"), *common, "--metric", "bleu", "--features", "total,ngram,length"]
    assert rescore_main([*tune_args, "--restarts", "1", "--out", str(weights)]) == 0
    record = json.loads(weights.read_text())
    assert record["dev_metric"] >= record["baseline_metric"] == pytest.approx(24.29, abs=0.01)
    capsys.readouterr()
    report = tmp_path / "report.json"
    out = tmp_path / "rescored.txt"
    assert (
        rescore_main(
            [
                "nbest",
                str(folder / "output.gold"),
                *common,
                "--weights",
                str(weights),
                "--out",
                str(out),
                "--out-format",  # (a name like rescored.txt does not say which format)
                "moses",
                "--report",
                str(report),
            ]
        )
        == 0
    )
    result = json.loads(report.read_text())
    assert result["1best"]["bleu"] == pytest.approx(24.29, abs=0.01)
    assert result["oracle"]["bleu"] == pytest.approx(28.17, abs=0.01)
    assert result["rescored"]["bleu"] == pytest.approx(record["dev_metric"], abs=1e-6)
    assert out.read_text(encoding="utf-8").count("|||") == 805 * 3  # the same Moses format, every hypothesis kept
