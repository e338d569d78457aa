"""Launching ``lm-train fit`` under torchrun from benchmarks and tests, and finding the process of one rank."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.common import ROOT

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def lm_train_fit(config: Path, run: Path, *sets: str, launcher: list[str] = (), nproc: int = 0) -> list[str]:
    """The command line of ``lm-train fit CONFIG --out RUN --auto-resume`` with ``--set``s, under torchrun with
    ``nproc`` processes (``launcher``: its options, default ``--standalone``), or plain when ``nproc`` is 0."""
    fit = ["-m", "lmserve.training.cli", "fit", str(config), "--out", str(run)]
    fit += [arg for value in sets for arg in ("--set", value)]
    if not nproc:
        return [sys.executable, *fit]
    return [*TORCHRUN, *(launcher or ["--standalone"]), f"--nproc-per-node={nproc}", *fit, "--auto-resume"]


def run_fit(command: list[str], run: Path, log_name: str = "", env: dict | None = None) -> dict:
    """Run a fit command line to the end (its output in RUN.log, or LOG_NAME.log beside RUN; ``env``: its
    environment, default this one's) and return the run's results.json."""
    run.parent.mkdir(parents=True, exist_ok=True)
    with (run.parent / f"{log_name or run.name}.log").open("w") as log:
        subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True, env=env)
    return json.loads((run / "results.json").read_text())


def worker_pid(launcher_pid: int, rank: int) -> int | None:
    """The pid of the worker of ``rank`` that the torchrun process ``launcher_pid`` started (read from /proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        parent = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
        if parent == launcher_pid and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    return None
