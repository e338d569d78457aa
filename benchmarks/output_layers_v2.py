"""Issue 33's output layers and estimators beside the full softmax, Gutenberg V = 50k -> output_layers_v2.json

    python -m benchmarks.output_layers_v2 --jobs 2   # the issue's 8 rows, 1M tokens each: about 2 h on 2 idle cores
    python -m benchmarks.output_layers_v2 --all --tokens 120000 --jobs 2   # every output layer and estimator of the
        # project (16 rows) on 120k tokens each -> output_layers_v2_120k.json, about 25 minutes (40 on busy cores)
    python -m benchmarks.output_layers_v2 --tiny --jobs 2 --results /tmp/ol2   # a smoke test, 1-3 minutes

(The estimates add up the rows' speeds timed here: the full softmax about 300-700 tokens/s in its run, cnnsoftmax
about 1,000-1,500, the other rows 1,000-5,000, with two jobs side by side; the k-means of slim-clustered, a minute;
evaluations, process starts and the speed rounds, about 5 minutes; exports and scorer rounds, about 5 minutes: 7-21 s
an export on a loaded machine.) A budget other than the default 1M tokens gets runs and a result file of its own
(``_120k``); all budgets share the data.

Every row trains configs/gutenberg_objectives.toml, the settings of the Gutenberg objectives tables (the 2x200 LSTM
in sentence mode, a 50,000-word vocabulary of the prepared Gutenberg books, SGD at lr 1, batches of 20 sentences,
output biases at the log unigram), with its own overrides, in its own one-thread ``lm-train fit`` process, ``--jobs``
at a time, resumably (a finished run is not trained again). To fit the CPU time of a shared 2-core machine, and unlike
those tables' 2M tokens, every row trains on the same budget, ``--tokens`` (1,000,000 by default: the full
softmax takes about 25 minutes of it; at 120,000 the ratios are those of barely started models), and is evaluated
on the first ``--eval-sentences`` sentences of the validation and test books (a prepared dataset of its own,
var/output_layers_v2/data): the models are far from converged and the perplexities are those of an early stage of
training, compared like with like. The rows:

- ``full-ce``: the reference, full softmax with cross-entropy;
- ``dsoftmax``: differentiated softmax, bands at 2,000 and 10,000 words of widths 128, 48, 24 (disjoint segments of
  the 200-dimensional state, as Chen et al.); ``--rows dsoftmax-nested`` adds widths 200, 64, 32 over nested prefixes;
- ``target-sampling``: full softmax trained by target sampling, the batch's targets and 1,000 draws from the
  unigram^0.5 mixed with 10% uniform (the proposal of the tables' ``full-is`` row);
- ``fixed-is`` and ``adaptive-is``: importance sampling with the target's exact term, 1,000 samples from that fixed
  proposal, and the same with the proposal adapted towards the model's unigram (``objective.adapt_rate`` 0.02);
- ``cnnsoftmax``: CNN-softmax with a 32-dimensional correction (200 char-CNN filters over widths 1-5), trained by
  target sampling as the ``target-sampling`` row (exactly, it would run the CNN over 50k words every step: about 5x
  slower than the full softmax here); ``--rows cnnsoftmax-is`` adds it trained by the ``fixed-is`` estimator, as
  Jozefowicz et al. trained it (1M tokens, output_layers_v2_1000k.json at 9301821: test ppl 481.2, the full
  softmax's 386.8);
- ``slim-random`` and ``slim-clustered``: slim output vectors at 10% of the full matrix (K = 4 sub-vectors, 5,000 per
  position), their sub-vectors assigned at random or by k-means of ``full-ce``'s trained output vectors; both trained
  by the ``fixed-is`` estimator (exactly, a slim step costs more than the full softmax's on a CPU);
- with ``--all``, the older output layers and estimators, with the settings of their rows in the Gutenberg
  objectives table (configs/gutenberg_objectives.rows.toml, read from there): ``adaptive-ce``, ``class-ce``,
  ``tree-ce`` and the full softmax trained by ``full-is``, ``full-nce``, ``full-ns``, ``full-blackout`` and
  ``full-beta-nce``. That table
  trained them on 2M tokens; here they train on this benchmark's budget, so that one table holds every output layer
  and estimator of the project, measured the same way.

Evaluation is exact for every row (the full normalised distribution). Perplexity ratios are test perplexities over
``full-ce``'s of the same run. Speeds: once the runs are done, every row's training step is timed side by side on the
same batches (benchmarks.training_speed, ``--speed-steps`` x ``--speed-rounds``; slim-clustered is slim-random's
computation and is not timed again); ``*_speedup`` is a row's tokens/s over ``full-ce``'s. ``output_params`` counts the
output layer's parameters (the head's: CNN, projections, corrections and biases for cnnsoftmax). ``export_s`` and
``scorer_tokens_per_s``: each run exported to a bundle, one after the other, and the torch-free scorer's speed on the
test sentences, one thread, the rows taking turns ``--speed-rounds`` times (benchmarks.export_and_score).
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
