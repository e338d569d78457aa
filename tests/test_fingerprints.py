"""Weights files record their models by content (``core.fingerprints``; once a different model later put at
the same path was used with the old weights, silently): ``lm-rescore nbest --weights`` with a swapped bundle or
n-gram is an error naming the weights file and the model, and ``--accept-changed-models`` uses it with a warning."""

import json
import shutil

import pytest
from test_closed_stdout import ARPA
from test_rescore_robustness import OPENED, lists

from lmserve.rescoring.commands.cli import main as rescore_main
from lmserve.rescoring.nbest import read_nbest, write_nbest
from lmserve.rescoring.tune import read_weights

WORDS = " ".join(f"w{i}" for i in range(30))


def unigram_arpa(logprob: float) -> str:
    """A model of the words of ``lists``, each at ``logprob`` (and one bigram: KenLM reads no unigram model)."""
    words = WORDS.split()
    lines = ["\\data\\", f"ngram 1={len(words) + 3}", "ngram 2=1", "", "\\1-grams:"]
    lines += ["-1.0\t<unk>\t0", "-99\t<s>\t0", "-1.0\t</s>\t0", *(f"{logprob}\t{w}\t0" for w in words)]
    return "\n".join([*lines, "", "\\2-grams:", "-0.3\t<s> w0", "", "\\end\\", ""])


@pytest.fixture
def tuned(tmp_path, bundles, monkeypatch):
    """A dev list tuned with a bundle copied to models/lm and an n-gram models/ng.arpa, in the current folder."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    shutil.copytree(bundles[("full", 0.0)][1], tmp_path / "models" / "lm")
    (tmp_path / "models" / "ng.arpa").write_text(unigram_arpa(-1.5))
    write_nbest(lists(8), tmp_path / "dev.jsonl", "jsonl")
    tune = ["tune", "dev.jsonl", "--lm", "models/lm", "--ngram", "models/ng.arpa", "--metric", "wer"]
    tune += ["--features", "am,neural,ngram", "--restarts", "1", "--quiet", "--out", "w.json"]
    assert rescore_main(tune) == 0
    return tmp_path


NBEST = ["nbest", "dev.jsonl", "--weights", "w.json", "--out", "o.jsonl", "--quiet", "--no-overlap-check"]


def test_the_weights_record_each_models_fingerprint(tuned):
    from lmserve.core.bundle import sha256_file
    from lmserve.rescoring.commands.shards import fingerprint

    recorded = read_weights("w.json")["setup"]["fingerprints"]
    assert recorded == {
        "lm": {"manifest_sha256": sha256_file(tuned / "models" / "lm" / "manifest.json")},
        "ngram": fingerprint(tuned / "models" / "ng.arpa"),
    }
    assert rescore_main(NBEST) == 0  # the same models: no complaint


def test_a_swapped_bundle_is_an_error_naming_the_weights_and_the_model(tuned, bundles, capsys):
    shutil.rmtree(tuned / "models" / "lm")
    shutil.copytree(bundles[("adaptive", 0.0)][1], tuned / "models" / "lm")  # another model at the same path
    capsys.readouterr()
    OPENED.clear()
    assert rescore_main(NBEST) == 2
    err = capsys.readouterr().err
    assert "w.json: the neural LM bundle models/lm is not the one these weights were tuned with" in err, err
    assert "setup.fingerprints.lm.manifest_sha256" in err and "--accept-changed-models" in err
    assert not OPENED and not (tuned / "o.jsonl").exists()  # refused before any model ran
    assert rescore_main([*NBEST, "--accept-changed-models"]) == 0
    assert "warning: w.json: the neural LM bundle models/lm is not the one" in capsys.readouterr().err
    assert len(read_nbest(tuned / "o.jsonl")) == 8


def test_a_rebuilt_ngram_is_an_error_and_so_is_one_given_on_the_command_line(tuned, capsys):
    (tuned / "models" / "ng.arpa").write_text(unigram_arpa(-1.6))  # the same size, other scores
    capsys.readouterr()
    assert rescore_main(NBEST) == 2
    err = capsys.readouterr().err
    assert "w.json: the n-gram models/ng.arpa is not the one" in err and "setup.fingerprints.ngram.sha256" in err
    (tuned / "other.arpa").write_text(ARPA)
    assert rescore_main([*NBEST, "--ngram", "other.arpa"]) == 2  # --ngram names another model: the same check
    assert "the n-gram other.arpa is not the one" in capsys.readouterr().err


def test_weights_without_fingerprints_are_not_checked(tuned):
    record = json.loads((tuned / "w.json").read_text())
    del record["setup"]["fingerprints"]
    (tuned / "w.json").write_text(json.dumps(record))
    (tuned / "models" / "ng.arpa").write_text(unigram_arpa(-1.6))
    assert rescore_main(NBEST) == 0
