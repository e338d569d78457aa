"""Full vs adaptive softmax on Gutenberg (50k vocabulary), same model and token budget -> adaptive_vs_full_gutenberg.json

    python -m benchmarks.adaptive_vs_full_gutenberg --threads 1

Trains both configs (perplexities, and tokens/s of each whole run), then measures training throughput again with
the two models interleaved in this one process (rounds of the same batches, alternating), so that the speed ratio
does not depend on what else the shared machine did during either run.
"""

from __future__ import annotations

import argparse
import shutil

from benchmarks.common import DATA_DIR, ROOT, time_interleaved, write_result
from benchmarks.train_run import fit_or_resume
from lmserve.training.config import load_config
from lmserve.training.gutenberg import prepare_gutenberg
from lmserve.training.trainer import Trainer

HEADS = ("full", "adaptive")


def interleaved_tokens_per_s(trainers: dict[str, Trainer], batches: int, rounds: int) -> dict[str, float]:
    plan = list(trainers["full"].train_batches.batches(epoch=99))[:batches]
    tokens = sum(batch.num_tokens for batch in plan)

    def train_on_plan(trainer: Trainer):
        trainer.model.train()
        for batch in plan:
            trainer.step([batch], [None], False)  # one micro-batch, no carried state, no stop

    seconds = time_interleaved({name: lambda t=t: train_on_plan(t) for name, t in trainers.items()}, rounds)
    return {name: tokens / s for name, s in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--speed-batches", type=int, default=40)
    parser.add_argument("--speed-rounds", type=int, default=3)
    args = parser.parse_args()
    prepared = ROOT / "var" / "gutenberg"
    if not (prepared / "prepare.json").exists():
        prepare_gutenberg(DATA_DIR / "gutenberg", prepared)
    results, trainers = {}, {}
    for head in HEADS:
        run_dir = ROOT / "var" / "runs" / f"gutenberg_{head}"
        results[head] = fit_or_resume(
            ROOT / "configs" / f"gutenberg_{head}.toml", run_dir, [f"train.threads={args.threads}"]
        )
        # a fresh model in a scratch run for the timing rounds: weights do not change the cost of a step
        scratch = ROOT / "var" / "runs" / f"gutenberg_{head}_speed"
        shutil.rmtree(scratch, ignore_errors=True)
        cfg = load_config(ROOT / "configs" / f"gutenberg_{head}.toml", [f"train.threads={args.threads}"])
        trainers[head] = Trainer.fresh(cfg, scratch)
    speed = interleaved_tokens_per_s(trainers, args.speed_batches, args.speed_rounds)
    full, adaptive = results["full"], results["adaptive"]
    write_result(
        "adaptive_vs_full_gutenberg",
        {
            "vocab_size": len(trainers["full"].vocab),
            "train_tokens": full["tokens_seen"],
            "full_tokens_per_s": full["tokens_per_s"],
            "adaptive_tokens_per_s": adaptive["tokens_per_s"],
            "speedup_whole_runs": adaptive["tokens_per_s"] / full["tokens_per_s"],
            "full_tokens_per_s_interleaved": speed["full"],
            "adaptive_tokens_per_s_interleaved": speed["adaptive"],
            "speedup_interleaved": speed["adaptive"] / speed["full"],
            "full_valid_ppl": full["valid"]["ppl"],
            "adaptive_valid_ppl": adaptive["valid"]["ppl"],
            "valid_ppl_ratio": adaptive["valid"]["ppl"] / full["valid"]["ppl"],
            "full_test_ppl": full["test"]["ppl"],
            "adaptive_test_ppl": adaptive["test"]["ppl"],
            "valid_oov_rate": full["valid_oov_rate"],
        },
        configs=[f"configs/gutenberg_{head}.toml" for head in HEADS],
        runs=[f"var/runs/gutenberg_{head}" for head in HEADS],
    )


if __name__ == "__main__":
    main()
