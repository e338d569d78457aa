"""``lm-train fit --init-from``: a model trained on general text continued on a small in-domain one (training/adapt.py),
and ``data.valid_fraction`` (training/valid_split.py)."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import tiny_config_text, write_corpus, write_splits

from lmserve.training.cli import main
from lmserve.training.vocab import Vocabulary

pytestmark = pytest.mark.slow  # trains and continues runs for epochs

NEW_WORD = "boston"  # the in-domain text's one word the general model never saw


def in_domain(n: int, seed: int) -> list[str]:
    """A few fixed phrasings over the general words, one of them with a new word: far likelier under a model that
    has seen them than under the general one."""
    phrasings = ["w5 w9 w5 w9 w2", "w9 w5 w2", f"w7 w5 {NEW_WORD} w9", "w2 w7 w7 w5 w9"]
    rng = np.random.default_rng(seed)
    return [phrasings[i] for i in rng.integers(len(phrasings), size=n)]


@pytest.fixture(scope="module")
def initial(tmp_path_factory) -> Path:
    """A run trained two epochs on the general text, in sentence mode."""
    root = tmp_path_factory.mktemp("general")
    corpus = write_splits(root)
    config = root / "general.toml"
    config.write_text(tiny_config_text(corpus, "sentence", "full", train={"epochs": 2}))
    assert main(["fit", str(config), "--out", str(root / "run")]) == 0
    return root / "run"


@pytest.fixture
def domain(tmp_path) -> dict[str, Path]:
    return {
        name: write_corpus(tmp_path / f"atis_{name}.txt", in_domain(n, seed=s))
        for name, n, s in (("train", 120, 1), ("valid", 30, 2), ("test", 30, 3))
    }


def adapt_config(tmp_path: Path, domain: dict[str, Path], name: str = "adapt", head: str = "full", **sections) -> Path:
    """The in-domain files and the training settings; [model] and [head] repeat the initial run's values."""
    path = tmp_path / f"{name}.toml"
    sections.setdefault("optimizer", {"name": "adam", "lr": 0.01})
    path.write_text(tiny_config_text(domain, "sentence", head, **sections))
    return path


def best_checkpoint(run: Path) -> str:
    return (run / "checkpoints" / "best").read_text().strip()


def test_adapting_keeps_the_vocabulary_counts_new_words_and_beats_the_initial_model(initial, domain, tmp_path, capsys):
    capsys.readouterr()
    run = tmp_path / "adapted"
    config = adapt_config(tmp_path, domain, train={"epochs": 3})
    assert main(["fit", str(config), "--init-from", str(initial), "--out", str(run)]) == 0
    out, err = capsys.readouterr()
    results = json.loads(out)
    assert results == json.loads((run / "results.json").read_text())

    initial_ckpt = initial / "checkpoints" / best_checkpoint(initial)
    assert Vocabulary.load(run / "vocab.tsv").tokens == Vocabulary.load(initial_ckpt / "vocab.tsv").tokens
    train_new = sum(line.split().count(NEW_WORD) for line in domain["train"].read_text().splitlines())
    adapted = results["init_from"]
    assert adapted["checkpoint"] == str(initial_ckpt)
    assert adapted["oov"]["train"]["oov"] == train_new > 0
    assert adapted["oov"]["train"]["oov_rate"] == pytest.approx(train_new / adapted["oov"]["train"]["words"])
    assert f"words outside it -> <unk>: train {train_new:,} of" in err

    # the initial model's validation perplexity is the one lm-train eval gives it; adapting beats it by far
    assert main(["eval", "--checkpoint", str(initial), "--file", str(domain["valid"])]) == 0
    assert adapted["valid_ppl"] == pytest.approx(json.loads(capsys.readouterr().out)["ppl"], rel=1e-9)
    assert results["valid"]["ppl"] < adapted["valid_ppl"] / 2
    assert best_checkpoint(run) != "ckpt-000-000000" and results["stopped"] == "epochs"

    saved = json.loads((run / "config.json").read_text())
    general = json.loads((initial_ckpt / "config.json").read_text())
    assert {s: saved[s] for s in ("model", "head", "vocab")} == {s: general[s] for s in ("model", "head", "vocab")}
    assert saved["data"]["train"] == str(domain["train"]) and saved["train"]["epochs"] == 3
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    first = next(e for e in events if e["event"] == "valid")
    assert first["epoch"] == 0 and first["tokens_seen"] == 0 and first["ppl"] == adapted["valid_ppl"]


