"""Issue 33's output layers and estimators beside the full softmax, Gutenberg V = 50k -> output_layers_v2.json

    python -m benchmarks.output_layers_v2 --jobs 2   # the issue's 8 rows, 1M tokens each: about 2 h on 2 idle cores
    python -m benchmarks.output_layers_v2 --all --tokens 120000 --jobs 2   # all 16 rows -> output_layers_v2_120k.json
    python -m benchmarks.output_layers_v2 --tiny --jobs 2 --results /tmp/ol2   # a smoke test, 1-3 minutes

Every row trains configs/gutenberg_objectives.toml with its own overrides (``ROWS``; ``--all`` adds the older rows of
configs/gutenberg_objectives.rows.toml) in its own one-thread ``lm-train fit`` process, ``--jobs`` at a time,
resumably, on the same ``--tokens`` budget, and is evaluated exactly on the first ``--eval-sentences`` validation and
test sentences. Ratios are over ``full-ce``'s of the same run; speeds are timed side by side on the same batches
(benchmarks.training_speed), exports and scorer speed by benchmarks.export_and_score. The rows, the settings and the
figures: docs/benchmarks/output-layers.md ("The seeds' remaining output layers").
"""

from __future__ import annotations

import argparse
import gzip
import subprocess
import sys
import tomllib
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import benchmarks.common as common
from benchmarks.common import ROOT, gutenberg_books, write_result
from benchmarks.export_and_score import export_and_score
from benchmarks.objectives import result_row
from benchmarks.train_run import fit_in_subprocess
from benchmarks.training_speed import training_tokens_per_s
from lmserve.training.config import load_config
from lmserve.training.model import LSTMLM
from lmserve.training.vocab import Vocabulary

CONFIG = ROOT / "configs" / "gutenberg_objectives.toml"
TOKENS = 1_000_000  # training tokens per row
TINY_TOKENS, TINY_EVAL_SENTENCES = 4000, 40
PROPOSAL = ["objective.samples=1000", "objective.noise_power=0.5", "objective.noise_uniform=0.1"]
IS = ["objective.type=importance_sampling", "objective.target_term=exact", *PROPOSAL]
CHARS = ["head.charcnn_size=200", "head.correction_size=32"]
SLIM = ["head.type=slim", "head.slim_subvectors=4", "head.slim_pool=20000", *IS]
OLDER_ROWS_FILE = ROOT / "configs" / "gutenberg_objectives.rows.toml"
OLDER = ("adaptive-ce", "class-ce", "tree-ce", "full-is", "full-nce", "full-ns", "full-blackout", "full-beta-nce")


def older_rows() -> dict[str, list[str]]:
    """The settings of the older rows, as the Gutenberg objectives table trains them."""
    table = tomllib.loads(OLDER_ROWS_FILE.read_text())["objectives"]
    return {row: table[row]["set"] for row in OLDER}


# the strided training-NLL estimate runs the CNN over the vocabulary: every 20th step only
CNN = ["head.type=cnnsoftmax", *CHARS, "objective.nll_every=20"]
# the rows (the default)
ROWS = {
    "full-ce": [],
    "cnnsoftmax": [*CNN, "objective.type=target_sampling", *PROPOSAL],
    "dsoftmax": ["head.type=dsoftmax", "head.cutoffs=[2000, 10000]", "head.band_widths=[128, 48, 24]"],
    "target-sampling": ["objective.type=target_sampling", *PROPOSAL],
    "fixed-is": IS,
    "adaptive-is": [*IS, "objective.type=adaptive_importance_sampling", "objective.adapt_rate=0.02"],
    "slim-random": SLIM,
    "slim-clustered": [*SLIM, "head.slim_embeddings={full}"],
}
ALL_ROWS = ROWS | older_rows()  # --all: the one table of every output layer and estimator
# rows that run only when --rows names them
EXTRA_ROWS = {
    "cnnsoftmax-is": [*CNN, *IS],
    "dsoftmax-nested": [
        "head.type=dsoftmax",
        "head.cutoffs=[2000, 10000]",
        "head.band_widths=[200, 64, 32]",
        "head.band_layout=nested",
    ],
}
# a smoke test of the whole pipeline: a 2,000-word vocabulary, a 32-dimensional model, a few thousand tokens a row;
# these values replace the rows' own (same key) and come after the common settings
TINY = ["model.embedding_size=32", "model.hidden_size=32", "train.batch_size=10"]
TINY_VALUES = {
    "head.cutoffs": "[200, 1000]",
    "head.charcnn_size": "20",
    "head.correction_size": "8",
    "head.slim_pool": "800",
    "objective.samples": "100",
}
TINY_WIDTHS = {"dsoftmax": "[16, 10, 6]", "dsoftmax-nested": "[32, 10, 6]"}  # (the tiny model's 32 dimensions)


