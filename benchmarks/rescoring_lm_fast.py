"""A LibriSpeech rescoring LM's training run, timed from start to end -> NAME.json

    python -m benchmarks.rescoring_lm_fast [--config configs/gutenberg_rescore_fast.toml]
    python -m benchmarks.rescoring_lm_fast --config configs/librispeech_lm.toml --books gutenberg-large \
        --prepare var/prepared/glarge-w50k --max-size 50000 --name librispeech_lm_train

The books (``lm-train prepare-gutenberg``) are made first when missing, and with ``--prepare`` the config's prepared
dataset (``lm-train prepare``, timed apart). Then ``lm-train fit`` in its own process: wall seconds from its start to
its exit (the final validation and test evaluations included), tokens seen and the validation perplexity. Before
issue 18 the 4.9M-word model (configs/gutenberg_rescore.toml: batches of 20, SGD, one thread) took 47 minutes to
valid ppl 261.3.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys

from benchmarks.common import ROOT, gutenberg_books, run_measured, write_result

# The same model before issue 18's faster step
BEFORE = {"rescoring_lm_fast": {"wall_s": 47 * 60, "valid_ppl": 261.3, "config": "configs/gutenberg_rescore.toml"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/gutenberg_rescore_fast.toml")
    parser.add_argument("--books", default="gutenberg", help="the prepare-gutenberg output under var/ it trains on")
    parser.add_argument("--prepare", help="prepare the books into this dataset first (the config's data directory)")
    parser.add_argument("--max-size", type=int, default=0, help="--prepare: vocabulary size")
    parser.add_argument("--name", default="rescoring_lm_fast", help="result file and var/runs/ directory")
    args = parser.parse_args()
    run = ROOT / "var" / "runs" / args.name
    books = gutenberg_books(args.books)
    prepared = {}
    if args.prepare:
        command = [sys.executable, "-m", "lmserve.training.cli", "prepare", "--text-dir", str(books), "--out", args.prepare,
                   "--max-size", str(args.max_size), "--workers", "2"]  # fmt: skip
        prepared = run_measured(command, ROOT / "var" / "logs" / f"{args.name}-prepare.log", cwd=ROOT)
    shutil.rmtree(run, ignore_errors=True)
    measured = run_measured(
        [sys.executable, "-m", "lmserve.training.cli", "fit", args.config, "--out", str(run)],
        run.parent / f"{run.name}.log",
    )
    results = json.loads((run / "results.json").read_text())
    write_result(
        args.name,
        {
            "wall_s": measured["wall_s"],
            "valid_ppl": results["valid"]["ppl"],
            "test_ppl": results["test"]["ppl"],
            "tokens_seen": results["tokens_seen"],
            "tokens_per_s": results["tokens_per_s"],
            "peak_rss_mb": measured["peak_rss_mb"],
            **({"prepare_wall_s": prepared["wall_s"]} if prepared else {}),
        },
        config=args.config,
        run=str(run.relative_to(ROOT)),
        **({"before": BEFORE[args.name]} if args.name in BEFORE else {}),
    )


if __name__ == "__main__":
    main()
