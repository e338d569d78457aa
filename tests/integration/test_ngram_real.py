"""The n-gram side on real data: the Joshua bn-en 5-gram reproduces the decoder's own lm_0 feature."""

import math
import subprocess

import pytest

from lmserve.rescoring.ngram import NgramLM, find_program

pytestmark = pytest.mark.integration


def read_kbest(path) -> list[tuple[str, list[str], float]]:
    """(sentence id, hypothesis words, lm_0) per line of a Joshua k-best list."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            fields = line.rstrip("\n").split(" ||| ")
            features = dict(kv.split("=", 1) for kv in fields[2].split())
            if "lm_0" not in features:
                raise ValueError(f"{path}:{lineno}: no lm_0 feature")
            rows.append((fields[0], fields[1].split(), float(features["lm_0"])))
    return rows


def test_joshua_lm_0_is_our_log10_score(shared_data, tmp_path):
    folder = shared_data / "joshua-bn-en"
    rows = read_kbest(folder / "output.gold")
    lm = NgramLM(folder / "lm.gz")
    assert lm.order == 5
    first = {}
    for sid, words, lm_0 in rows:
        first.setdefault(sid, (words, lm_0))
    assert len(first) == 100
    # lm_0 is printed with 3 decimals; untranslated Bengali words are OOVs, scored as <unk> by both
    assert sum(lm.oov(words) for words, _ in first.values()) > 0
    for words, lm_0 in first.values():
        assert lm.score(words) / math.log(10) == pytest.approx(lm_0, abs=1e-3)
    assert max(abs(lm.score(words) / math.log(10) - lm_0) for _, words, lm_0 in rows) < 1e-3

    binary = tmp_path / "lm.bin"  # the same model through build_binary (which reads the gzipped ARPA)
    subprocess.run([str(find_program("build_binary")), str(folder / "lm.gz"), str(binary)], check=True)
    lm_bin = NgramLM(binary)
    for words, _ in first.values():
        assert lm_bin.score(words) == pytest.approx(lm.score(words), abs=1e-4)
