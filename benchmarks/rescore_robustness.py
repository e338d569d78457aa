"""lm-rescore with bad input and crashes (issues 22 and 34) -> rescore_robustness.json

    python -m benchmarks.rescore_robustness [--fuzz-cases 1000] [--kills 20] [--bundle var/bundles/demo]

Six measurements:

- **Reader fuzzing.** For every n-best format (and the ESPnet tarball) ``--fuzz-cases`` malformed files drawn by
  hypothesis (tests/nbest_fuzz.py: a valid list with one file cut short, a byte changed or a token of another type):
  each must give a clean error naming the file, or a list that round-trips through its writer. Counted: tracebacks
  (any other exception), partial outputs (a refused write that left something), failed round trips.
- **kill -9.** ``lm-rescore nbest`` on the first 100 utterances of LibriSpeech dev_other (an ESPnet folder), killed
  with SIGKILL at a moment drawn uniformly over an uninterrupted run's duration, ``--kills`` times for each output kind:
  the reranked list as one file (JSONL), as a folder (ESPnet), the report, the LM score cache. After each kill every
  output must be complete or absent; after the next complete run no temporary file may be left.
- **Time to a validation error** on the whole of dev_other.tar.gz, the wall time of the command from its start: a bad
  flag (``tune --lambdas abc``), and missing references (``nbest --references`` with a line too few). Target <= 2 s:
  before any model runs.
- **Output clashes** (issue 34): every case of tests/output_clashes.py, each pair of paths of every command that writes
  that may clash (an output at an input's path, two outputs at one path, one inside the other), run in a fresh folder
  of inputs. Counted: files lost or changed (target 0), and commands that did not refuse with exit 2.
- **Word spacing** (issue 34): ``lm-rescore nbest`` with a report on a list of every format whose first hypotheses
  have the words of their references, spaced otherwise (a tab, two spaces, a no-break or an ideographic space, a mix;
  in the hypothesis or in the reference; tests/nbest_fuzz.py ``respaced``). Counted: runs whose 1-best, rescored or
  oracle WER is not 0 (target 0).
- **Offline bad input** (tests/test_bad_inputs.py has a test for each): every format's list, and a references file,
  with a UTF-8 byte-order mark before the text, read against the same without it (``bom_cases``; counted: a list
  that differs or an error, ``bom_wrong_results``, target 0); a WMT folder in which one system's file is a broken
  link, a folder or a link to a folder (counted: lists read from the other systems, ``dropped_system_files``, target
  0); ``lm-train fit --init-from`` a file, a checkpoint cut short, of other shapes (wider, fewer words), with a
  garbled config or without its vocabulary (counted: tracebacks, ``initfrom_tracebacks``, and run folders left,
  target 0); and the other bad input of lm-rescore (a ``.gz`` cut short or not gzip, the leakage guard without
  references, an n-gram of another text form or a model as ``--heldout`` to ``ngram mix``, a third of the lists in
  another text form, an id of 16 KB): each must end in one line naming the file or flag, exit 2, the inputs as they
  were and no output (``bad_input_failures``, target 0).
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import io
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from hypothesis import HealthCheck, given, settings

from benchmarks.common import DATA_DIR, ROOT, write_result
from lmserve.rescoring.nbest import FORMATS, Hypothesis, NBestEntry, NBestList, read_nbest, write_nbest
from lmserve.training.cli import main as train_main
from tests import output_clashes
from tests.conftest import make_sentences, tiny_config_text, write_splits
from tests.nbest_fuzz import (
    CASES,
    FEATURES,
    FILE_NAMES,
    NO_REFERENCES,
    NO_TABS,
    SPACES,
    as_format,
    check,
    mutate,
    mutations,
    respaced,
    seed_files,
    write_references,
)
from tests.nbest_fuzz import content as list_content

DEV_OTHER = DATA_DIR / "librispeech-nbest" / "dev_other.tar.gz"
UTTERANCES = 100  # of dev_other, for the kill runs
KINDS = ("file", "folder", "report", "cache")


def fuzz(case: str, cases: int) -> dict:
    """Outcomes of ``cases`` mutated files of one format; the first few failures are kept, with their mutation."""
    outcomes: Counter[str] = Counter()
    failures: list[str] = []

    @settings(
        max_examples=cases,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(mutation=mutations())
    def run(mutation):
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            path = seed_files(case, root / "in")
            what = mutate(path, mutation)
            (root / "out").mkdir()
            try:
                outcomes[check(case, path, root / "out")] += 1
            except AssertionError as e:
                kind = "partial_outputs" if "partial" in str(e) or "temporary" in str(e) else "no_round_trip"
                outcomes[kind] += 1
                failures.append(f"{what}: {e}"[:300])
            except Exception as e:  # a reader's (or writer's) traceback
                outcomes["tracebacks"] += 1
                failures.append(f"{what}: {type(e).__name__}: {e}"[:300])

    run()
    return {"cases": sum(outcomes.values()), **dict(outcomes), "failures": failures[:5]}


# -- kill -9 --------------------------------------------------------------------------------------------------------


def command(kind: str, work: Path, weights: Path) -> list[str]:
    out = work / "out"
    args = [
        sys.executable,
        "-m",
        "lmserve.rescoring.commands.cli",
        "nbest",
        str(work / "dev_other"),
        "--weights",
        str(weights),
    ]
    args += ["--threads", "1", "--quiet", "--cache", str(out / "dev_other.lmscores.jsonl")]
    if kind == "folder":
        return [*args, "--out", str(out / "dev_other.rescored"), "--out-format", "espnet"]
    args += ["--out", str(out / "dev_other.rescored.jsonl")]
    return [*args, "--report", str(out / "dev_other.report.json")] if kind == "report" else args


def outputs(work: Path) -> dict[str, Path]:
    out = work / "out"
    return {
        "file": out / "dev_other.rescored.jsonl",
        "folder": out / "dev_other.rescored",
        "report": out / "dev_other.report.json",
        "cache": out / "dev_other.lmscores.jsonl",
    }


def complete(kind: str, path: Path) -> bool:
    """Whether an output that exists is whole."""
    try:
        if kind in ("file", "folder"):
            nbest = read_nbest(path)
            return len(nbest) == UTTERANCES and all(len(e.hypotheses) == 30 for e in nbest)
        if kind == "report":
            return "rescored" in json.loads(path.read_text())
        lines = path.read_text().splitlines()
        return len(lines) == UTTERANCES + 1 and all(len(json.loads(x)["hypotheses"]) == 30 for x in lines[1:])
    except (ValueError, OSError, KeyError):
        return False


def temporaries(work: Path) -> list[Path]:
    return [p for p in (work / "out").rglob("*") if p.name.endswith(".tmp")]


def clear(kind: str, work: Path) -> None:
    """Remove the outputs a run of ``kind`` writes (the cache only for the cache runs: the others reuse it)."""
    for name, path in outputs(work).items():
        if name != "cache" or kind == "cache":
            subprocess.run(["rm", "-rf", str(path)], check=True)


def kill_runs(kills: int, bundle: Path, rng: random.Random) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("LMSERVE_DEBUG", None)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        subset = read_nbest(DEV_OTHER)
        write_nbest(NBestList(subset.entries[:UTTERANCES]), work / "dev_other", "espnet")
        weights = work / "w.json"
        weights.write_text(
            json.dumps(
                {
                    "format": "lmserve-weights",
                    "format_version": 2,
                    "features": ["score", "neural"],
                    "weights": {"score": 1.0, "neural": 0.3},
                    "metric": "wer",
                    "dev_set": "-",
                    "date": "-",
                    "setup": {"lm": str(bundle.absolute()), "normalize": "ptb", "definitions": {}, "lambda": None},
                }
            )
        )
        results = {}
        for kind in KINDS:
            clear(kind, work)
            start = time.perf_counter()
            done = subprocess.run(command(kind, work, weights), env=env, capture_output=True, text=True)
            duration = time.perf_counter() - start
            if done.returncode != 0:
                raise RuntimeError(f"{kind}: the uninterrupted run failed: {done.stderr}")
            partial, left, killed_after = 0, 0, []
            for _ in range(kills):
                clear(kind, work)
                proc = subprocess.Popen(
                    command(kind, work, weights), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
                moment = rng.uniform(0, duration)
                time.sleep(moment)
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                killed_after.append(round(moment, 3))
                for name, path in outputs(work).items():
                    if path.exists() and not complete(name, path):
                        partial += 1
                left += len(temporaries(work))
            done = subprocess.run(command(kind, work, weights), env=env, capture_output=True, text=True)
            results[kind] = {
                "uninterrupted_s": round(duration, 3),
                "kills": kills,
                "partial_outputs": partial,
                "temporaries_right_after_kills": left,
                "temporaries_after_next_run": len(temporaries(work)),
                "next_run_exit": done.returncode,
                "killed_after_s": killed_after,
            }
            print(f"kill -9, {kind}: {results[kind]}", file=sys.stderr)
        return results


# -- time to a validation error -----------------------------------------------------------------------------------


def validation_times(bundle: Path, rounds: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        refs = [e.references[0] for e in read_nbest(DEV_OTHER)]
        (work / "refs.txt").write_text("\n".join(refs[:-1]) + "\n")
        weights = work / "w.json"
        record = {"format": "lmserve-weights", "format_version": 2, "features": ["score", "neural"]}
        record |= {"weights": {"score": 1.0, "neural": 0.3}, "metric": "wer", "dev_set": "-", "date": "-"}
        weights.write_text(json.dumps(record | {"setup": {"lm": str(bundle.absolute()), "normalize": "ptb"}}))
        cases = {
            "bad_flag": ["tune", str(DEV_OTHER), "--lm", str(bundle), "--metric", "wer", "--features", "score,neural"]
            + ["--lambdas", "abc", "--out", str(work / "t.json")],
            "missing_references": ["nbest", str(DEV_OTHER), "--weights", str(weights), "--out", str(work / "o.jsonl")]
            + ["--references", str(work / "refs.txt")],
        }
        seconds: dict[str, list[float]] = {name: [] for name in cases}
        messages = {}
        for _ in range(rounds):
            for name, args in cases.items():
                start = time.perf_counter()
                done = subprocess.run(
                    [sys.executable, "-m", "lmserve.rescoring.commands.cli", *args],
                    env=env,
                    capture_output=True,
                    text=True,
                )
                seconds[name].append(time.perf_counter() - start)
                assert done.returncode == 2 and not (work / "o.jsonl").exists(), done.stderr
                messages[name] = done.stderr.strip()
    return {
        name: {"median_s": round(statistics.median(v), 3), "max_s": round(max(v), 3)} for name, v in seconds.items()
    } | {"messages": messages}


# -- output clashes and word spacing (issue 34) -------------------------------------------------------------------


def clashes() -> dict:
    """Each output-clash case in a fresh folder of inputs: refused (exit 2), every file as it was."""
    lost = not_refused = 0
    failures = []
    for name, (argv, _, _) in output_clashes.CASES.items():
        with tempfile.TemporaryDirectory() as tmp:
            root = output_clashes.write_inputs(Path(tmp))
            before = output_clashes.snapshot(root)
            code, err = output_clashes.run_case(argv, root)
            changed = output_clashes.snapshot(root) != before
        lost += changed
        not_refused += code != 2
        if changed or code != 2:
            failures.append(
                f"{name}: exit {code}, files {'changed' if changed else 'as they were'}: {err.strip()}"[:300]
            )
    return {"cases": len(output_clashes.CASES), "data_lost": lost, "not_refused": not_refused, "failures": failures[:5]}


def spacings() -> dict:
    """``lm-rescore nbest --report`` on each format's respaced list, weighted by its first feature (no model): the
    1-best, rescored and oracle WER of every run must be 0."""
    cases = wrong = 0
    failures = []
    for format in FORMATS:
        for space_name, space in SPACES.items():
            if format in NO_TABS and "\t" in space:
                continue
            for swap in (False, True):
                cases += 1
                with tempfile.TemporaryDirectory() as tmp:
                    root = Path(tmp)
                    general = respaced(space, swap)
                    path = root / FILE_NAMES.get(format, "dump")
                    write_nbest(as_format(general, format), path, format)
                    feature = (FEATURES[format] or ("votes",))[0]
                    record = {"format": "lmserve-weights", "format_version": 2, "features": [feature]}
                    record |= {"weights": {feature: 1.0}, "metric": "wer", "dev_set": "-", "date": "-", "setup": {}}
                    (root / "w.json").write_text(json.dumps(record))
                    argv = ["lm-rescore", "nbest", str(path), "--format", format, "--weights", "w.json"]
                    argv += ["--out", "o.jsonl", "--report", "r.json", "--quiet", "--no-overlap-check"]
                    if format in NO_REFERENCES:
                        argv += ["--references", str(write_references(general, root / "refs.txt"))]
                    code, err = output_clashes.run_case(argv, root)
                    report = json.loads((root / "r.json").read_text()) if code == 0 else {}
                wers = [report.get(system, {}).get("wer") for system in ("1best", "rescored", "oracle")]
                if code != 0 or wers != [0.0, 0.0, 0.0]:
                    wrong += 1
                    failures.append(
                        f"{format}, {space_name}, swap {swap}: exit {code}, WER {wers}: {err.strip()}"[:300]
                    )
    return {"cases": cases, "wrong_wer": wrong, "failures": failures[:5]}


# -- offline bad input ---------------------------------------------------------------------------------------------

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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fuzz-cases", type=int, default=1000, help="malformed files per format")
    parser.add_argument("--kills", type=int, default=20, help="kill -9 runs per output kind")
    parser.add_argument("--bundle", type=Path, default=ROOT / "var" / "bundles" / "demo", help="a model bundle")
    parser.add_argument("--rounds", type=int, default=5, help="runs of each validation error")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    fuzzing = {}
    for case in CASES:
        start = time.perf_counter()
        fuzzing[case] = fuzz(case, args.fuzz_cases) | {"seconds": round(time.perf_counter() - start, 1)}
        print(f"fuzz {case}: {fuzzing[case]}", file=sys.stderr)
    kills = kill_runs(args.kills, args.bundle, random.Random(args.seed))
    validation = validation_times(args.bundle, args.rounds)
    print(f"validation: {validation}", file=sys.stderr)
    clash = clashes()
    print(f"output clashes: {clash}", file=sys.stderr)
    spacing = spacings()
    print(f"word spacing: {spacing}", file=sys.stderr)
    offline = {"bom": bom_cases(), "dropped_systems": dropped_systems(), "init_from": initfrom_cases()}
    offline["other"] = bad_input_cases()
    print(f"offline bad input: {offline}", file=sys.stderr)
    metrics = {
        "fuzz_cases": min(f["cases"] for f in fuzzing.values()),  # per format, the smallest
        "fuzz_cases_total": sum(f["cases"] for f in fuzzing.values()),
        "tracebacks": sum(f.get("tracebacks", 0) for f in fuzzing.values()),
        "partial_outputs": sum(f.get("partial_outputs", 0) for f in fuzzing.values()),
        "failed_round_trips": sum(f.get("no_round_trip", 0) for f in fuzzing.values()),
        "kill_runs": sum(k["kills"] for k in kills.values()),
        "kill_partial_outputs": sum(k["partial_outputs"] for k in kills.values()),
        "kill_temporaries_after_next_run": sum(k["temporaries_after_next_run"] for k in kills.values()),
        "validation_error_s": max(v["max_s"] for k, v in validation.items() if k != "messages"),
        "output_clash_cases": clash["cases"],
        "output_clash_data_lost": clash["data_lost"],
        "output_clash_not_refused": clash["not_refused"],
        "whitespace_cases": spacing["cases"],
        "whitespace_wrong_wer": spacing["wrong_wer"],
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
    write_result(
        "rescore_robustness",
        metrics,
        fuzzing=fuzzing,
        kills=kills,
        validation=validation,
        output_clashes=clash,
        word_spacing=spacing,
        offline_bad_input=offline,
        data={"list": str(DEV_OTHER), "kill_utterances": UTTERANCES, "bundle": str(args.bundle)},
    )


if __name__ == "__main__":
    main()
