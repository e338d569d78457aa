"""N-best lists drawn by hypothesis, for every reader and writer.

- **Round trips.** :func:`general_lists` draws lists of any shape (ids, texts of Unicode words, three numeric
  features ``f0``-``f2``, references, sources); :func:`as_format` turns one into what a format holds (its feature
  names, its id and reference rules: what its writer writes and its reader gives back), so that the same drawn lists
  feed every format and each must come back from a write and a read unchanged.
- **Malformed files.** A valid list in each format (:func:`seed_files`, the fixed :data:`SAMPLE` as the format holds
  it), then one file of it cut short, a byte changed, or a token replaced by one of another type. What a reader must
  do with each (:func:`check`): a clean error that names the file, or a list that round-trips through its writer;
  never a traceback, never a partial output.

Used by tests/test_nbest_fuzz.py, tests/test_words.py and tests/test_bad_inputs.py."""

from __future__ import annotations

import re
import shutil
import tarfile
from pathlib import Path

from hypothesis import strategies as st

from lmserve.rescoring.nbest import Hypothesis, NBestEntry, NBestList, read_nbest, write_nbest

FEATURES = {  # the features each format holds, for f0, f1, f2 of a general list (WMT: votes and sys_* indicators)
    "jsonl": ("lm", "am"),
    "espnet": ("score", "decoder", "ctc"),
    "hyporadise": ("score",),
    "moses": ("lm_0", "tm_pt_0", "total"),
    "kaldi": ("ac_cost", "lm_cost"),
    "srilm": ("acoustic", "lm", "num_words"),
    "fairseq": ("score",),
    "wmt": (),
}
CASES = [*FEATURES, "espnet.tar.gz"]  # the ESPnet dump also as the tarball it is shipped in
FILE_NAMES = {"jsonl": "list.jsonl", "hyporadise": "list.json", "moses": "list.kbest", "fairseq": "list.fairseq"}
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


SAMPLE = NBestList(
    [
        NBestEntry(
            f"utt-{i}",
            [
                Hypothesis(text, {f"f{f}": round(-(i + 1.5) * (rank + f / 7), 4) for f in range(3)}, rank)
                for rank, text in enumerate(["the cat sat", "the cat", ""], 1)
            ],
            [f"the cat sat {i}"],
        )
        for i in range(3)
    ]
)  # three entries of three hypotheses (one empty), one reference each: the valid list that the fuzzing mutates


def as_format(general: NBestList, format: str) -> NBestList:
    """``general`` (features ``f0``-``f2``) as ``format`` holds it (each format's module docstring): its features
    (SRILM's ``num_words`` the words; WMT's the systems' votes and indicators, one system per rank), ids where it keeps
    them (else positions; SRILM's entries in file-name order), references (ESPnet, Kaldi, HyPoradise, fairseq: one for
    every entry or none; WMT: as many for every entry; Moses, SRILM: none), sources (JSONL, fairseq; WMT: all or none)
    and hypotheses (ESPnet, WMT: as many for every entry)."""
    size = min(len(e.hypotheses) for e in general) if format in ("espnet", "wmt") else None
    one_reference = all(e.references for e in general)
    references = min(len(e.references) for e in general)
    sources = all(e.source is not None for e in general)
    entries = []
    for i, entry in enumerate(general):
        hyps = []
        for rank, hyp in enumerate(entry.hypotheses[:size], 1):
            if format == "wmt":
                features = {"votes": 1.0, **{f"sys_rank{k}": float(k == rank) for k in range(1, (size or 0) + 1)}}
            else:
                features = {name: hyp.features[f"f{f}"] for f, name in enumerate(FEATURES[format])}
            if format == "srilm":
                features["num_words"] = float(len(hyp.text.split()))
            hyps.append(Hypothesis(hyp.text, features, rank))
        refs = {"jsonl": entry.references, "wmt": entry.references[:references], "moses": [], "srilm": []}.get(
            format, entry.references[:1] if one_reference else []
        )
        source = entry.source if format in ("jsonl", "fairseq") or (format == "wmt" and sources) else None
        entries.append(NBestEntry(str(i) if format in ("moses", "fairseq", "wmt") else entry.id, hyps, refs, source))
    if format == "srilm":
        entries.sort(key=lambda e: f"{e.id}.score")
    return NBestList(entries)


WORD = st.text(st.characters(categories=["L", "N"]), min_size=1, max_size=6)  # letters and digits of any script
TEXT = st.lists(WORD, min_size=1, max_size=6).map(" ".join)


@st.composite
def general_lists(draw) -> NBestList:
    """1-4 entries of 1-4 distinct hypotheses (one may be empty), features f0-f2 of any finite value, 0-2 references,
    a source or none, ids of letters, digits, '_' and '-'."""
    ids = draw(
        st.lists(st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,7}", fullmatch=True), min_size=1, max_size=4, unique=True)
    )
    number = st.floats(allow_nan=False, allow_infinity=False)
    entries = []
    for entry_id in ids:
        texts = draw(st.lists(st.one_of(TEXT, st.just("")), min_size=1, max_size=4, unique=True))
        hyps = [Hypothesis(text, {f"f{f}": draw(number) for f in range(3)}, rank) for rank, text in enumerate(texts, 1)]
        refs = draw(st.lists(TEXT, max_size=2))
        entries.append(NBestEntry(entry_id, hyps, refs, draw(st.one_of(st.none(), TEXT))))
    return NBestList(entries)


SPACES = {
    "tab": "\t",
    "two spaces": "  ",
    "no-break space": "\u00a0",
    "ideographic space": "\u3000",
    "mixed": " \t\u00a0",
}
NO_TABS = ("fairseq",)  # tab-separated fields: a tab cannot be inside a text
NO_REFERENCES = ("moses", "srilm")  # their references come from a file (``references=``, ``--references``)


def respaced(space: str, swap: bool = False) -> NBestList:
    """Three entries whose first hypothesis has the words of its reference, separated by ``space`` (``swap``: the
    reference's are), and is best by every feature; the second hypothesis is a word short. A general list: every
    format's reader must give a first hypothesis of no word errors (``core.words``)."""
    entries = []
    for i in range(3):
        plain = f"the cat sat on mat{i}"
        odd = space.join(plain.split())
        hyp, ref = (plain, odd) if swap else (odd, plain)
        hyps = [
            Hypothesis(text, {f"f{f}": -float(rank) for f in range(3)}, rank)
            for rank, text in enumerate([hyp, f"the cat sat mat{i}"], 1)
        ]
        entries.append(NBestEntry(f"u{i}", hyps, [ref]))
    return NBestList(entries)


def write_references(general: NBestList, path: Path) -> Path:
    """The first reference of each entry, one a line: for the formats that hold none."""
    path.write_text("".join(entry.references[0] + "\n" for entry in general), encoding="utf-8")
    return path


def seed_files(case: str, root: Path) -> Path:
    """Write the valid list of ``case`` under ``root``; returns the path a reader is given."""
    format = case.split(".")[0]
    path = root / FILE_NAMES.get(format, "dump")
    write_nbest(as_format(SAMPLE, format), path, format)
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
    assert content(again) == content(nbest), "the list read back differs from the list written"
    assert not [f for f in out_root.rglob("*") if f.name.endswith(".tmp")], "temporary files left"
    return "round trip"


def content(nbest: NBestList) -> list:
    """What a round trip keeps (ranks: the writers of some formats renumber them)."""
    return [(e.id, [(h.text, h.features) for h in e.hypotheses], e.references, e.source) for e in nbest]
