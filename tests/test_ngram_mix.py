"""Linear mixtures of KenLM n-grams (rescoring/ngram_mix.py): EM weights tuned on held-out text by
``lm-rescore ngram mix``, the mixture file, and the mixture scored wherever one n-gram is."""

from __future__ import annotations

import hashlib
import io
import json
import math
import sys
from pathlib import Path

import kenlm
import numpy as np
import pytest

from lmserve.rescoring.commands.cli import main
from lmserve.rescoring.ngram import NgramError, NgramLM
from lmserve.rescoring.ngram_mix import NgramMixture, best_mix, load_ngram
from lmserve.rescoring.rescore import LanguageModels


def styled(n: int, seed: int, style: str) -> list[str]:
    """Zipf-distributed words (lmplz can estimate its discounts on them, see test_ngram.py); style "b" gives the
    frequent ranks to other words, so each style's model is clearly better on its own text."""
    rng = np.random.default_rng(seed)

    def rank(z: int) -> int:  # b: ranks 1-5 and 6-10 swapped
        return z if style == "a" or z > 10 else z + 5 if z <= 5 else z - 5

    return [" ".join(f"w{rank(int(z))}" for z in rng.zipf(1.5, size=rng.integers(1, 16))) for _ in range(n)]


def write_text(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Two trigrams built by ``lm-rescore ngram build``, one per style."""
    root = tmp_path_factory.mktemp("mix")
    for style in ("a", "b"):
        text = write_text(root / f"{style}.txt", styled(1000, seed=1 if style == "a" else 2, style=style))
        args = ["ngram", "build", "--order", "3", "--text", str(text), "--out", str(root / style)]
        assert main(args) == 0
    return {"a": root / "a.bin", "b": root / "b.bin", "root": root}


def mix_command(ngram: str, heldout: Path, out: Path) -> list[str]:
    return ["ngram", "mix", "--ngram", ngram, "--heldout", str(heldout), "--out", str(out)]


def mix(models, heldout: Path, out: Path, capsys) -> dict:
    """``lm-rescore ngram mix`` of the two models; returns the mixture file's record, also printed on stdout."""
    capsys.readouterr()
    assert main(mix_command(f"{models['a']},{models['b']}", heldout, out)) == 0
    captured = capsys.readouterr()
    record = json.loads(captured.out)
    assert record == json.loads(out.read_text()) and "mixture ppl" in captured.err
    return record


def test_em_weights_go_to_the_model_of_the_heldout_text_and_the_mixture_beats_each(models, capsys):
    root = models["root"]
    mostly_a = write_text(root / "heldout_a.txt", styled(80, seed=3, style="a") + styled(20, seed=4, style="b"))
    record = mix(models, mostly_a, root / "mix_a.json", capsys)
    (a, b), held = record["models"], record["heldout"]
    assert a["weight"] > 0.5 > b["weight"] > 0 and a["weight"] + b["weight"] == pytest.approx(1, abs=1e-12)
    assert held["converged"] and held["ppl"] < min(a["heldout_ppl"], b["heldout_ppl"])
    assert held["sentences"] == 100 and held["files"] == [str(mostly_a)] and held["normalize"] is None

    # the EM weights are the best linear mixture: no weight on a fine grid gives a lower held-out perplexity
    lms = [NgramLM(models["a"]), NgramLM(models["b"])]
    sentences = [line.split() for line in mostly_a.read_text().splitlines()]
    logprobs = np.concatenate([np.stack([lm.token_logprobs(s) for lm in lms]) for s in sentences], axis=1)
    assert held["tokens"] == logprobs.shape[1] == sum(len(s) + 1 for s in sentences)
    for lm, entry, row in zip(lms, record["models"], logprobs, strict=True):
        assert entry["heldout_ppl"] == pytest.approx(math.exp(-row.mean()), rel=1e-12)
        assert entry["order"] == 3 and entry["path"] == lm.path.name  # relative to the mixture file, beside it
        assert entry["bytes"] == lm.path.stat().st_size
        assert entry["sha256"] == hashlib.sha256(lm.path.read_bytes()).hexdigest()
    for w in np.linspace(0.01, 0.99, 99):
        grid = np.logaddexp(math.log(w) + logprobs[0], math.log1p(-w) + logprobs[1])
        assert held["ppl"] <= math.exp(-grid.mean()) * (1 + 1e-9)

    mostly_b = write_text(root / "heldout_b.txt", styled(20, seed=5, style="a") + styled(80, seed=6, style="b"))
    swapped = mix(models, mostly_b, root / "mix_b.json", capsys)["models"]
    assert swapped[1]["weight"] > 0.5 > swapped[0]["weight"]


def test_em_on_given_probabilities():
    # the second model is better on every token: its weight climbs towards 1 and the likelihood never falls
    logprobs = np.log(np.array([[0.1, 0.2, 0.1], [0.4, 0.5, 0.3]]))
    weights, iterations, converged = best_mix(logprobs)
    assert converged and iterations > 10 and weights[1] > 0.99 and weights.sum() == pytest.approx(1)
    # equal models: nothing to gain, equal weights at once
    weights, iterations, converged = best_mix(np.log(np.full((3, 4), 0.25)))
    assert converged and iterations == 2 and np.allclose(weights, 1 / 3)


@pytest.fixture(scope="module")
def mixture(models) -> NgramMixture:
    root = models["root"]
    heldout = write_text(root / "heldout_m.txt", styled(60, seed=7, style="a") + styled(40, seed=8, style="b"))
    assert main(mix_command(f"{models['a']},{models['b']}", heldout, root / "sub" / "mix.json")) == 0
    return load_ngram(root / "sub" / "mix.json")


def test_one_word_is_scored_as_the_log_of_the_weighted_sum_of_the_models_probabilities(models, mixture):
    record = json.loads(mixture.path.read_text())
    assert [m["path"] for m in record["models"]] == ["../a.bin", "../b.bin"]
    w_a, w_b = (m["weight"] for m in record["models"])
    probabilities = []
    for name in ("a", "b"):  # p(w2 | <s> w1) from KenLM itself, in log10
        model = kenlm.Model(str(models[name]))
        start, after_w1 = kenlm.State(), kenlm.State()
        model.BeginSentenceWrite(start)
        model.BaseScore(start, "w1", after_w1)
        probabilities.append(10 ** model.BaseScore(after_w1, "w2", kenlm.State()))
    expected = math.log(w_a * probabilities[0] + w_b * probabilities[1])
    assert mixture.token_logprobs(["w1", "w2", "w3"])[1] == pytest.approx(expected, rel=1e-12)
    assert mixture.order == 3 and mixture.fingerprint.startswith("mixture ")


def test_stepping_word_by_word_and_states_through_bytes_give_the_sentence_score(mixture):
    for words in [s.split() for s in styled(20, seed=9, style="b")] + [[], ["w1", "neverseen", "w2"]]:
        state, total = mixture.begin_state(), 0.0
        for word in [*words, "</s>"]:
            restored = mixture.state_from_bytes(mixture.state_bytes(state))
            assert restored.context == state.context and len(restored.context) <= mixture.order - 1
            logprob, after = mixture.step(state, word)
            assert mixture.step(restored, word)[0] == pytest.approx(logprob, abs=1e-12)
            assert mixture.next_word_logprobs(state, [word, "w1"])[0] == pytest.approx(logprob, abs=1e-12)
            total, state = total + logprob, after
        assert total == pytest.approx(mixture.score(words), abs=1e-9)
    assert mixture.oov(["w1", "neverseen", "w2"]) == 1


def test_a_mixture_file_works_wherever_an_ngram_does(models, mixture, monkeypatch, capsys):
    lms = LanguageModels.load(None, mixture.path)
    assert isinstance(lms.ngram, NgramMixture) and lms.fingerprint["ngram"] == mixture.fingerprint
    assert isinstance(LanguageModels.load(None, models["a"]).ngram, NgramLM)

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"w1 w2 w3\nw4 neverseen\n")))
    assert main(["ngram", "query", "--lm", str(mixture.path)]) == 0
    rows = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    assert [float(r[0]) for r in rows] == pytest.approx(
        [mixture.score(["w1", "w2", "w3"]), mixture.score(["w4", "neverseen"])]
    )
    assert [int(r[2]) for r in rows] == [0, 1]


