"""Shared by the training benchmarks: run (or resume) one ``lm-train fit`` run and return its results."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.common import ROOT
from lmserve.training.config import load_config
from lmserve.training.trainer import Trainer


def fit_or_resume(config: str | Path, run_dir: Path, overrides: list[str] = ()) -> dict:
    """Train from scratch, or continue a run a previous (interrupted) benchmark invocation left behind."""
    if (run_dir / "checkpoints" / "latest").exists():
        return Trainer.resume(run_dir).fit()
    return Trainer.fresh(load_config(config, list(overrides)), run_dir).fit()


def fit_in_subprocess(config: Path, run_dir: Path, overrides: list[str] = ()) -> dict:
    """Like ``fit_or_resume``, in its own ``lm-train fit`` process on one thread, logging to var/logs/SWEEP-RUN.log.

    Sweeps run several of these at once (one per core); a finished run (its ``results.json`` is written last) is not
    trained again, so an interrupted sweep picks up where it stopped.
    """
    if not (run_dir / "results.json").exists():
        if (run_dir / "checkpoints" / "latest").exists():
            command = ["fit", "--resume", str(run_dir)]
        else:
            sets = [arg for override in [*overrides, "train.threads=1"] for arg in ("--set", override)]
            command = ["fit", str(config), "--out", str(run_dir), *sets]
        logs = ROOT / "var" / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        with (logs / f"{run_dir.parent.name}-{run_dir.name}.log").open("a") as log:
            subprocess.run(
                [sys.executable, "-m", "lmserve.training.cli", *command], check=True, stdout=log, stderr=log, cwd=ROOT
            )
    return json.loads((run_dir / "results.json").read_text())