def test_no_better_epoch_stops_early_and_keeps_the_initial_weights_as_best(initial, domain, tmp_path, capsys):
    # lr 0: every evaluation equals the initial one, none is better: patience 2 stops after epoch 2 of 10
    run = tmp_path / "still"
    config = adapt_config(tmp_path, domain, optimizer={"lr": 0.0}, train={"epochs": 10, "early_stop_patience": 2})
    assert main(["fit", str(config), "--init-from", str(initial), "--out", str(run)]) == 0
    results = json.loads(capsys.readouterr().out)
    assert results["epochs"] == 2 and results["stopped"].startswith("early stop")
    assert results["best_checkpoint"] == best_checkpoint(run) == "ckpt-000-000000"
    assert results["valid"]["ppl"] == pytest.approx(results["init_from"]["valid_ppl"], rel=1e-12)

    # a rate that wrecks the model: the held-out result is still the initial model's, never worse
    run = tmp_path / "wrecked"
    config = adapt_config(tmp_path, domain, "wreck", optimizer={"name": "sgd", "lr": 50.0})
    assert main(["fit", str(config), "--init-from", str(initial), "--out", str(run), "--set", "train.epochs=2"]) == 0
    results = json.loads(capsys.readouterr().out)
    valid = [
        e["ppl"] for e in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if e["event"] == "valid"
    ]
    assert min(valid[1:]) > valid[0]  # every epoch was worse than the initial weights
    assert results["best_checkpoint"] == "ckpt-000-000000"
    assert results["valid"]["ppl"] == pytest.approx(results["init_from"]["valid_ppl"], rel=1e-12)


