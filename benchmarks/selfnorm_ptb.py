"""Self-normalisation penalty alpha * (log Z)^2 on PTB, a sweep over alpha and gamma -> selfnorm_ptb.json

    python -m benchmarks.selfnorm_ptb --jobs 2

Every setting trains configs/ptb_selfnorm.toml (same schedule) in its own ``lm-train fit`` process, one thread each,
``--jobs`` at a time (benchmarks.train_run.fit_in_subprocess: resumable).
"""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor

from benchmarks.common import ROOT, write_result
from benchmarks.train_run import fit_in_subprocess

CONFIG = ROOT / "configs" / "ptb_selfnorm.toml"
SETTINGS = [(0.0, 1.0), (0.01, 1.0), (0.1, 1.0), (0.5, 1.0), (1.0, 1.0), (0.1, 0.1), (1.0, 0.1)]


def run_setting(alpha: float, gamma: float) -> dict:
    run_dir = ROOT / "var" / "runs" / f"ptb_selfnorm_a{alpha:g}_g{gamma:g}"
    overrides = [f"objective.selfnorm_alpha={alpha}", f"objective.selfnorm_gamma={gamma}"]
    results = fit_in_subprocess(CONFIG, run_dir, overrides)
    test = results["test"]
    return {
        "alpha": alpha,
        "gamma": gamma,
        "test_ppl": test["ppl"],
        "valid_ppl": results["valid"]["ppl"],
        "logz_mean": test["logz_mean"],
        "logz_std": test["logz_std"],
        "tokens_per_s": results["tokens_per_s"],
        "run": str(run_dir.relative_to(ROOT)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=1)
    args = parser.parse_args()
    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(lambda s: run_setting(*s), SETTINGS))
    baseline = next(r for r in rows if r["alpha"] == 0)
    for row in rows:
        row["ppl_vs_alpha0"] = row["test_ppl"] / baseline["test_ppl"]
        row["meets_target"] = row["ppl_vs_alpha0"] <= 1.03 and row["logz_std"] <= 0.5 and abs(row["logz_mean"]) <= 0.1
    best = min((r for r in rows if r["alpha"] > 0), key=lambda r: (not r["meets_target"], r["ppl_vs_alpha0"]))
    write_result(
        "selfnorm_ptb",
        {
            "alpha0_test_ppl": baseline["test_ppl"],
            "best_alpha": best["alpha"],
            "best_gamma": best["gamma"],
            "best_ppl_vs_alpha0": best["ppl_vs_alpha0"],
            "best_logz_mean": best["logz_mean"],
            "best_logz_std": best["logz_std"],
            "settings_meeting_target": sum(r["meets_target"] for r in rows),
        },
        rows=rows,
        config=str(CONFIG.relative_to(ROOT)),
        target="ppl within 3% of alpha=0, std(log Z) <= 0.5, |mean log Z| <= 0.1 (on PTB test)",
    )


if __name__ == "__main__":
    main()
