"""``lm-train fit --init-from BUNDLE``: a shipped model bundle continued on in-domain text (training/from_bundle.py).

The bundle's weights, rebuilt from its ONNX graphs, must be the checkpoint's: exactly with fp32 storage, within the
rounding of fp16 storage; what cannot be rebuilt (another head, a damaged bundle) is one line, exit 2, and no run."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import tiny_config_text, write_corpus, write_splits
from safetensors.numpy import load_file

from lmserve.training.cli import main
from lmserve.training.from_bundle import load_bundle_model

NEW_WORD = "boston"  # a word of the in-domain text that the general model never saw


@pytest.fixture(scope="module", params=["full", "adaptive"])
def trained(request, tmp_path_factory) -> dict[str, Path]:
    """A tiny model trained two epochs in sentence mode, and its bundles with fp32 and fp16 weights."""
    head = request.param
    root = tmp_path_factory.mktemp(head)
    config = root / "general.toml"
    config.write_text(tiny_config_text(write_splits(root), "sentence", head, train={"epochs": 2}))
    run = root / "run"
    assert main(["fit", str(config), "--out", str(run)]) == 0
    made = {"head": head, "run": run}
    for storage in ("fp32", "fp16"):
        made[storage] = root / f"{head}.{storage}"
        assert main(["export", "--checkpoint", str(run), "--out", str(made[storage]), "--weights", storage]) == 0
    return made


@pytest.fixture(scope="module")
def domain(tmp_path_factory) -> dict[str, Path]:
    """In-domain train/valid/test text: a few phrasings over the general words, one with a word new to the model."""
    root = tmp_path_factory.mktemp("domain")
    phrasings = ["w5 w9 w5 w9 w2", "w9 w5 w2", f"w7 w5 {NEW_WORD} w9", "w2 w7 w7 w5 w9"]
    files = {}
    for name, n, seed in (("train", 120, 1), ("valid", 30, 2), ("test", 30, 3)):
        picks = np.random.default_rng(seed).integers(len(phrasings), size=n)
        files[name] = write_corpus(root / f"{name}.txt", [phrasings[i] for i in picks])
    return files


def adapt(trained, domain, tmp_path: Path, init_from: Path, epochs: int, name: str) -> dict:
    """``lm-train fit --init-from`` for ``epochs`` epochs on the in-domain text; its results.json."""
    config = tmp_path / f"{name}.toml"
    config.write_text(tiny_config_text(domain, "sentence", trained["head"], train={"epochs": epochs}))
    run = tmp_path / name
    assert main(["fit", str(config), "--init-from", str(init_from), "--out", str(run)]) == 0
    results = json.loads((run / "results.json").read_text())
    results["run"] = run
    return results


def initial_weights(run: Path) -> dict[str, np.ndarray]:
    """The weights a run started from: its first checkpoint, saved before any update."""
    return load_file(str(run / "checkpoints" / "ckpt-000-000000" / "model.safetensors"))


def test_a_bundle_starts_training_where_its_checkpoint_would(trained, domain, tmp_path, capsys):
    from_checkpoint = adapt(trained, domain, tmp_path, trained["run"], 0, "from_checkpoint")
    expected = from_checkpoint["init_from"]["valid_ppl"]
    capsys.readouterr()

    # fp32 storage: the very weights of the checkpoint, so the very perplexity
    bundle = trained["fp32"]
    from_fp32 = adapt(trained, domain, tmp_path, bundle, 0, "from_fp32")
    err = capsys.readouterr().err
    assert from_fp32["init_from"]["valid_ppl"] == pytest.approx(expected, rel=1e-4)
    assert from_fp32["init_from"]["bundle"] == str(bundle) and "checkpoint" not in from_fp32["init_from"]
    assert f"init from {bundle}: its vocabulary of" in err
    assert from_fp32["init_from"]["oov"] == from_checkpoint["init_from"]["oov"]
    assert from_fp32["init_from"]["oov"]["train"]["oov"] > 0  # the new word, as <unk>
    ckpt_weights, fp32_weights = initial_weights(from_checkpoint["run"]), initial_weights(from_fp32["run"])
    assert fp32_weights.keys() == ckpt_weights.keys()
    for name, value in ckpt_weights.items():
        np.testing.assert_array_equal(fp32_weights[name], value, err_msg=name)
    config = json.loads((from_fp32["run"] / "config.json").read_text())
    general = json.loads((from_checkpoint["run"] / "config.json").read_text())
    assert {s: config[s] for s in ("model", "head", "vocab")} == {s: general[s] for s in ("model", "head", "vocab")}

    # fp16 storage: the checkpoint's weights rounded to half precision, then trained on for an epoch
    from_fp16 = adapt(trained, domain, tmp_path, trained["fp16"], 1, "from_fp16")
    initial = from_fp16["init_from"]["valid_ppl"]
    assert initial == pytest.approx(expected, rel=0.01)
    fp16_weights = {k: v.numpy() for k, v in load_bundle_model(trained["fp16"])[2].state_dict().items()}
    for name, value in ckpt_weights.items():
        assert np.abs(fp16_weights[name] - value).max() <= 1e-3 * max(1.0, np.abs(value).max()), name
    assert any((fp16_weights[name] != value).any() for name, value in ckpt_weights.items())  # rounded, not copied
    assert from_fp16["epochs"] == 1 and from_fp16["valid"]["ppl"] < initial


def rewritten(bundle: Path, to: Path, change) -> Path:
    """A copy of ``bundle`` whose manifest ``change`` edited."""
    shutil.copytree(bundle, to)
    manifest = json.loads((to / "manifest.json").read_text())
    change(manifest)
    (to / "manifest.json").write_text(json.dumps(manifest))
    return to


@pytest.mark.parametrize("trained", ["full"], indirect=True)  # the full head's bundles stand for both
def test_what_cannot_be_rebuilt_is_one_error_and_no_run(trained, domain, tmp_path, capsys):
    bundle = trained["fp16"]
    words = json.loads((bundle / "manifest.json").read_text())["vocab"]["size"]

    def head(manifest):
        manifest["head"] = manifest["training"]["config"]["head"]["type"] = "class"

    def quantized(manifest):
        manifest["quantization"] = "int8-dynamic"

    def narrower(manifest):  # a config whose embedding is narrower than the graphs' matrix
        manifest["model"]["embedding_size"] = manifest["training"]["config"]["model"]["embedding_size"] = 8

    def projected(manifest):  # a config with a projection the graphs do not have
        manifest["model"]["projection_size"] = manifest["training"]["config"]["model"]["projection_size"] = 16

    def cut(path: Path) -> Path:
        shutil.copytree(bundle, path)
        weights = path / "weights.bin"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        return path

    def garbled(path: Path) -> Path:
        shutil.copytree(bundle, path)
        (path / "manifest.json").write_text("{")
        return path

    cases = [
        (rewritten(bundle, tmp_path / "class", head), "a bundle with a 'class' head; training can start from"),
        (rewritten(bundle, tmp_path / "int8", quantized), "a bundle of dynamically quantised graphs (int8-dynamic"),
        (
            rewritten(bundle, tmp_path / "narrow", narrower),
            f"parameter embedding.weight is [{words}, 16] in sentences.onnx, but the model built from training.config "
            f"has [{words}, 8]",
        ),
        (
            rewritten(bundle, tmp_path / "projected", projected),
            "parameter projection.weight (16x16) is in none of the bundle's graphs",
        ),
        (cut(tmp_path / "cut"), "weights.bin: sha256 does not match manifest.json 'files' (damaged or replaced)"),
        (garbled(tmp_path / "garbled"), "manifest.json:1:2: not valid JSON"),
    ]
    config = tmp_path / "adapt.toml"
    config.write_text(tiny_config_text(domain, "sentence", "full", train={"epochs": 1}))
    run = tmp_path / "run"
    for given, expected in cases:
        capsys.readouterr()
        assert main(["fit", str(config), "--init-from", str(given), "--out", str(run)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"lm-train: error: --init-from {given}: ") and err.count("\n") == 1, err
        assert expected in err, err
        assert not run.exists()