def test_model_head_vocab_and_lowercase_must_agree_with_the_checkpoint(initial, domain, tmp_path, capsys):
    for sections, key, given, saved in (
        ({"model": {"hidden_size": 32}}, "model.hidden_size", "32", "16"),
        ({"head": "adaptive"}, "head.type", "'adaptive'", "'full'"),
        ({"vocab": {"min_count": 3}}, "vocab.min_count", "3", "1"),
        ({"data": {"lowercase": True}}, "data.lowercase", "True", "False"),
    ):
        config = adapt_config(tmp_path, domain, **sections)
        assert main(["fit", str(config), "--init-from", str(initial), "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err
        assert f"{key} = {given}, but the initial checkpoint" in err and f"has {saved}" in err, err
    assert not (tmp_path / "x").exists()


def test_a_bundle_or_a_missing_checkpoint_is_refused_with_what_to_pass(initial, domain, tmp_path, capsys):
    bundle = tmp_path / "model.bundle"
    bundle.mkdir()
    (bundle / "manifest.json").write_text(json.dumps({"format": "lmserve-bundle", "training": {"checkpoint": "R/c"}}))
    config = adapt_config(tmp_path, domain)
    assert main(["fit", str(config), "--init-from", str(bundle)]) == 2
    assert f"--init-from {bundle}: {bundle}/manifest.json: format_version None" in capsys.readouterr().err  # incomplete
    assert main(["fit", str(config), "--init-from", str(tmp_path / "nothing")]) == 2
    assert "neither a checkpoint" in capsys.readouterr().err
    assert main(["fit", "--resume", str(initial), "--init-from", str(initial)]) == 2
    assert "--init-from starts a new run" in capsys.readouterr().err


def test_valid_fraction_carves_the_last_lines_of_the_one_training_file(initial, domain, tmp_path, capsys):
    lines = domain["train"].read_text().splitlines()
    config = adapt_config(tmp_path, domain, data={"valid": "", "valid_fraction": 0.1}, train={"epochs": 1})
    run = tmp_path / "carved"
    assert main(["fit", str(config), "--init-from", str(initial), "--out", str(run)]) == 0
    results = json.loads(capsys.readouterr().out)
    assert (run / "carved" / "valid.txt").read_text().splitlines() == lines[-12:]
    assert (run / "carved" / "train.txt").read_text().splitlines() == lines[:-12]
    assert results["init_from"]["oov"]["valid"]["words"] == sum(len(line.split()) for line in lines[-12:])
    saved = json.loads((run / "config.json").read_text())["data"]
    assert saved["valid"] == str(run / "carved" / "valid.txt") and saved["valid_fraction"] == 0.0

    config = adapt_config(tmp_path, domain, "both", data={"valid_fraction": 0.1})
    assert main(["fit", str(config), "--out", str(tmp_path / "y")]) == 2
    assert "data.valid_fraction = 0.1 carves the validation text from data.train" in capsys.readouterr().err
    config = adapt_config(tmp_path, domain, "all", data={"valid": "", "valid_fraction": 0.999})
    assert main(["fit", str(config), "--out", str(tmp_path / "z")]) == 2
    assert "120 lines; data.valid_fraction = 0.999 leaves no training line" in capsys.readouterr().err


def test_the_references_of_an_nbest_list_become_training_text_in_the_lms_form(tmp_path, capsys):
    from lmserve.rescoring.commands.cli import main as rescore

    listed = tmp_path / "atis.jsonl"
    entries = [
        {"id": "a", "hypotheses": [{"text": "show me flights"}], "references": ["show me flights to boston's, please"]},
        {"id": "b", "hypotheses": [{"text": "no reference here"}]},
        {"id": "c", "hypotheses": [{"text": "dashes"}], "references": ["--"]},
        {"id": "d", "hypotheses": [{"text": "fare"}], "references": ["what's the fare"]},
    ]
    listed.write_text("".join(json.dumps(e) + "\n" for e in entries))
    out = tmp_path / "atis.txt"
    assert rescore(["references", str(listed), "--out", str(out), "--normalize", "librispeech"]) == 0
    assert out.read_text() == "SHOW ME FLIGHTS TO BOSTON'S PLEASE\nWHAT'S THE FARE\n"
    err = capsys.readouterr().err
    assert "2 references of 4 entries, normalised librispeech (1 entries without one, 1 empty after normalising" in err

    listed.write_text(json.dumps(entries[1]) + "\n")
    assert rescore(["references", str(listed), "--out", str(out)]) == 2
    assert "atis.jsonl: none of its 1 entries has a reference" in capsys.readouterr().err


def test_a_damaged_or_other_shaped_checkpoint_or_a_file_is_one_error_and_leaves_no_run(
    initial, domain, tmp_path, capsys
):
    """Each a line naming --init-from and the file, exit 2, before a run folder exists (a traceback from loading the
    weights used to leave half a run behind)."""
    source = initial / "checkpoints" / best_checkpoint(initial)
    config = adapt_config(tmp_path, domain)
    run = tmp_path / "adapted"

    def damaged(name: str, change) -> Path:
        ckpt = tmp_path / name
        shutil.copytree(source, ckpt)
        change(ckpt)
        return ckpt

    def cut(path: Path) -> None:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

    def wider(ckpt: Path) -> None:
        record = json.loads((ckpt / "config.json").read_text())
        record["model"]["hidden_size"] *= 2
        (ckpt / "config.json").write_text(json.dumps(record))

    def fewer_words(ckpt: Path) -> None:
        lines = (ckpt / "vocab.tsv").read_text().splitlines()
        (ckpt / "vocab.tsv").write_text("\n".join(lines[:-1]) + "\n")

    file = tmp_path / "model.safetensors"
    shutil.copyfile(source / "model.safetensors", file)
    for given, expected in (
        (file, f"--init-from {file}: a file; expected a checkpoint folder"),
        (damaged("cut", lambda c: cut(c / "model.safetensors")), "model.safetensors: cannot be read"),
        (damaged("wider", wider), "model.safetensors: weights of another shape than config.json's model"),
        (damaged("fewer", fewer_words), "model.safetensors: weights of another shape than config.json's model"),
        (damaged("garbled", lambda c: (c / "config.json").write_text("{")), "config.json: not a checkpoint's config"),
        (damaged("no_vocabulary", lambda c: (c / "vocab.tsv").unlink()), "has no vocab.tsv"),
    ):
        capsys.readouterr()
        assert main(["fit", str(config), "--init-from", str(given), "--out", str(run)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"lm-train: error: --init-from {given}") and err.count("\n") == 1, err
        assert expected in err, err
        assert not run.exists()
