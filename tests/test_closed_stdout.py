"""A command whose stdout's reader went away (``lm-rescore ngram query … | head -1``) ends quietly with exit 141, as
shell tools do, instead of a traceback (or a second one when the interpreter flushes stdout on the way out)."""

import os
import subprocess
import sys

import pytest
from test_gutenberg import fake_books, write_corpus

pytestmark = pytest.mark.slow  # lm-rescore and lm-train in processes of their own

ARPA = """\\data\\
ngram 1=4
ngram 2=1

\\1-grams:
-1.0\t<unk>\t0
-99\t<s>\t0
-0.5\t</s>\t0
-0.5\tA\t0

\\2-grams:
-0.3\t<s> A

\\end\\
"""


def run_into_a_closed_pipe(command: list[str], stdin: str = "") -> subprocess.CompletedProcess:
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the command writes a byte: every write fails
    try:
        return subprocess.run(command, input=stdin, stdout=write, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)


def test_lm_rescore_ends_quietly_when_its_reader_is_gone(tmp_path):
    (tmp_path / "tiny.arpa").write_text(ARPA)
    command = [
        sys.executable,
        "-m",
        "lmserve.rescoring.commands.cli",
        "ngram",
        "query",
        "--lm",
        str(tmp_path / "tiny.arpa"),
    ]
    done = run_into_a_closed_pipe(command, "A A\n" * 50_000)
    assert done.returncode == 141
    assert "lm-rescore" not in done.stderr and "Traceback" not in done.stderr  # (KenLM's own loading note is there)


def test_lm_train_ends_quietly_when_its_reader_is_gone(tmp_path):
    write_corpus(tmp_path / "books", fake_books())
    command = [sys.executable, "-m", "lmserve.training.cli", "prepare-gutenberg", "--data", str(tmp_path / "books")]
    done = run_into_a_closed_pipe([*command, "--out", str(tmp_path / "out"), "--valid-books", "1", "--test-books", "1"])
    assert (done.returncode, done.stderr) == (141, "")
    assert (tmp_path / "out" / "prepare.json").is_file()  # the work itself was done and kept
