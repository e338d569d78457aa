"""A bundle's normalisation is measured at export: exact heads, self-normalised scores within the log Z thresholds,
unnormalised ones beyond; lm-rescore refuses to interpolate unnormalised scores unless asked; stream-mode exports
warn with both perplexities."""

import json

import pytest
from conftest import make_sentences, tiny_config_text, write_splits
from test_rescore import corrupted_lists

from lmserve.core import bundle as bundle_format
from lmserve.core.bundle import Bundle
from lmserve.rescoring import client
from lmserve.rescoring.commands.cli import main as rescore_main
from lmserve.rescoring.nbest import write_nbest
from lmserve.rescoring.scorer import Scorer
from lmserve.training.cli import main as train_main
from lmserve.training.export import SELFNORM_MAX_ABS_MEAN, SELFNORM_MAX_STD, normalisation_label


def test_the_label_follows_the_measurement():
    assert normalisation_label(False, 3.0, 2.0) == "exact"  # a head that normalises: log Z does not matter
    assert normalisation_label(True, 0.0, 0.0) == "self-normalised"
    assert normalisation_label(True, -SELFNORM_MAX_ABS_MEAN, SELFNORM_MAX_STD) == "self-normalised"
    assert normalisation_label(True, SELFNORM_MAX_ABS_MEAN + 0.01, 0.1) == "unnormalised"
    assert normalisation_label(True, 0.0, SELFNORM_MAX_STD + 0.01) == "unnormalised"
    # figures of the PTB objective rows: negative sampling and IS without the penalty were called self-normalised
    assert normalisation_label(True, 3.05, 0.73) == "unnormalised"
    assert normalisation_label(True, 1.49, 1.47) == "unnormalised"
    assert normalisation_label(True, -0.06, 0.24) == "self-normalised"  # NCE
    assert set(client.NORMALISATIONS) == set(bundle_format.NORMALISATIONS)  # every label has its wire value


