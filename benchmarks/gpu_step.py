"""The training step without launch stalls: today's eager bf16 step against ``train.compile = compile``,
``cuda_graphs`` and ``compile_graphs`` on the same batches -> gpu_step.json

    python -m benchmarks.gpu_step [--data PREPARED] [--steps 40] [--rounds 3] [--results DIR]
    python -m benchmarks.gpu_step --device cpu --tiny --results /tmp/gpu_step   # a smoke test without a GPU

The model is configs/librispeech_lm_gpu.toml's; its batches come from ``--data`` or, by default, from Zipf text made
here in the same shapes (a GPU lease carries little data). Every step kind trains the same batches from the same
weights: once first (compilation and captures, ``first_pass_s``), then in turns with the others for tokens/s
(benchmarks.common.time_interleaved), then under torch.profiler for how busy the GPU was (benchmarks.step_profile's
``busy_ms``). ``captures_timed``: graphs captured inside the timed rounds. Figures: docs/benchmarks/gpu.md ("The
training step without launch stalls").
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks import common
from benchmarks.common import ROOT, time_interleaved, write_result
from benchmarks.step_profile import busy_ms, kernels, run_steps, top_kernels
from lmserve.training.config import load_config
from lmserve.training.trainer import Trainer

CONFIG = ROOT / "configs" / "librispeech_lm_gpu.toml"
TINY = [
    "model.embedding_size=16",
    "model.hidden_size=32",
    "model.projection_size=16",
    "head.cutoffs=[50, 120]",
    "vocab.max_size=200",
    "train.batch_size=16",
]


def synthetic_text(path: Path, sentences: int, vocab: int, max_len: int, seed: int = 0) -> Path:
    """Zipf-distributed words over ``vocab`` types in sentences of gamma-distributed length (mean 20, at most
    ``max_len``), then every word type once in sentences longer than ``max_len`` (training skips them; the vocabulary
    counts them, so that it has all ``vocab`` types)."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, vocab + 1)
    lengths = np.clip(rng.gamma(2.0, 10.0, sentences).astype(int), 1, max_len)
    words = rng.choice(vocab, size=int(lengths.sum()), p=p / p.sum())
    lines = [" ".join(f"w{w}" for w in chunk) for chunk in np.split(words, np.cumsum(lengths)[:-1])]
    every = np.arange(vocab)
    lines += [" ".join(f"w{w}" for w in every[i : i + 2 * max_len]) for i in range(0, vocab, 2 * max_len)]
    path.write_text("\n".join(lines) + "\n")
    return path


def gpu_profile(trainer: Trainer, steps: list, seconds: float) -> dict:
    """The steps once more under torch.profiler, against ``seconds`` of them unprofiled: how busy the GPU was, its
    kernel time per step and the kernels that took most of it (the profile after, beside the eager step's before)."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_steps(trainer, steps)
    spans = [(e.time_range.start, e.time_range.end) for e in kernels(prof.events())]
    kernel_ms = sum(end - start for start, end in spans) / 1e3
    return {
        "gpu_busy": busy_ms(spans) / (seconds * 1e3),
        "kernel_ms_per_step": kernel_ms / len(steps),
        "top_kernels": top_kernels(prof.key_averages(), kernel_ms) if kernel_ms else {},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", help="a prepared dataset with a 50k vocabulary (default: synthetic text)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and batch: the smoke test")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    common.add_results_option(parser)
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=("compile", "cuda_graphs", "compile_graphs"),
        help="new steps to measure (default: those the device has)",
    )
    args = parser.parse_args()
    common.use_results(args.results)
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: PyTorch {torch.__version__} sees no CUDA GPU here (--device cpu --tiny)")
    overrides = [f'train.device="{args.device}"', *(TINY if args.tiny else [])]
    cfg = load_config(CONFIG, overrides)
    modes = ["none", *(args.modes or ["compile", *(["cuda_graphs", "compile_graphs"] if cuda else [])])]
    rows, runs, failed = {}, {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data or str(
            synthetic_text(
                Path(tmp) / "text.txt",
                (args.steps + 1) * cfg.train.batch_size,
                cfg.vocab.max_size,
                cfg.data.max_sentence_len,
            )
        )
        for mode in modes:
            sets = [*overrides, *(f'data.{split}="{data}"' for split in ("train", "valid", "test"))]
            trainer = Trainer.fresh(load_config(CONFIG, [*sets, f'train.compile="{mode}"']), Path(tmp) / mode)
            if mode == modes[0] and not args.data:  # the text is prepared once, by the first mode's trainer
                data = str(trainer.run_dir / "data")
            steps = itertools.islice(trainer.train_steps(0), args.steps)
            steps = [[b.pin_memory() if cuda else b for b in micro] for micro in steps]
            start = time.perf_counter()
            try:
                run_steps(trainer, steps)
            except Exception as err:  # a lease is short: a new step that fails is recorded, the others measured
                if mode == "none":
                    raise
                failed[mode] = f"{type(err).__name__}: {err}"
                print(mode, "failed:", failed[mode], flush=True)
                continue
            tokens = sum(micro[0].num_tokens for micro in steps)
            rows[mode] = {"first_pass_s": time.perf_counter() - start, "steps": len(steps), "tokens": tokens}
            runs[mode] = (trainer, steps)
            print(mode, rows[mode], flush=True)
        captured = {mode: t.fast.captured for mode, (t, _) in runs.items() if t.fast is not None and t.fast.captures}
        seconds = time_interleaved(
            {mode: lambda t=t, s=s: run_steps(t, s) for mode, (t, s) in runs.items()}, args.rounds
        )
        for mode, (trainer, steps) in runs.items():
            if mode in captured:  # a capture inside the timed rounds is time the graphs were meant to save
                rows[mode]["captures_timed"] = trainer.fast.captured - captured[mode]
            rows[mode]["tokens_per_s"] = rows[mode]["tokens"] / seconds[mode]
            rows[mode]["step_ms"] = seconds[mode] * 1e3 / len(steps)
            rows[mode] |= gpu_profile(trainer, steps, seconds[mode]) if cuda else {"gpu_busy": None}
            print(mode, rows[mode], flush=True)
    if len(runs) == 1:
        parser.exit(1, f"every new step failed: {failed}\n")
    best = max((mode for mode in runs if mode != "none"), key=lambda mode: rows[mode]["tokens_per_s"])
    write_result(
        "gpu_step",
        {
            "bf16_tokens_per_s": rows[best]["tokens_per_s"],
            "baseline_tokens_per_s": rows["none"]["tokens_per_s"],
            "speedup": rows[best]["tokens_per_s"] / rows["none"]["tokens_per_s"],
            "gpu_busy": rows[best]["gpu_busy"],
            "baseline_gpu_busy": rows["none"]["gpu_busy"],
            "best_mode": best,
            **{f"tokens_per_s: {mode}": row["tokens_per_s"] for mode, row in rows.items()},
            **{f"gpu_busy: {mode}": row["gpu_busy"] for mode, row in rows.items()},
        },
        rows=rows,
        failed=failed,
        config=str(CONFIG.relative_to(ROOT)),
        overrides=overrides,
        data=args.data or "synthetic",
    )


if __name__ == "__main__":
    main()
