"""lm-rescore and lm-train with bad offline input -> rescore_robustness.json

    python -m benchmarks.rescore_robustness

Counts, over every list format at once, the cases of tests/test_bad_inputs.py: lists and references with a UTF-8
byte-order mark (``bom_wrong_results``), a WMT system file that is a broken link or a folder
(``dropped_system_files``), ``lm-train fit --init-from`` a bad checkpoint (``initfrom_tracebacks``, run folders left),
and other bad input that must end in one line naming the file or flag, exit 2, inputs unchanged and no output
(``bad_input_failures``); every target is 0. Figures: docs/benchmarks/robustness.md.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from benchmarks.common import write_result
from lmserve.rescoring.nbest import FORMATS, Hypothesis, NBestEntry, NBestList, read_nbest, write_nbest
from lmserve.training.cli import main as train_main
from tests import output_clashes
from tests.conftest import make_sentences, tiny_config_text, write_splits
from tests.nbest_fuzz import content as list_content
from tests.nbest_fuzz import seed_files

BOM = "\ufeff".encode()


def files_of(root: Path) -> dict[str, bytes]:
    """Every file and link under ``root`` (a link as where it points): what a refused command leaves as it was."""
    return {
        str(p.relative_to(root)): os.readlink(p).encode() if p.is_symlink() else p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_symlink() or p.is_file()
    }


def refusal(argv: list[str], root: Path, *named: str) -> str | None:
    """Run ``argv`` (``lm-rescore`` or ``lm-train``) in this process in ``root``: None when it ended in one line on
    stderr naming each of ``named``, exit 2, ``root`` as it was; else what went wrong."""
    before, here, err = files_of(root), Path.cwd(), io.StringIO()
    os.chdir(root)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = output_clashes.PROGRAMS[argv[0]](argv[1:])
            except SystemExit as e:
                code = e.code
            except Exception as e:  # a traceback
                return f"traceback: {type(e).__name__}: {e}"[:300]
    finally:
        os.chdir(here)
    message = err.getvalue()
    problems = [f"exit {code}"] if code != 2 else []
    problems += ["not one line"] if message.count("\n") != 1 else []
    problems += ["internal error"] if "internal error" in message else []
    problems += [f"an error line of {len(message):,} characters"] if len(message) > 1000 else []
    problems += [f"does not name {text!r}" for text in named if text not in message]
    problems += ["files changed"] if files_of(root) != before else []
    return f"{' '.join(argv)}: {', '.join(problems)}: {message.strip()}"[:300] if problems else None


def bom_cases() -> dict:
    """Every format's list with a byte-order mark before the text of each of its files, and a references file with
    one, read against the same without it."""
    cases = wrong = 0
    failures = []
    for format in FORMATS:
        for where in ("list", "references"):
            cases += 1
            with tempfile.TemporaryDirectory() as tmp:
                root = Path(tmp)
                plain, marked = seed_files(format, root / "plain"), seed_files(format, root / "marked")
                refs = {}
                if where == "references":
                    lines = [f"w{i} reference" for i in range(len(read_nbest(plain, format)))]
                    for name, data in (("plain", b""), ("marked", BOM)):
                        refs[name] = root / f"{name}.refs.txt"
                        refs[name].write_bytes(data + ("\n".join(lines) + "\n").encode())
                else:
                    for file in [marked] if marked.is_file() else sorted(f for f in marked.rglob("*") if f.is_file()):
                        file.write_bytes(BOM + file.read_bytes())
                try:
                    with_mark = list_content(read_nbest(marked, format, refs.get("marked")))
                    same = with_mark == list_content(read_nbest(plain, format, refs.get("plain")))
                    problem = None if same else "another list than without the mark"
                except Exception as e:
                    problem = f"{type(e).__name__}: {e}"
            if problem:
                wrong += 1
                failures.append(f"{format}, mark in the {where}: {problem}"[:300])
    return {"cases": cases, "wrong_results": wrong, "failures": failures[:5]}


def dropped_systems() -> dict:
    """A WMT folder of four systems, one of whose files is not a file: read, it must be an error naming that file."""
    kinds = ("broken link", "folder", "link to a folder")
    dropped = 0
    failures = []
    for kind in kinds:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp) / "t.zh-en"
            folder.mkdir()
            for name in "abc":
                (folder / f"t.zh-en.hyp.{name}.en").write_text("the cat sat\nthe dog ran\n")
            odd = folder / "t.zh-en.hyp.d.en"
            if kind == "folder":
                odd.mkdir()
            else:
                (Path(tmp) / "elsewhere").mkdir()
                odd.symlink_to(Path(tmp) / ("gone.en" if kind == "broken link" else "elsewhere"))
            try:
                nbest = read_nbest(folder)
            except ValueError as e:
                if odd.name not in str(e):
                    failures.append(f"{kind}: the error does not name {odd.name}: {e}"[:300])
                continue
            dropped += 1
            failures.append(f"{kind}: read from {len(nbest.feature_names()) - 1} systems, {odd.name} dropped")
    return {"cases": len(kinds), "dropped": dropped, "failures": failures}


def initfrom_cases() -> dict:
    """``lm-train fit --init-from`` a file, and checkpoints of a tiny run made bad in one way each: one line naming
    --init-from, exit 2, no run folder left."""
    tracebacks = partial = 0
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "text").mkdir()
        corpus = write_splits(root / "text")
        config = root / "tiny.toml"
        config.write_text(tiny_config_text(corpus, "sentence", "full", train={"epochs": 1}))
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            assert train_main(["fit", str(config), "--out", str(root / "run")]) == 0
        source = root / "run" / "checkpoints" / (root / "run" / "checkpoints" / "best").read_text().strip()

        def cut(ckpt: Path) -> None:
            weights = ckpt / "model.safetensors"
            weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])

        def wider(ckpt: Path) -> None:
            record = json.loads((ckpt / "config.json").read_text())
            record["model"]["hidden_size"] *= 2
            (ckpt / "config.json").write_text(json.dumps(record))

        def fewer_words(ckpt: Path) -> None:
            lines = (ckpt / "vocab.tsv").read_text().splitlines()
            (ckpt / "vocab.tsv").write_text("\n".join(lines[:-1]) + "\n")

        changes = {
            "cut": cut,
            "wider": wider,
            "fewer words": fewer_words,
            "garbled config": lambda c: (c / "config.json").write_text("{"),
            "no vocabulary": lambda c: (c / "vocab.tsv").unlink(),
        }
        given = {"a file": source / "model.safetensors"}
        for name, change in changes.items():
            given[name] = root / "bad" / name.replace(" ", "_")
            shutil.copytree(source, given[name])
            change(given[name])
        for name, path in given.items():
            run = root / "adapted"
            argv = ["lm-train", "fit", str(config), "--init-from", str(path), "--out", str(run)]
            failure = refusal(argv, root, "--init-from")
            tracebacks += bool(failure and failure.startswith("traceback"))
            partial += run.exists()
            shutil.rmtree(run, ignore_errors=True)
            if failure:
                failures.append(f"{name}: {failure}"[:300])
    return {"cases": len(given), "tracebacks": tracebacks, "partial_runs": partial, "failures": failures[:5]}


def bad_input_cases() -> dict:
    """The other offline bad input of lm-rescore, each a command line that must be refused (``refusal``)."""
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        lines = make_sentences(600, seed=4)
        (root / "low.txt").write_text("\n".join(lines) + "\n")
        (root / "up.txt").write_text("\n".join(lines).upper() + "\n")
        (root / "held.txt").write_text("\n".join(make_sentences(60, seed=5)) + "\n")
        packed = gzip.compress((root / "low.txt").read_bytes())
        (root / "cut.txt.gz").write_bytes(packed[: len(packed) // 2])
        (root / "fake.txt.gz").write_text("w1 w2\n")
        for name in ("low", "up"):
            argv = ["ngram", "build", "--order", "3", "--text", f"{name}.txt", "--out", name, "--discount-fallback"]
            assert output_clashes.run_case(["lm-rescore", *argv], root)[0] == 0
        (root / "up.text.json").unlink(missing_ok=True)  # a model built elsewhere: no record of its text form
        long = [s for s in lines if len(s.split()) >= 3][:30]
        entries = [NBestEntry(f"u{i}", [Hypothesis(s, {"am": -1.0})], [s]) for i, s in enumerate(long)]
        write_nbest(NBestList(entries), root / "l.jsonl", "jsonl")
        write_nbest(NBestList([NBestEntry(e.id, e.hypotheses) for e in entries]), root / "norefs.jsonl", "jsonl")
        third = [
            NBestEntry(e.id, [Hypothesis(h.text.upper(), h.features) for h in e.hypotheses], e.references)
            if i % 3 == 0
            else e
            for i, e in enumerate(entries)
        ]
        write_nbest(NBestList(third), root / "third.jsonl", "jsonl")
        big = "u" * 16384
        (root / "big.jsonl").write_text(
            "".join(json.dumps({"id": big, "hypotheses": [{"text": "a", "features": {}}]}) + "\n" for _ in range(2))
        )
        mix = ["lm-rescore", "ngram", "mix", "--out", "mix.json"]
        overlap = ["lm-rescore", "overlap", "--json", "o.json"]
        tune = ["lm-rescore", "tune", "--metric", "wer", "--out", "w.json"]
        build = ["lm-rescore", "ngram", "build", "--order", "2", "--out", "m", "--discount-fallback"]
        cases = [
            ([*build, "--text", "cut.txt.gz"], ["--text cut.txt.gz", "cut short"]),
            ([*build, "--text", "fake.txt.gz"], ["--text fake.txt.gz", "not gzip"]),
            ([*overlap, "--text", "cut.txt.gz", "--references", "held.txt"], ["cut.txt.gz"]),
            ([*overlap, "--text", "low.txt", "--list", "norefs.jsonl"], ["--list"]),
            ([*overlap, "--text", "low.txt", "--references", "cut.txt.gz"], ["cut.txt.gz"]),
            ([*mix, "--ngram", "low.bin,up.bin", "--heldout", "held.txt"], ["--ngram up.bin"]),
            ([*mix, "--ngram", "low.bin,low.arpa", "--heldout", "held.txt", "--normalize", "lower"], ["--heldout"]),
            ([*mix, "--ngram", "low.bin,low.arpa", "--heldout", "low.bin"], ["--heldout low.bin"]),
            ([*tune, "third.jsonl", "--ngram", "low.bin", "--features", "am,ngram"], ["third.jsonl", "10 of its"]),
            (["lm-rescore", "references", "big.jsonl", "--out", "r.txt"], ["(16,384 chars)"]),
        ]
        for argv, named in cases:
            if failure := refusal(argv, root, *named):
                failures.append(failure)
    return {"cases": len(cases), "failures_count": len(failures), "failures": failures[:5]}


def main() -> None:
    offline = {"bom": bom_cases(), "dropped_systems": dropped_systems(), "init_from": initfrom_cases()}
    offline["other"] = bad_input_cases()
    print(f"offline bad input: {offline}", file=sys.stderr)
    metrics = {
        "bom_cases": offline["bom"]["cases"],
        "bom_wrong_results": offline["bom"]["wrong_results"],
        "dropped_system_cases": offline["dropped_systems"]["cases"],
        "dropped_system_files": offline["dropped_systems"]["dropped"],
        "initfrom_cases": offline["init_from"]["cases"],
        "initfrom_tracebacks": offline["init_from"]["tracebacks"],
        "initfrom_partial_runs": offline["init_from"]["partial_runs"],
        "bad_input_cases": offline["other"]["cases"],
        "bad_input_failures": offline["other"]["failures_count"],
    }
    write_result("rescore_robustness", metrics, offline_bad_input=offline)


if __name__ == "__main__":
    main()
