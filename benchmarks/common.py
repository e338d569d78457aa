"""Result files of the benchmarks: ``{"metrics": {...}, "command", "commit", "date", "machine", ...}``."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from lmserve.core.atomic import atomic_write_text

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# The shared data sets: $LMSERVE_DATA, else beside this checkout (benchmarks run from one).
DATA_DIR = Path(os.environ.get("LMSERVE_DATA") or ROOT.parent / "shared" / "data")


def git_commit() -> str:
    """HEAD, with ``-dirty`` when tracked files other than results differ from it (the figures then come from
    uncommitted code).

    A copy of the tree sent elsewhere (a lent GPU machine gets one, with a stale or no git history) is named by
    $LMSERVE_COMMIT, which wins when set.
    """

    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    if os.environ.get("LMSERVE_COMMIT"):
        return os.environ["LMSERVE_COMMIT"]
    commit = git("rev-parse", "HEAD") or "unknown"
    # benchmarks/results is what benchmarks write, not what they run: a second benchmark in the same clean tree
    # after a first has written its result is still that commit's code
    changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks/results")
    return commit + ("-dirty" if changed else "")


# Taken when the benchmark starts: the code that ran, even if HEAD moves during a long run.
COMMIT_AT_START = git_commit()


def machine() -> dict:
    import torch

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "host": platform.node(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        **({"gpu": torch.cuda.get_device_name()} if torch.cuda.is_available() else {}),
    }


def add_results_option(parser) -> None:
    """``--results DIR``: a trial run writes its result files there; benchmarks/results holds clean commits' runs."""
    parser.add_argument(
        "--results", type=Path, help="write the result file(s) into this folder instead of benchmarks/results"
    )


def use_results(folder: Path | None) -> None:
    """Send ``write_result``'s files to ``folder`` (``--results``), when one is given."""
    global RESULTS
    if folder:
        folder.mkdir(parents=True, exist_ok=True)
        RESULTS = folder


def write_result(name: str, metrics: dict, no_write: bool = False, **extra) -> dict:
    """``benchmarks/results/NAME.json``: the metrics, ``extra``, the command, commit, date and machine; with
    ``no_write`` (``--no-write``: tests) only the metrics on stderr. Returns the metrics and ``extra``."""
    if no_write:
        print(json.dumps({"metrics": metrics}, indent=1), file=sys.stderr)
        return {"metrics": metrics, **extra}
    result = {
        "metrics": metrics,
        **extra,
        "command": "python -m " + shlex.join([sys.modules["__main__"].__spec__.name, *sys.argv[1:]]),
        "commit": COMMIT_AT_START,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
    }
    path = RESULTS / f"{name}.json"
    atomic_write_text(path, json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}", file=sys.stderr)
    return {"metrics": metrics, **extra}


def time_interleaved(cases: dict[str, Callable[[], object]], rounds: int = 3) -> dict[str, float]:
    """Median wall seconds of each case, the cases taking turns round after round: on a shared machine a ratio of
    two such figures is fair even when the load changes while the benchmark runs."""
    seconds: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, run in cases.items():
            start = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in seconds.items()}


def ensure_bundle(run: Path, out: Path, quantize: str | None = None, heldout: str | None = None) -> Path:
    """Export ``run`` to ``out`` unless a bundle is already there (benchmarks re-use each other's bundles)."""
    if not (out / "manifest.json").exists():
        from lmserve.training.export import export_bundle

        export_bundle(run, out, quantize=quantize, heldout=heldout)
    return out


def ptb_sentences(split: str = "test") -> list[str]:
    from lmserve.training.corpus import read_sentences

    return [" ".join(words) for words in read_sentences(DATA_DIR / "ptb" / f"ptb.{split}.txt.gz")]


def _tree_rss_kb(root: int) -> tuple[int, int]:
    """Resident memory of process ``root`` and all its descendants (kB), from /proc: all of it (VmRSS) and its
    anonymous part (RssAnon), which leaves out file pages a memory map has mapped in (page cache, reclaimable)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, tuple[int, int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        pid = int(entry.name)
        children.setdefault(int(fields["PPid"]), []).append(pid)
        rss[pid] = tuple(int(fields.get(name, "0 kB").split()[0]) for name in ("VmRSS", "RssAnon"))
    total, anon, todo = 0, 0, [root]
    while todo:
        pid = todo.pop()
        pid_total, pid_anon = rss.get(pid, (0, 0))
        total, anon = total + pid_total, anon + pid_anon
        todo.extend(children.get(pid, []))
    return total, anon


def run_measured(command: list[str], log: Path, interval: float = 0.05, **popen) -> dict:
    """Run ``command`` to the end (output to ``log``), sampling the resident memory of it and its child processes
    (worker pools included) every ``interval`` seconds; returns wall seconds and the peaks of the whole tree's RSS
    and of its anonymous part (MB)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    peak, peak_anon = 0, 0
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=popen.pop("cwd", ROOT), **popen)
        while proc.poll() is None:
            total, anon = _tree_rss_kb(proc.pid)
            peak, peak_anon = max(peak, total), max(peak_anon, anon)
            time.sleep(interval)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{shlex.join(command)} failed ({proc.returncode}); see {log}")
    return {"wall_s": seconds, "peak_rss_mb": peak / 1024, "peak_anon_mb": peak_anon / 1024}


def gutenberg_books(name: str = "gutenberg") -> Path:
    """var/NAME: DATA_DIR/NAME made LibriSpeech-like by ``lm-train prepare-gutenberg``, done first when missing."""
    books = ROOT / "var" / name
    if not (books / "prepare.json").exists():
        data = DATA_DIR / name
        command = [sys.executable, "-m", "lmserve.training.cli", "prepare-gutenberg", "--data", str(data), "--out"]
        command.append(str(books))
        run_measured(command, ROOT / "var" / "logs" / f"prepare-{name}.log")
    return books


def demo_weights() -> Path:
    """``make demo``'s dev_clean weights file (it names the demo bundle and 3-gram), or exit saying how to make it."""
    weights = ROOT / "var" / "rescore" / "demo.weights.json"
    if not weights.exists():
        sys.exit(f"{weights}: missing; run `make demo` first (it builds the demo bundle, 3-gram and weights)")
    return weights


def list_head(path: Path, limit: int | None, tmp: Path) -> Path:
    """``path`` itself, or with ``limit`` a JSONL copy of its first ``limit`` utterances in ``tmp`` (a smoke test)."""
    if not limit:
        return path
    from lmserve.rescoring.nbest import NBestList, read_nbest, write_nbest

    head = tmp / "list.jsonl"
    write_nbest(NBestList(read_nbest(path).entries[:limit]), head, "jsonl")
    return head
