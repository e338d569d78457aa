"""Output clashes for every command that writes (``core.outputs``): the inputs they read, written into a folder,
and each pair of paths that may clash as a command line run there. Used by tests/test_outputs.py."""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path

from lmserve.rescoring.commands.cli import main as rescore_main
from lmserve.rescoring.commands.shards import fingerprint
from lmserve.rescoring.nbest import Hypothesis, NBestEntry, NBestList, write_nbest
from lmserve.server.cli import main as serve_main
from lmserve.training.cli import main as train_main

PROGRAMS = {"lm-rescore": rescore_main, "lm-train": train_main, "lm-serve": serve_main}


def small_list() -> NBestList:
    entries = [
        NBestEntry(f"u{i}", [Hypothesis(f"w{i} w1", {"am": -1.0}, 1), Hypothesis(f"w{i}", {"am": -2.0}, 2)], [f"w{i}"])
        for i in range(3)
    ]
    return NBestList(entries)


def write_inputs(tmp_path: Path) -> Path:
    """Every input the cases read, in ``tmp_path`` (the cases name them relative to it)."""
    write_nbest(small_list(), tmp_path / "l.jsonl", "jsonl")
    write_nbest(small_list(), tmp_path / "dump", "espnet")
    (tmp_path / "bundle").mkdir()
    (tmp_path / "bundle" / "manifest.json").write_text("{}")
    weights = {"format": "lmserve-weights", "format_version": 2, "features": ["am", "neural"]}
    weights |= {"weights": {"am": 1.0, "neural": 0.1}, "metric": "wer", "dev_set": "dev", "date": "-"}
    (tmp_path / "w.json").write_text(json.dumps(weights | {"setup": {"lm": "bundle", "normalize": None}}))
    for name, text in {"refs.txt": "w0\nw1\nw2\n", "t.txt": "a b\n", "a.en": "x\ny\nz\n", "b.en": "x\ny\nq\n"}.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "src.zh").write_text("1\n2\n3\n")
    for name in ("n.arpa", "m.arpa", "c1.jsonl", "c2.jsonl", "cfg.toml"):
        (tmp_path / name).write_text("x\n")
    for folder in ("run", "books"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "f.txt").write_text("x\n")
    (tmp_path / "run" / "c.toml").write_text("")  # an empty config loads
    write_nbest(small_list(), tmp_path / "s1.jsonl", "jsonl")
    shard = {"index": 1, "count": 1, "start": 0, "stop": 3, "utterances": 3, "references": 1, "stats": None}
    shard |= {"identity": {}, "output": {"path": "s1.jsonl", "format": "jsonl", **fingerprint(tmp_path / "s1.jsonl")}}
    (tmp_path / "r1.json").write_text(json.dumps({"shard": shard}))
    return tmp_path


