"""Heads x objectives on one corpus, trained alike -> <table>_<set>.json (objectives_ptb.json, beta_nce_ptb.json, ...)

    python -m benchmarks.objectives ptb --jobs 2 [--tables objectives,beta_nce] [--speed]

The rows are in configs/<set>_objectives.rows.toml, each trained in its own one-thread ``lm-train fit`` process,
``--jobs`` at a time, resumably, and evaluated exactly; a table's file is rewritten as each row finishes
(``complete: false`` until all have). ``--speed``: ``tokens_per_s`` from every row's step timed side by side on the
same batches (benchmarks.training_speed), else the run's own (``run_tokens_per_s``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tomllib
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from benchmarks.common import ROOT, write_result
from benchmarks.train_run import fit_in_subprocess
from benchmarks.training_speed import training_tokens_per_s
from lmserve.training.config import config_from_dict
from lmserve.training.objectives import self_normalised
from lmserve.training.vocab import Vocabulary


def result_row(name: str, run_dir: Path, results: dict) -> dict:
    cfg = config_from_dict(json.loads((run_dir / "config.json").read_text()), str(run_dir / "config.json"))
    vocab_size = len(Vocabulary.load(run_dir / "vocab.tsv"))
    test = results["test"]
    return {
        "row": name,
        "head": cfg.head.type,
        "objective": cfg.objective.type,
        "selfnorm_alpha": cfg.objective.selfnorm_alpha,
        "beta": cfg.objective.beta,
        # input embedding parameters as a fraction of a full |V| x E matrix (slim input embeddings: M / (K |V|))
        "fraction": (cfg.model.input_slim_pool / (cfg.model.input_slim_subvectors * vocab_size))
        if cfg.model.input_slim_pool
        else 1.0,
        "test_ppl": test["ppl"],
        "valid_ppl": results["valid"]["ppl"],
        "tokens_per_s": results["tokens_per_s"],
        "run_tokens_per_s": results["tokens_per_s"],
        "logz_mean": test["logz_mean"],
        "logz_std": test["logz_std"],
        # what the bundle manifest will say: target_logprob exactly normalised, or self-normalised
        "normalised": not self_normalised(cfg),
        "run": str(run_dir.relative_to(ROOT)),
    }


def table_metrics(rows: dict[str, dict], spec: dict, base: dict | None) -> dict:
    """Each row's test perplexity as a ratio to the reference row's, and whether the rows with a target meet it."""
    metrics: dict = {"rows_done": len(rows), "rows_planned": len(spec)}
    if base is None:
        return metrics
    metrics["reference_test_ppl"] = base["test_ppl"]
    for name, row in rows.items():
        row["ppl_vs_reference"] = row["test_ppl"] / base["test_ppl"]
        if "target" in spec[name]:
            row["target_vs_reference"] = spec[name]["target"]
            row["meets_target"] = row["ppl_vs_reference"] <= spec[name]["target"]
    targeted = [row for row in rows.values() if "meets_target" in row]
    metrics["rows_meeting_target"] = sum(row["meets_target"] for row in targeted)
    metrics["rows_with_target"] = sum("target" in row for row in spec.values())
    return metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("set", help="corpus: configs/<set>_objectives.toml and .rows.toml")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--tables", default="", help="comma-separated tables of the rows file (default: all)")
    parser.add_argument("--no-train", action="store_true", help="only gather the runs already finished")
    parser.add_argument("--speed", action="store_true", help="then time every row's training step side by side")
    parser.add_argument("--speed-steps", type=int, default=30, help="batches timed per row and round")
    parser.add_argument("--speed-rounds", type=int, default=3)
    args = parser.parse_args()
    rows_file = ROOT / "configs" / f"{args.set}_objectives.rows.toml"
    spec = tomllib.loads(rows_file.read_text())
    reference = spec.pop("reference")
    # a rows file may train another set's config with overrides of its own for every row (a longer schedule)
    config = ROOT / "configs" / spec.pop("config", f"{args.set}_objectives.toml")
    common = spec.pop("set", [])
    tables = {name: rows for name, rows in spec.items() if not args.tables or name in args.tables.split(",")}
    if not tables:
        parser.error(f"--tables {args.tables!r}: {rows_file} has {', '.join(spec)}")

    # one run per distinct override list, named after the first row of the whole file that asks for it (so that
    # --tables does not rename runs); the reference row first
    reference_set = next(tuple(rows[reference]["set"]) for rows in spec.values() if reference in rows)
    names: dict[tuple, str] = {reference_set: reference}
    for rows in spec.values():
        for name, row in rows.items():
            names.setdefault(tuple(row["set"]), name)
    wanted = {reference_set} | {tuple(row["set"]) for rows in tables.values() for row in rows.values()}
    runs = {overrides: name for overrides, name in names.items() if overrides in wanted}
    done: dict[str, dict] = {table: {} for table in tables}
    failed: list[str] = []
    base = None

    def rows_of(overrides: tuple) -> list[tuple[str, str]]:
        """(table, row) of every row that the run with these overrides stands for."""
        return [(t, name) for t, rows in tables.items() for name, row in rows.items() if tuple(row["set"]) == overrides]

    def run_dir(run_name: str) -> Path:
        return ROOT / "var" / "runs" / f"{args.set}_objectives" / run_name

    def train(overrides: tuple, run_name: str) -> tuple[tuple, Path, dict]:
        return overrides, run_dir(run_name), fit_in_subprocess(config, run_dir(run_name), [*common, *overrides])

    if args.no_train:
        runs = {o: name for o, name in runs.items() if (run_dir(name) / "results.json").exists()}
    with ThreadPoolExecutor(args.jobs) as pool:
        futures = {pool.submit(train, overrides, name): name for overrides, name in runs.items()}
        for future in as_completed(futures):  # the results are gathered here, in this one thread
            try:
                overrides, directory, results = future.result()
            except subprocess.CalledProcessError as error:
                failed.append(futures[future])
                print(f"run {futures[future]} failed ({error}); its log is in var/logs/", file=sys.stderr)
                continue
            if overrides == reference_set:
                base = result_row(reference, directory, results)
            for table, name in rows_of(overrides):
                done[table][name] = result_row(name, directory, results)
            write_tables(args.set, tables, done, base, failed, reference, config, rows_file)

    if args.speed:
        speed = training_tokens_per_s(
            config,
            {name: [*common, *overrides] for overrides, name in runs.items()},
            steps=args.speed_steps,
            rounds=args.speed_rounds,
        )
        for overrides, run_name in runs.items():
            for table, name in rows_of(overrides):
                if name in done[table]:
                    done[table][name]["tokens_per_s"] = speed[run_name]
        write_tables(args.set, tables, done, base, failed, reference, config, rows_file, speed="interleaved")


def write_tables(corpus, tables, done, base, failed, reference, config, rows_file, speed="runs") -> None:
    for table, rows in tables.items():
        ordered = {name: done[table][name] for name in rows if name in done[table]}
        write_result(
            f"{table}_{corpus}",
            {**table_metrics(ordered, rows, base), "failed_runs": failed},
            complete=len(ordered) == len(rows),
            reference=reference,
            # runs: each run's own tokens/s; interleaved: every row's step timed side by side afterwards
            tokens_per_s=speed,
            rows=list(ordered.values()),
            config=str(config.relative_to(ROOT)),
            rows_file=str(rows_file.relative_to(ROOT)),
        )


if __name__ == "__main__":
    main()
