"""``lm-train prepare`` at scale: gutenberg-large and a 1B-token synthetic corpus -> prepare_scale.json

    python -m benchmarks.prepare_scale [--synthetic-tokens 1000000000] [--workers 2]

Prepares gutenberg-large (var/gutenberg-large, made first when missing) and a Zipf corpus of ``--synthetic-tokens``
tokens written outside the repository (deleted after), each in its own process, its peak memory with its workers'
sampled every 50 ms (benchmarks.common.run_measured). Figures: docs/benchmarks/training-at-scale.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import ROOT, gutenberg_books, run_measured, write_result

LOGS = ROOT / "var" / "logs"


def write_zipf_corpus(path: Path, tokens: int, types: int = 1_000_000, exponent: float = 1.2, seed: int = 0) -> float:
    """Write ``tokens`` words drawn from a Zipf law of ``exponent`` (one sentence per line) to ``path``; returns seconds taken.

    Vectorised: every word type is spelled once (base 26 of its rank, then a space) into one byte array, and a chunk
    of drawn ids becomes text by one gather from it; a newline is one more "word"."""
    start = time.perf_counter()
    rng = np.random.default_rng(seed)
    spellings = []
    for rank in range(types):  # a, b, ..., z, ba, bb, ...
        word = ""
        while True:
            rank, d = divmod(rank, 26)
            word = "abcdefghijklmnopqrstuvwxyz"[d] + word
            if rank == 0:
                break
        spellings.append(word + " ")
    spellings.append("\n")
    newline = types
    chars = np.frombuffer("".join(spellings).encode("ascii"), dtype=np.uint8)
    lengths = np.array([len(s) for s in spellings], dtype=np.int64)
    starts = np.cumsum(lengths) - lengths
    written = 0
    with path.open("wb") as f:
        while written < tokens:
            n = min(10_000_000, tokens - written)
            # rank = floor(u ** (-1 / (s - 1))): a discrete power law, P(rank >= k) = k ** -(s - 1), drawn five times
            # faster than numpy's zipf; draws past the last type are dropped
            u = rng.random(n + n // 4)
            u = u[u > (types + 1) ** (1 - exponent)][:n]
            ids = np.floor(u ** (1 / (1 - exponent))).astype(np.int64) - 1
            written += len(ids)
            ends = np.cumsum(rng.geometric(1 / 20, size=n // 10 + 10))
            ids = np.append(np.insert(ids, ends[ends < len(ids)], newline), newline)
            size = lengths[ids]
            offsets = np.cumsum(size) - size
            f.write(chars[np.repeat(starts[ids] - offsets, size) + np.arange(int(size.sum()))].tobytes())
    return time.perf_counter() - start


def prepare_command(args: list[str], workers: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "lmserve.training.cli",
        "prepare",
        *args,
        "--max-size",
        "100000",
        "--workers",
        str(workers),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--synthetic-tokens", type=int, default=1_000_000_000)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    books = gutenberg_books("gutenberg-large")
    out = ROOT / "var" / "prepared" / "gutenberg-large"
    shutil.rmtree(out, ignore_errors=True)
    large = run_measured(
        prepare_command(["--text-dir", str(books), "--out", str(out)], args.workers), LOGS / "prepare-large.log"
    )
    manifest = json.loads((out / "manifest.json").read_text())
    large_words = sum(split["words"] for split in manifest["splits"].values())
    print(f"gutenberg-large: {large}", flush=True)

    with tempfile.TemporaryDirectory(dir=ROOT.parent) as tmp:
        corpus = Path(tmp) / "zipf.txt"
        generation_s = write_zipf_corpus(corpus, args.synthetic_tokens)
        print(f"synthetic corpus written in {generation_s:.0f} s ({corpus.stat().st_size / 1e9:.1f} GB)", flush=True)
        synthetic_out = Path(tmp) / "prepared"
        synthetic = run_measured(
            prepare_command(["--train", str(corpus), "--out", str(synthetic_out)], args.workers),
            LOGS / "prepare-synthetic.log",
        )
        synthetic_manifest = json.loads((synthetic_out / "manifest.json").read_text())
        corpus_bytes = corpus.stat().st_size
    tokens = synthetic_manifest["splits"]["train"]["words"]
    print(f"synthetic: {synthetic}", flush=True)
    write_result(
        "prepare_scale",
        {
            "gutenberg_large_peak_rss_mb": large["peak_rss_mb"],
            "gutenberg_large_words_per_s": large_words / large["wall_s"],
            "gutenberg_large_wall_s": large["wall_s"],
            "gutenberg_large_words": large_words,
            "synthetic_tokens": tokens,
            "synthetic_peak_rss_mb": synthetic["peak_rss_mb"],
            "synthetic_tokens_per_s": tokens / synthetic["wall_s"],
            "synthetic_wall_s": synthetic["wall_s"],
        },
        workers=args.workers,
        gutenberg_large={
            "vocab": manifest["vocab"]["size"],
            "dtype": manifest["dtype"],
            "oov_rate": {s: i["oov_rate"] for s, i in manifest["splits"].items()},
        },
        synthetic={
            "types": 1_000_000,
            "zipf_exponent": 1.2,
            "bytes": corpus_bytes,
            "sentences": synthetic_manifest["splits"]["train"]["sentences"],
            "vocab": synthetic_manifest["vocab"]["size"],
            "dtype": synthetic_manifest["dtype"],
            "generation_s": generation_s,
        },
    )


if __name__ == "__main__":
    main()