def tiny(row: str, settings: list[str]) -> list[str]:
    out = []
    for setting in settings:
        key = setting.split("=", 1)[0]
        value = TINY_WIDTHS[row] if key == "head.band_widths" else TINY_VALUES.get(key)
        out.append(setting if value is None else f"{key}={value}")
    return out


def row_settings(row: str, data: Path, tokens: int, small: bool, runs: Path) -> list[str]:
    """The --set overrides of a row's run (benchmarks/oov_scoring.py trains the cnnsoftmax row with the same)."""
    common_sets = [f"data.train={data}", f"data.valid={data}", f"data.test={data}", f"train.max_tokens={tokens}"]
    common_sets += ["train.log_interval=20", *(TINY if small else [])]
    own = (ALL_ROWS | EXTRA_ROWS)[row]
    settings = tiny(row, own) if small else own
    return [s.replace("{full}", str(runs / "full-ce")) for s in [*common_sets, *settings]]


def first_sentences(source: Path, out: Path, count: int) -> Path:
    """The first ``count`` lines of a gzipped text, gzipped (mtime 0: the same bytes each time)."""
    with gzip.open(source, "rt", encoding="utf-8") as f:
        lines = [line for _, line in zip(range(count), f, strict=False)]
    data = gzip.compress("".join(lines).encode("utf-8"), mtime=0)
    if not out.exists() or out.read_bytes() != data:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(data)
    return out


def prepare_data(books: Path, folder: Path, eval_sentences: int, vocab_size: int) -> Path:
    """var/output_layers_v2/data: the books' training text with a vocabulary of ``vocab_size`` and the first
    ``eval_sentences`` sentences of the validation and test books (``lm-train prepare``; nothing to do when done)."""
    valid = first_sentences(books / "valid.txt.gz", folder / "heldout" / "valid.txt.gz", eval_sentences)
    test = first_sentences(books / "test.txt.gz", folder / "heldout" / "test.txt.gz", eval_sentences)
    data = folder / "data"
    command = [sys.executable, "-m", "lmserve.training.cli", "prepare", "--out", str(data)]
    command += ["--train", str(books / "train.txt.gz"), "--valid", str(valid), "--test", str(test)]
    subprocess.run([*command, "--max-size", str(vocab_size)], check=True, cwd=ROOT)
    return data


