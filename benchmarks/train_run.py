"""Shared by the training benchmarks: run (or resume) one ``lm-train fit`` run and return its results."""

from __future__ import annotations

from pathlib import Path

from training.config import load_config
from training.trainer import Trainer


def fit_or_resume(config: str | Path, run_dir: Path, overrides: list[str] = ()) -> dict:
    """Train from scratch, or continue a run a previous (interrupted) benchmark invocation left behind."""
    if (run_dir / "checkpoints" / "latest").exists():
        return Trainer.resume(run_dir).fit()
    return Trainer.fresh(load_config(config, list(overrides)), run_dir).fit()