def test_penalised_bundles_measure_as_self_normalised(bundles):
    for (head, alpha), (_, path) in bundles.items():
        scorer = Scorer(path, threads=1)
        held = scorer.bundle.manifest["heldout"]
        expected = "exact" if alpha == 0 else "self-normalised"
        assert scorer.normalisation == scorer.bundle.normalisation == expected, (head, alpha)
        if alpha:
            assert abs(held["logz_mean"]) <= SELFNORM_MAX_ABS_MEAN and held["logz_std"] <= SELFNORM_MAX_STD


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Two exports: negative sampling (scores far from log-probabilities) and a stream-mode model."""
    root = tmp_path_factory.mktemp("normalisation")
    corpus = write_splits(root)
    made = {}
    for name, mode, objective in (
        ("ns", "sentence", {"type": "negative_sampling", "samples": 10}),
        ("stream", "stream", {}),
    ):
        config = root / f"{name}.toml"
        config.write_text(tiny_config_text(corpus, mode, "full", train={"epochs": 1}, objective=objective))
        assert train_main(["fit", str(config), "--out", str(root / name)]) == 0
        made[name] = root / name
    return made


@pytest.mark.slow  # two models trained
def test_unnormalised_export_warns_and_interp_is_refused_unless_asked(trained, tmp_path, capsys):
    out = tmp_path / "ns.bundle"
    assert train_main(["export", "--checkpoint", str(trained["ns"]), "--out", str(out)]) == 0
    assert "scores are unnormalised" in capsys.readouterr().err
    bundle = Bundle.load(out)
    held = bundle.manifest["heldout"]
    assert bundle.normalisation == "unnormalised" and not bundle.normalised
    assert abs(held["logz_mean"]) > SELFNORM_MAX_ABS_MEAN or held["logz_std"] > SELFNORM_MAX_STD
    sentences = tmp_path / "s.txt"
    sentences.write_text("w1 w2\n")
    assert rescore_main(["score", "--lm", str(out), "--input", str(sentences), "--threads", "1"]) == 0
    assert "unnormalised scores (not log-probabilities)" in capsys.readouterr().err

    ngram, corpus = tmp_path / "lm3", tmp_path / "train.txt"
    corpus.write_text("\n".join(make_sentences(300, seed=1)) + "\n")
    build = ["ngram", "build", "--order", "3", "--text", str(corpus), "--out", str(ngram), "--discount-fallback"]
    assert rescore_main(build) == 0
    dev, weights = tmp_path / "dev.jsonl", tmp_path / "w.json"
    write_nbest(corrupted_lists(20, 5, "dev"), dev, "jsonl")
    tune = ["tune", str(dev), "--lm", str(out), "--ngram", str(ngram.with_suffix(".bin")), "--metric", "wer"]
    tune += ["--lambdas", "0.5", "--restarts", "0", "--quiet", "--out", str(weights)]
    capsys.readouterr()
    assert rescore_main([*tune, "--features", "am,interp"]) == 2
    assert "scores are unnormalised" in capsys.readouterr().err and not weights.exists()
    assert rescore_main([*tune, "--features", "am,neural"]) == 0  # as a log-linear feature they are fine
    assert rescore_main([*tune, "--features", "am,interp", "--allow-unnormalised"]) == 0
    assert json.loads(weights.read_text())["setup"]["lambda"] == 0.5


@pytest.mark.slow  # two models trained
def test_stream_mode_export_warns_with_both_perplexities(trained, tmp_path, capsys):
    out = tmp_path / "stream.bundle"
    assert train_main(["export", "--checkpoint", str(trained["stream"]), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    held = json.loads((out / "manifest.json").read_text())["heldout"]
    assert held["stream_ppl"] > 1 and held["ppl"] > 1
    assert "trained in stream mode" in err
    assert f"{held['stream_ppl']:.2f} as a stream" in err and f"{held['ppl']:.2f} sentence by sentence" in err


@pytest.mark.slow  # two models trained
def test_a_server_does_not_interpolate_unnormalised_scores(trained, tmp_path):
    """Neither the model's lambda (ScoreSentences, ScoreNextWords) nor a profile's interp feature."""
    from lmserve.server.config import ConfigError, load_config
    from lmserve.server.models import ModelSet

    out = tmp_path / "ns.bundle"
    assert train_main(["export", "--checkpoint", str(trained["ns"]), "--out", str(out)]) == 0
    corpus = tmp_path / "train.txt"
    corpus.write_text("\n".join(make_sentences(300, seed=1)) + "\n")
    build = ["ngram", "build", "--order", "3", "--text", str(corpus), "--out", str(tmp_path / "lm3")]
    assert rescore_main([*build, "--discount-fallback"]) == 0
    config = tmp_path / "serve.toml"
    model = f'[models.ns]\nbundle = "{out}"\nngram = "lm3.bin"\n'
    config.write_text(model)
    assert ModelSet.load(load_config(config)).get("ns").lm.scorer.normalisation == "unnormalised"
    config.write_text(model + "lambda = 0.5\n")
    with pytest.raises(ConfigError, match="models.ns.lambda: .* unnormalised"):
        ModelSet.load(load_config(config))
    dev, weights = tmp_path / "dev.jsonl", tmp_path / "w.json"
    write_nbest(corrupted_lists(20, 5, "dev"), dev, "jsonl")
    tune = ["tune", str(dev), "--lm", str(out), "--ngram", str(tmp_path / "lm3.bin"), "--metric", "wer", "--quiet"]
    tune += ["--features", "am,interp", "--lambdas", "0.5", "--restarts", "0", "--allow-unnormalised"]
    assert rescore_main([*tune, "--out", str(weights)]) == 0
    config.write_text(model + f'[models.ns.profiles]\ndev = "{weights}"\n')
    with pytest.raises(ConfigError, match="profiles.dev .*uses interp, but the model's neural scores are unnormalised"):
        ModelSet.load(load_config(config))