NBEST = ["lm-rescore", "nbest", "l.jsonl", "--weights", "w.json", "--quiet"]
TUNE = ["lm-rescore", "tune", "l.jsonl", "--metric", "wer", "--features", "am", "--quiet"]
CASES = {
    "nbest --out LIST": ([*NBEST, "--out", "l.jsonl"], "--out", "LIST"),
    "nbest --out --report": ([*NBEST, "--out", "o.jsonl", "--report", "o.jsonl"], "--out", "--report"),
    "nbest --html LIST": ([*NBEST, "--out", "o.jsonl", "--html", "l.jsonl"], "--html", "LIST"),
    "nbest --out --html": ([*NBEST, "--out", "o.jsonl", "--html", "./o.jsonl"], "--out", "--html"),
    "nbest --report --html": ([*NBEST, "--out", "o.jsonl", "--report", "r", "--html", "r"], "--report", "--html"),
    "nbest --out --cache": ([*NBEST, "--out", "o.jsonl", "--cache", "o.jsonl"], "--out", "--cache"),
    "nbest --cache LIST": ([*NBEST, "--out", "o.jsonl", "--cache", "l.jsonl"], "--cache", "LIST"),
    "nbest --out --weights": ([*NBEST, "--out", "w.json"], "--out", "--weights"),
    "nbest --report --references": (
        [*NBEST, "--out", "o.jsonl", "--references", "refs.txt", "--report", "refs.txt"],
        "--report",
        "--references",
    ),
    "nbest --out in the weights' bundle": ([*NBEST, "--out", "bundle/o.jsonl"], "--out", "--weights' setup.lm"),
    "nbest --report in --lm": (
        [*NBEST, "--lm", "bundle", "--out", "o.jsonl", "--report", "bundle/r"],
        "--report",
        "--lm",
    ),
    "nbest --out folder LIST": (
        ["lm-rescore", "nbest", "dump", "--weights", "w.json", "--out", "dump", "--out-format", "espnet"],
        "--out",
        "LIST",
    ),
    "nbest --out in LIST's folder": (
        ["lm-rescore", "nbest", "dump", "--weights", "w.json", "--out", "dump/o.jsonl"],
        "--out",
        "LIST",
    ),
    "nbest --report in the --out folder": (
        [*NBEST, "--out", "o", "--out-format", "espnet", "--report", "o/r.json"],
        "--out",
        "--report",
    ),
    "nbest --out --systems": (
        ["lm-rescore", "nbest", "--systems", "a.en", "b.en", "--weights", "w.json", "--out", "b.en"]
        + ["--out-format", "jsonl"],
        "--out",
        "--systems",
    ),
    "nbest --out --source": (
        ["lm-rescore", "nbest", "--systems", "a.en", "b.en", "--source", "src.zh", "--weights", "w.json"]
        + ["--out", "src.zh", "--out-format", "jsonl"],
        "--out",
        "--source",
    ),
    "tune --out LIST": ([*TUNE, "--out", "l.jsonl"], "--out", "LIST"),
    "tune --out --html": ([*TUNE, "--out", "t.json", "--html", "t.json"], "--out", "--html"),
    "tune --out --cache": ([*TUNE, "--out", "t.json", "--cache", "t.json"], "--out", "--cache"),
    "tune --out --ngram": ([*TUNE, "--ngram", "n.arpa", "--out", "n.arpa"], "--out", "--ngram"),
    "merge --out a shard's output": (["lm-rescore", "merge", "r1.json", "--out", "s1.jsonl"], "--out", "shard 1/1"),
    "merge --out REPORT": (["lm-rescore", "merge", "r1.json", "--out", "r1.json"], "--out", "REPORT"),
    "merge --cache --caches": (
        ["lm-rescore", "merge", "--caches", "c1.jsonl", "c2.jsonl", "--cache", "c2.jsonl"],
        "--cache",
        "--caches",
    ),
    "references --out LIST": (["lm-rescore", "references", "l.jsonl", "--out", "l.jsonl"], "--out", "LIST"),
    "ngram build --out --text": (
        ["lm-rescore", "ngram", "build", "--order", "2", "--text", "n.arpa", "--out", "n"],
        "--out",
        "--text",
    ),
    "ngram mix --out --ngram": (
        ["lm-rescore", "ngram", "mix", "--ngram", "n.arpa,m.arpa", "--heldout", "t.txt", "--out", "m.arpa"],
        "--out",
        "--ngram",
    ),
    "ngram mix --out --heldout": (
        ["lm-rescore", "ngram", "mix", "--ngram", "n.arpa,m.arpa", "--heldout", "t.txt", "--out", "t.txt"],
        "--out",
        "--heldout",
    ),
    "overlap --json --list": (
        ["lm-rescore", "overlap", "--text", "t.txt", "--list", "l.jsonl", "--json", "l.jsonl"],
        "--json",
        "--list",
    ),
    "overlap --json --text": (
        ["lm-rescore", "overlap", "--text", "t.txt", "--list", "l.jsonl", "--json", "t.txt"],
        "--json",
        "--text",
    ),
    "export --out --checkpoint": (
        ["lm-train", "export", "--checkpoint", "run", "--out", "run"],
        "--out",
        "--checkpoint",
    ),
    "export --out --heldout": (
        ["lm-train", "export", "--checkpoint", "run", "--heldout", "books/f.txt", "--out", "books"],
        "--out",
        "--heldout",
    ),
    "prepare --out --train": (["lm-train", "prepare", "--train", "run/f.txt", "--out", "run"], "--out", "--train"),
    "prepare --out --vocab": (
        ["lm-train", "prepare", "--train", "t.txt", "--vocab", "books/f.txt", "--out", "books"],
        "--out",
        "--vocab",
    ),
    "prepare-gutenberg --out --data": (
        ["lm-train", "prepare-gutenberg", "--data", "books", "--out", "books/out"],
        "--out",
        "--data",
    ),
    "prepare-english --out --data": (
        ["lm-train", "prepare-english", "--data", "books", "--out", "."],
        "--out",
        "--data",
    ),
    "fit --out CONFIG": (["lm-train", "fit", "run/c.toml", "--out", "run"], "--out", "CONFIG"),
    "client rescore --out LIST": (
        ["lm-serve", "client", "rescore", "l.jsonl", "--weights", "am=1", "--out", "l.jsonl"],
        "--out",
        "LIST",
    ),
    "client rescore --out --html": (
        ["lm-serve", "client", "rescore", "l.jsonl", "--weights", "am=1", "--out", "o.jsonl", "--html", "o.jsonl"],
        "--out",
        "--html",
    ),
}


def snapshot(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes() for p in sorted(root.rglob("*"))}


def run_case(argv: list[str], root: Path) -> tuple[int, str]:
    """One case's command line, run in this process with ``root`` as the current folder: its exit status (argparse's
    included) and what it wrote on stderr."""
    here, err = Path.cwd(), io.StringIO()
    os.chdir(root)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = PROGRAMS[argv[0]](argv[1:])
            except SystemExit as e:
                code = e.code
    finally:
        os.chdir(here)
    return code, err.getvalue()
