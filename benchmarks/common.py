"""Result files of the benchmarks: ``{"metrics": {...}, "command", "commit", "date", "machine", ...}``."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

from training.atomic import atomic_write_text

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def git_commit() -> str:
    """HEAD, with ``-dirty`` when tracked files differ from it (the figures then come from uncommitted code)."""

    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "HEAD") or "unknown"
    return commit + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


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
    }


def write_result(name: str, metrics: dict, **extra) -> Path:
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
    return path
