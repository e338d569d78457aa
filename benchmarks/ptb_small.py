"""Zaremba "small" on PTB, stream or sentence mode -> ptb_small_stream.json / ptb_small_sentence.json.

python -m benchmarks.ptb_small --mode stream --threads 1
"""

from __future__ import annotations

import argparse

from benchmarks.common import ROOT, write_result
from benchmarks.train_run import fit_or_resume


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mode", choices=("stream", "sentence"), required=True)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    name = f"ptb_small_{args.mode}"
    run_dir = ROOT / "var" / "runs" / name
    results = fit_or_resume(ROOT / "configs" / f"{name}.toml", run_dir, [f"train.threads={args.threads}"])
    write_result(
        name,
        {
            "test_ppl": results["test"]["ppl"],
            "valid_ppl": results["valid"]["ppl"],
            "test_ppl_no_oov": results["test"]["ppl_no_oov"],
            "tokens_per_s": results["tokens_per_s"],
            "wall_s": results["wall_seconds"],
            "train_s": results["train_seconds"],
            "epochs": results["epochs"],
        },
        run=str(run_dir.relative_to(ROOT)),
        config=f"configs/{name}.toml",
    )


if __name__ == "__main__":
    main()