def test_errors_name_the_file_the_field_and_what_to_do(models, mixture, tmp_path, capsys):
    with pytest.raises(NgramError, match=r"a comma list of n-grams has no weights; .*lm-rescore ngram mix --ngram"):
        LanguageModels.load(None, f"{models['a']},{models['b']}")
    assert main(mix_command(str(models["a"]), models["root"] / "a.txt", tmp_path / "m.json")) == 2
    assert "expected two or more models" in capsys.readouterr().err
    empty = write_text(tmp_path / "empty.txt", [""])
    assert main(mix_command(f"{models['a']},{mixture.path}", empty, tmp_path / "m.json")) == 2
    assert "a mixture itself" in capsys.readouterr().err
    assert main(mix_command(f"{models['a']},{models['b']}", empty, tmp_path / "m.json")) == 2
    assert "no sentences to tune the weights on" in capsys.readouterr().err
    assert not (tmp_path / "m.json").exists()

    record = json.loads(mixture.path.read_text())
    for change, message in (
        (
            lambda r: r["models"][0].update(bytes=1),
            r"models\[0\]: .*a\.bin has \d+ bytes, the weights were tuned with 1",
        ),
        (lambda r: r["models"][1].update(weight=0.9), r"weights sum to 1\.\d+, expected 1"),
        (lambda r: r["models"][1].update(weight="x"), r"models\[1\]\.weight = 'x': expected a number"),
        (lambda r: r["models"][1].update(path="gone.bin"), r"models\[1\]: .*gone\.bin: no such model file"),
        (lambda r: r.update(format="other"), r"field 'format' must be 'lmserve-ngram-mix'"),
    ):
        changed = json.loads(json.dumps(record))
        change(changed)
        bad = mixture.path.with_name("bad.json")
        bad.write_text(json.dumps(changed))
        with pytest.raises(NgramError, match=message):
            load_ngram(bad)
    bad.write_text('{"format": ')
    with pytest.raises(NgramError, match=r"bad\.json:1:\d+: not valid JSON"):
        load_ngram(bad)
