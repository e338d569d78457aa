"""The LibriSpeech rescoring LM's training run, timed from start to end -> rescoring_lm_fast.json

    python -m benchmarks.rescoring_lm_fast [--config configs/gutenberg_rescore_fast.toml]

One pass over the 4.93M training words of var/gutenberg (``lm-train prepare-gutenberg``, done first when missing) in
its own ``lm-train fit`` process: wall seconds from its start to its exit (preparing the text into the run directory
and the final validation and test evaluations included) and the validation perplexity. Before issue 18 the same model
(configs/gutenberg_rescore.toml: batches of 20, SGD, one thread) took 47 minutes to valid ppl 261.3.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys

from benchmarks.common import ROOT, gutenberg_books, run_measured, write_result

RUN = ROOT / "var" / "runs" / "rescoring_lm_fast"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/gutenberg_rescore_fast.toml")
    args = parser.parse_args()
    gutenberg_books("gutenberg")
    shutil.rmtree(RUN, ignore_errors=True)
    measured = run_measured(
        [sys.executable, "-m", "training.cli", "fit", args.config, "--out", str(RUN)], RUN.parent / f"{RUN.name}.log"
    )
    results = json.loads((RUN / "results.json").read_text())
    write_result(
        "rescoring_lm_fast",
        {
            "wall_s": measured["wall_s"],
            "valid_ppl": results["valid"]["ppl"],
            "test_ppl": results["test"]["ppl"],
            "tokens_seen": results["tokens_seen"],
            "tokens_per_s": results["tokens_per_s"],
            "peak_rss_mb": measured["peak_rss_mb"],
        },
        config=args.config,
        before={"wall_s": 47 * 60, "valid_ppl": 261.3, "config": "configs/gutenberg_rescore.toml"},
    )


if __name__ == "__main__":
    main()
