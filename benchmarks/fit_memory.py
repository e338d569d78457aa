"""Peak memory of ``lm-train fit`` on gutenberg-large: prepared (memory-mapped) vs read as text -> fit_memory.json

    python -m benchmarks.fit_memory [--baseline-commit 08351e5]

The same short run (the LibriSpeech LM's shape: sentence mode, 2x256 LSTM, adaptive softmax over 100,000 words;
stopped after 20,000 training tokens, one thread, validated on the 52,645-word test split) three ways, each in its own process
with the resident memory of its whole process tree sampled every 50 ms (benchmarks.common.run_measured), all of it
(VmRSS) and its anonymous part (RssAnon: without the file pages that the memory-mapped ids bring in, page cache that
the kernel shares and reclaims; each sentence a batch reads maps in the 64 kB around it):

- ``prepared``: data.train = var/prepared/gutenberg-large (``python -m benchmarks.prepare_scale`` makes it);
- ``text``: data.train = var/gutenberg-large/train.txt.gz (71.8M words) read by the code of ``--baseline-commit``
  (before prepared datasets: every token a Python int in a list, then a copy as an array), from a git worktree;
- ``*_tiny_model``: the first two again with a 1x16 LSTM, so that the peak is torch and the data alone;
- ``text_now``: the same text with today's code, which prepares it into RUN/data first (one process) and then reads
  that like the first run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

from benchmarks.common import ROOT, run_measured, write_result

LOGS = ROOT / "var" / "logs"
RUNS = ROOT / "var" / "runs" / "fit_memory"
SETS = [
    'data.mode="sentence"',
    "data.max_sentence_len=80",
    "vocab.max_size=100000",
    "model.embedding_size=256",
    "model.hidden_size=256",
    'head.type="adaptive"',
    "head.cutoffs=[2000,10000]",
    "train.max_tokens=20000",
    "train.threads=1",
    "train.epochs=1",
]


# the same runs with a model too small to matter (1x16 LSTM, 16-dim embeddings), so that what is left is torch and the data
TINY = ["model.embedding_size=16", "model.hidden_size=16", "model.layers=1", "head.div_value=2.0"]


def fit(root, run, train: str, valid: str, test: str, extra: list[str] = ()) -> dict:
    config = [f'data.train="{train}"', f'data.valid="{valid}"', f'data.test="{test}"', *SETS, *extra]
    # the baseline commit predates the lmserve package: its CLI is training.cli (lmserve.training.cli would be the
    # editable install of today's code, not the worktree's)
    module = "lmserve.training.cli" if (root / "lmserve").is_dir() else "training.cli"
    command = [sys.executable, "-m", module, "fit", "configs/gutenberg_rescore.toml", "--out", str(run)]
    command += [arg for value in config for arg in ("--set", value)]
    shutil.rmtree(run, ignore_errors=True)
    return run_measured(
        command, LOGS / f"fit_memory-{run.name}.log", cwd=root, env={**os.environ, "PYTHONPATH": str(root)}
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline-commit", default="08351e5")
    args = parser.parse_args()
    prepared = ROOT / "var" / "prepared" / "gutenberg-large"
    books = ROOT / "var" / "gutenberg-large"
    if not (prepared / "manifest.json").exists():
        raise SystemExit(f"{prepared}: missing; run python -m benchmarks.prepare_scale first")
    splits = [str(prepared), f"{prepared}:test", f"{prepared}:test"]
    results = {"prepared": fit(ROOT, RUNS / "prepared", *splits)}
    results["prepared_tiny_model"] = fit(ROOT, RUNS / "prepared_tiny", *splits, TINY)
    print(results, flush=True)
    text = [str(books / "train.txt.gz"), str(books / "test.txt.gz"), str(books / "test.txt.gz")]
    worktree = ROOT.parent / "wt-fit-memory-baseline"
    subprocess.run(
        ["git", "worktree", "add", "--force", "--detach", str(worktree), args.baseline_commit], cwd=ROOT, check=True
    )
    try:
        (worktree / ".venv").symlink_to(ROOT / ".venv")
        results["text"] = fit(worktree, RUNS / "text", *text)
        results["text_tiny_model"] = fit(worktree, RUNS / "text_tiny", *text, TINY)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=ROOT, check=True)
    print(results, flush=True)
    results["text_now"] = fit(ROOT, RUNS / "text_now", *text)
    write_result(
        "fit_memory",
        {
            "prepared_rss_mb": results["prepared"]["peak_rss_mb"],
            "text_rss_mb": results["text"]["peak_rss_mb"],
            "prepared_vs_text": results["prepared"]["peak_rss_mb"] / results["text"]["peak_rss_mb"],
            "text_now_rss_mb": results["text_now"]["peak_rss_mb"],
            "prepared_tiny_model_rss_mb": results["prepared_tiny_model"]["peak_rss_mb"],
            "text_tiny_model_rss_mb": results["text_tiny_model"]["peak_rss_mb"],
            "prepared_vs_text_tiny_model": results["prepared_tiny_model"]["peak_rss_mb"]
            / results["text_tiny_model"]["peak_rss_mb"],
            # the same peaks without file pages: what a memory map maps in is page cache, shared and reclaimable
            "prepared_anon_mb": results["prepared"]["peak_anon_mb"],
            "text_anon_mb": results["text"]["peak_anon_mb"],
            "prepared_vs_text_anon": results["prepared"]["peak_anon_mb"] / results["text"]["peak_anon_mb"],
            "prepared_tiny_model_anon_mb": results["prepared_tiny_model"]["peak_anon_mb"],
        },
        runs=results,
        baseline_commit=args.baseline_commit,
        overrides=SETS,
    )


if __name__ == "__main__":
    main()
