"""Where a training step's time goes, before and after the fast settings -> step_profile.json

    python -m benchmarks.step_profile [--steps 20] [--threads 2]

Each config trains ``--steps`` steps of PTB under torch.profiler; the trainer marks its regions (``lstm`` and
``head`` in the forward pass, ``backward``, ``optimizer``: clipping and the update) and the backward pass is split by
operator (the LSTM's own backward kernels against the rest, which is the head's and the embedding's). Building the
batches is timed on its own, and every config's training tokens/s is measured in turns with the others
(benchmarks.common.time_interleaved), so that the speed-ups compare.

Configs: ``today`` is configs/ptb_objectives.toml (the Zaremba-small shape in sentence mode: 10k-word full
softmax, batches of 20, SGD); the others change the head and the batch size, and the last is configs/ptb_fast.toml.
"""

from __future__ import annotations

import argparse
import itertools
import re
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import ROOT, time_interleaved, write_result
from lmserve.training.config import load_config
from lmserve.training.trainer import Trainer

CONFIGS = {
    "today (full softmax, batch 20, SGD)": ("ptb_objectives.toml", []),
    "+ batch 64": ("ptb_objectives.toml", ["train.batch_size=64"]),
    "+ adaptive softmax": (
        "ptb_objectives.toml",
        ["train.batch_size=64", 'head.type="adaptive"', "head.cutoffs=[2000]"],
    ),
    "ptb_fast (+ Adam)": ("ptb_fast.toml", []),
}
REGIONS = ("lstm", "head", "backward", "optimizer")


def profile_steps(trainer: Trainer, steps: list) -> dict:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for micro in steps:
            trainer.step(micro, [None], False)
    totals = {e.key: e.cpu_time_total / 1e3 for e in prof.key_averages()}  # ms
    lstm_backward = (
        sum(
            e.self_cpu_time_total for e in prof.key_averages() if re.search(r"rnn.*backward|backward.*rnn", e.key, re.I)
        )
        / 1e3
    )
    shares = {region: totals.get(region, 0.0) for region in REGIONS}
    shares["backward: lstm"] = lstm_backward
    shares["backward: head and embedding"] = shares.pop("backward") - lstm_backward
    total = sum(shares.values())
    return {name: ms / total for name, ms in shares.items()} | {"profiled_ms_per_step": total / len(steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows, runs = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, (config, sets)) in enumerate(CONFIGS.items()):
            cfg = load_config(ROOT / "configs" / config, [*sets, f"train.threads={args.threads}"])
            trainer = Trainer.fresh(cfg, Path(tmp) / str(i))
            start = time.perf_counter()
            steps = list(itertools.islice(trainer.train_batches.steps_of(0), 3 + args.steps))
            build_ms = (time.perf_counter() - start) * 1e3 / len(steps)
            for micro in steps[:3]:  # warm-up
                trainer.step(micro, [None], False)
            timed = steps[3:]
            tokens = sum(m[0].num_tokens for m in timed)
            padded = sum(m[0].targets.numel() for m in timed)
            rows[name] = {
                "profile": profile_steps(trainer, timed),
                "batch_build_ms": build_ms,
                "padding": 1 - tokens / padded,
            }
            runs[name] = (lambda t=trainer, s=timed: [t.step(m, [None], False) for m in s], tokens)
            print(name, rows[name], flush=True)
        seconds = time_interleaved({name: run for name, (run, _) in runs.items()}, args.rounds)
    for name, (_, tokens) in runs.items():
        rows[name]["tokens_per_s"] = tokens / seconds[name]
        rows[name]["step_ms"] = seconds[name] * 1e3 / args.steps
        rows[name]["batch_build_share"] = rows[name]["batch_build_ms"] / rows[name]["step_ms"]
    base = rows[next(iter(rows))]["tokens_per_s"]
    write_result(
        "step_profile",
        {
            "speedup_ptb_fast": rows["ptb_fast (+ Adam)"]["tokens_per_s"] / base,
            **{f"tokens_per_s: {n}": r["tokens_per_s"] for n, r in rows.items()},
        },
        rows=rows,
        threads=args.threads,
        steps=args.steps,
    )


if __name__ == "__main__":
    main()