def output_params(overrides: list[str], vocab: Vocabulary) -> int:
    """Parameters of the row's output layer (its head), from a model built as the run builds it."""
    cfg = load_config(CONFIG, overrides)
    return sum(p.numel() for p in LSTMLM(len(vocab), cfg.model, cfg.head, vocab.tokens).head.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=TOKENS, help="training tokens per row")
    parser.add_argument("--eval-sentences", type=int, default=500, help="validation and test sentences")
    parser.add_argument("--rows", default="", help="comma-separated rows (default: the issue's 8)")
    parser.add_argument("--all", action="store_true", help="every row, the issue's and the older ones")
    parser.add_argument("--speed-steps", type=int, default=8)
    parser.add_argument("--speed-rounds", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="a smoke test: 2,000 words, 32-dim model, 4,000 tokens")
    common.add_results_option(parser)
    args = parser.parse_args()
    common.use_results(args.results)
    name = "output_layers_v2_tiny" if args.tiny else "output_layers_v2"
    if args.tiny:
        args.tokens, args.eval_sentences = min(args.tokens, TINY_TOKENS), min(args.eval_sentences, TINY_EVAL_SENTENCES)
    folder = ROOT / "var" / name
    if args.tokens != TOKENS and not args.tiny:  # another budget: runs and result file of their own, same data
        name = f"{name}_{args.tokens // 1000}k"
    runs = ROOT / "var" / "runs" / name
    data = prepare_data(gutenberg_books(), folder, args.eval_sentences, 2000 if args.tiny else 50_000)
    known = ALL_ROWS | EXTRA_ROWS
    unknown = [r for r in args.rows.split(",") if r not in known] if args.rows else []
    if unknown:
        parser.error(f"--rows: unknown {', '.join(unknown)}; the rows are {', '.join(known)}")
    if args.rows and args.all:
        parser.error("--rows or --all, not both")
    rows = {r: known[r] for r in (args.rows.split(",") if args.rows else ALL_ROWS if args.all else ROWS)}
    full_done = (runs / "full-ce" / "results.json").exists()
    if "slim-clustered" in rows and "full-ce" not in rows and not full_done:
        parser.error("--rows: slim-clustered clusters full-ce's output vectors: run full-ce too")

    def overrides(row: str) -> list[str]:
        return row_settings(row, data, args.tokens, args.tiny, runs)

    results: dict[str, dict] = {}
    failed: list[str] = []
    # full-ce first (the longest, and slim-clustered needs it), then the slow rows, so that two jobs stay busy
    waiting = [r for r in rows if r != "slim-clustered" or "full-ce" not in rows]
    with ThreadPoolExecutor(args.jobs) as pool:
        running = {}
        while waiting or running:
            while waiting and len(running) < args.jobs:
                row = waiting.pop(0)
                running[pool.submit(fit_in_subprocess, CONFIG, runs / row, overrides(row))] = row
            done, _ = wait(running, return_when="FIRST_COMPLETED")
            for future in done:
                row = running.pop(future)
                try:
                    results[row] = result_row(row, runs / row, future.result())
                except subprocess.CalledProcessError as error:
                    failed.append(row)
                    print(f"run {row} failed ({error}); its log is in var/logs/", file=sys.stderr)
                    continue
                if row == "full-ce" and "slim-clustered" in rows:
                    waiting.append("slim-clustered")

    timed = {row: overrides(row) for row in results if row != "slim-clustered"}
    speed = training_tokens_per_s(CONFIG, timed, steps=args.speed_steps, rounds=args.speed_rounds)
    vocab = Vocabulary.load(data / "vocab.tsv")
    test = folder / "heldout" / "test.txt.gz"
    served = export_and_score({row: runs / row for row in results}, str(data), test, args.speed_rounds)
    for row, result in results.items():
        result["tokens_per_s"] = speed.get(row, speed.get("slim-random"))
        result["output_params"] = output_params(overrides(row), vocab)
        result |= served[row]
    write_result(
        name,
        metrics(results),
        failed_runs=failed,
        rows=[results[r] for r in rows if r in results],
        tokens_per_row=args.tokens,
        eval_sentences=args.eval_sentences,
        vocab_size=len(vocab),
        config=str(CONFIG.relative_to(ROOT)),
        overrides={r: rows[r] for r in rows},
        complete=not failed and len(results) == len(rows),
    )


def metrics(rows: dict[str, dict]) -> dict:
    """The issue's figures, for the rows that ran."""
    out: dict = {}
    full = rows.get("full-ce")

    def ratio(row: str, field: str, base: dict | None) -> float | None:
        return rows[row][field] / base[field] if row in rows and base else None

    if full:
        out["full_ce_ppl"] = full["test_ppl"]
        out["full_ce_tokens_per_s"] = full["tokens_per_s"]
        for row, key in (
            ("dsoftmax", "dsoftmax"),
            ("dsoftmax-nested", "dsoftmax_nested"),
            ("target-sampling", "target_sampling"),
        ):
            out[f"{key}_ppl_ratio"] = ratio(row, "test_ppl", full)
            out[f"{key}_speedup"] = ratio(row, "tokens_per_s", full)
        out["cnnsoftmax_ppl_ratio"] = ratio("cnnsoftmax", "test_ppl", full)
        out["cnnsoftmax_param_ratio"] = ratio("cnnsoftmax", "output_params", full)
        # the cost of the CNN's vectors alone: against the full softmax trained by the same estimator
        out["cnnsoftmax_ppl_vs_target_sampling"] = ratio("cnnsoftmax", "test_ppl", rows.get("target-sampling"))
        out["cnnsoftmax_is_ppl_ratio"] = ratio("cnnsoftmax-is", "test_ppl", full)
    for row, key in (
        ("adaptive-is", "adaptive_is_ppl"),
        ("fixed-is", "fixed_is_ppl"),
        ("slim-clustered", "clustered_slim_ppl"),
        ("slim-random", "random_slim_ppl"),
        ("cnnsoftmax", "cnnsoftmax_ppl"),
    ):
        out[key] = rows[row]["test_ppl"] if row in rows else None
    return {k: v for k, v in out.items() if v is not None}


if __name__ == "__main__":
    main()
