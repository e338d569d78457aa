"""The release bundles under ``models/``: a fresh clone scores with them, no training; each is at most 32 MiB, loads with
every checksum verified, and is described in models/README.md by the sha256 of its manifest and its held-out
perplexity, so that the description cannot drift from the files."""

import hashlib
import math
from pathlib import Path

import pytest

from lmserve.core.bundle import Bundle
from lmserve.rescoring.commands.cli import main as rescore_main

MODELS = Path(__file__).resolve().parents[1] / "models"
FOLDERS = sorted(p.parent for p in MODELS.glob("*/manifest.json"))
MAX_BYTES = 32 << 20


def test_there_are_shipped_models():
    assert FOLDERS, f"no bundle under {MODELS}"


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.name)
def test_a_shipped_model_is_small_verified_and_described(folder):
    bundle = Bundle.load(folder)  # raises on any file whose sha256 differs from the manifest's
    assert sum(p.stat().st_size for p in folder.iterdir() if p.is_file()) <= MAX_BYTES
    readme = (MODELS / "README.md").read_text(encoding="utf-8")
    digest = hashlib.sha256((folder / "manifest.json").read_bytes()).hexdigest()
    assert digest in readme, f"models/README.md does not give {folder.name}'s manifest sha256 {digest}"
    ppl = bundle.manifest["heldout"]["ppl"]
    assert f"{ppl:.1f}" in readme, f"models/README.md does not give {folder.name}'s held-out perplexity {ppl:.1f}"


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.name)
def test_a_shipped_model_scores_sentences(folder, capsys, monkeypatch, tmp_path):
    text = tmp_path / "in.txt"
    # each pair in one of the shipped text forms: LibriSpeech's (upper case, the ASR models) and as written (mt_lm)
    text.write_text("I THINK THAT IS RIGHT\nRIGHT IS THAT THINK I\nI think that is right.\nright. is that think I\n")
    assert rescore_main(["score", "--lm", str(folder), "--input", str(text), "--threads", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    scores = [float(line.split("\t")[0]) for line in lines]
    assert len(scores) == 4 and all(math.isfinite(s) for s in scores)
    # an English model prefers English word order by far, in the form it was trained on
    assert max(scores[0] - scores[1], scores[2] - scores[3]) > 5, scores
