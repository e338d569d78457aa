"""Malformed n-best files for every reader, drawn by hypothesis: a valid list in each format (as its writer writes it),
then one file of it cut short, a byte changed, or a token replaced by one of another type. What a reader must do with
each (``check``): a clean error that names the file, or a list that round-trips through its writer; never a
traceback, never a partial output. Used by tests/test_nbest_fuzz.py (a few cases) and
benchmarks/rescore_robustness.py (thousands)."""

from __future__ import annotations

import re
import shutil
import tarfile
from pathlib import Path

from hypothesis import strategies as st

from lmserve.rescoring.nbest import Hypothesis, NBestEntry, NBestList, read_nbest, write_nbest

FEATURES = {  # what each format holds
    "jsonl": ("lm", "am"),
    "espnet": ("score", "decoder", "ctc"),
    "hyporadise": ("score",),
    "moses": ("lm_0", "tm_pt_0", "total"),
    "kaldi": ("ac_cost", "lm_cost"),
    "srilm": ("acoustic", "lm", "num_words"),
}
CASES = [*FEATURES, "espnet.tar.gz"]  # the ESPnet dump also as the tarball it is shipped in
REPLACEMENTS = [
    '"x"',
    "[]",
    "{}",
    "null",
    "true",
    "NaN",
    "Infinity",
    "-inf",
    "1e999",
    "-",
    "|||",
    "(",
    ")",
    "tensor(x)",
]
REPLACEMENTS += ["", "²", "0", '"', "\\u0000", " ", "\n", "x=1", "()", "[1, 2]", '{"a": 1}', "-1.5e3", "a b"]
TOKEN = re.compile(rb'-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?|"[^"\n]*"|[A-Za-z_]\w*|[\[\]{}()|:=]')


def sample(format: str) -> NBestList:
    """Three entries of three hypotheses (one empty), every feature of the format, one reference each where the
    format holds references."""
    entries = []
    for i in range(3):
        hyps = []
        for rank, text in enumerate(["the cat sat", "the cat", ""], 1):
            features = {name: round(-(i + 1.5) * (rank + f / 7), 4) for f, name in enumerate(FEATURES[format])}
            if format == "srilm":
                features["num_words"] = float(len(text.split()))
            hyps.append(Hypothesis(text, features, rank))
        refs = [] if format in ("moses", "srilm") else [f"the cat sat {i}"]
        entries.append(NBestEntry(str(i) if format in ("moses", "hyporadise") else f"utt-{i}", hyps, refs))
    return NBestList(entries)


def seed_files(case: str, root: Path) -> Path:
    """Write the valid list of ``case`` under ``root``; returns the path a reader is given."""
    format = case.split(".")[0]
    name = {"jsonl": "list.jsonl", "hyporadise": "list.json", "moses": "list.kbest"}.get(format, "dump")
    path = root / name
    write_nbest(sample(format), path, format)
    if case == "espnet.tar.gz":
        tarball = root / "dump.tar.gz"
        with tarfile.open(tarball, "w:gz") as tar:
            tar.add(path, arcname="dump")
        shutil.rmtree(path)
        return tarball
    return path


@st.composite
def mutations(draw) -> tuple:
    """(kind, file choice, position in [0, 1), argument): what to do to one file of a valid list."""
    kind = draw(st.sampled_from(["truncate", "flip", "retype", "retype"]))
    which = draw(st.integers(0, 1000))
    where = draw(st.floats(0, 1, exclude_max=True))
    arg = (
        draw(st.integers(0, 255)) if kind == "flip" else draw(st.sampled_from(REPLACEMENTS)) if kind == "retype" else 0
    )
    return kind, which, where, arg


def mutate(path: Path, mutation: tuple) -> str:
    """Apply ``mutation`` to one file of ``path`` (a file or a folder); returns a description."""
    kind, which, where, arg = mutation
    files = sorted(f for f in path.rglob("*") if f.is_file()) if path.is_dir() else [path]
    target = files[which % len(files)]
    data = target.read_bytes()
    if kind == "truncate":
        data = data[: int(where * len(data))]
    elif kind == "flip":
        at = int(where * len(data))
        data = data[:at] + bytes([arg]) + data[at + 1 :]
    else:
        tokens = list(TOKEN.finditer(data))
        if tokens:
            token = tokens[int(where * len(tokens))]
            data = data[: token.start()] + arg.encode() + data[token.end() :]
    target.write_bytes(data)
    return f"{kind} {target.name} at {where:.3f} ({arg!r})"


def check(case: str, path: Path, out_root: Path) -> str:
    """Read the (mutated) list at ``path``. Returns "error" (a clean error naming the file) or "round trip" (read,
    written, read back the same) or "refused" (read; its writer refused it with an error naming the output, and wrote
    nothing). Raises AssertionError for anything else: a traceback, an error that names no file, a partial output."""
    format = case.split(".")[0]
    try:
        nbest = read_nbest(path, format)
    except (ValueError, OSError) as e:
        named = path.name in str(e) or path.name in str(getattr(e, "filename", None) or "")
        assert named, f"the error names no file: {type(e).__name__}: {e}"
        return "error"
    out = out_root / path.name.replace(".tar.gz", "")
    try:
        write_nbest(nbest, out, format)
    except ValueError as e:
        assert str(out) in str(e), f"the writer's error names no file: {e}"
        leftovers = list(out_root.iterdir())
        assert not leftovers, f"partial output after a refused write: {leftovers}"
        return "refused"
    again = read_nbest(out, format)
    assert _content(again) == _content(nbest), "the list read back differs from the list written"
    assert not [f for f in out_root.rglob("*") if f.name.endswith(".tmp")], "temporary files left"
    return "round trip"


def _content(nbest: NBestList) -> list:
    return [
        (e.id, [(h.text, h.features) for h in e.hypotheses], e.references, e.source) for e in nbest
    ]  # (ranks: the writers of some formats renumber them)
