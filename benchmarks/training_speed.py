"""Training tokens/s of several configs measured side by side, in one process, on the same batches.

A sweep's runs report their own tokens/s, but each ran beside whatever else the machine was doing (other runs of the
sweep, tests): those figures do not compare. Here every config gets a ``Trainer`` (the real training step:
forward, objective, backward, clipping, optimiser), and the configs take turns, round after round, timing the same
``steps`` batches each (benchmarks.common.time_interleaved), on one thread.
"""

from __future__ import annotations

import itertools
import tempfile
from pathlib import Path

import torch

from benchmarks.common import time_interleaved
from lmserve.training.config import load_config
from lmserve.training.trainer import Trainer


def training_tokens_per_s(
    config: Path, rows: dict[str, list[str]], steps: int = 30, warmup: int = 5, rounds: int = 3
) -> dict[str, float]:
    """``rows``: name -> --set overrides of ``config``. Returns name -> training tokens/s (median over rounds)."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {
            name: Trainer.fresh(load_config(config, [*overrides, "train.threads=1"]), Path(tmp) / name)
            for name, overrides in rows.items()
        }
        batches = list(itertools.islice(next(iter(trainers.values())).train_batches.batches(0), warmup + steps))
        tokens = sum(batch.num_tokens for batch in batches[warmup:])

        def run(trainer: Trainer, timed: list) -> None:
            for batch in timed:
                trainer.step([batch], [None], False)  # one micro-batch, no carried state, no stop

        for trainer in trainers.values():
            run(trainer, batches[:warmup])
        seconds = time_interleaved({name: lambda t=t: run(t, batches[warmup:]) for name, t in trainers.items()}, rounds)
    return {name: tokens / s for name, s in seconds.items()}
