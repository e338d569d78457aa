"""What a trained run costs on its way to serving: the seconds of ``export_bundle`` and the torch-free scorer's speed.

Both are measured on one thread (torch's for the export, ONNX Runtime's for the scorer), in this process, one run
after the other, so that the figures of several runs compare. The export is timed whole, as ``lm-train export`` runs
it: the ONNX graphs, the exact evaluation of a validation text and the parity check of the graphs against PyTorch
on it (the same text for every run, whatever the run's config names: a run moved from another checkout still
exports); a first, untimed export pays the exporter's one-off start-up, so that the first run timed does not.
The scorer scores a fixed text sentence by sentence (``Scorer.score``: a normalised bundle's exact log-probabilities,
a self-normalised one's cheap scores, as each is served), the runs taking turns round after round
(``benchmarks.common.time_interleaved``).
"""

from __future__ import annotations

import gzip
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import time_interleaved
from lmserve.rescoring.scorer import Scorer
from lmserve.training.export import export_bundle


def export_and_score(runs: dict[str, Path], heldout: str, text: Path, rounds: int = 3) -> dict[str, dict]:
    """``runs``: name -> run folder; ``heldout``: the export's validation data (a text file, or a prepared dataset of
    the runs' vocabulary); ``text``: the scorer's, gzipped, one sentence a line. Returns name -> ``export_s`` (wall
    seconds of ``export_bundle``) and ``scorer_tokens_per_s`` (words and ``</s>`` scored per second)."""
    torch.set_num_threads(1)
    with gzip.open(text, "rt", encoding="utf-8") as f:
        sentences = [line.strip() for line in f if line.strip()]
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if runs:
            export_bundle(next(iter(runs.values())), Path(tmp) / "warm-up", heldout=heldout)
        for name, run in runs.items():
            start = time.perf_counter()
            export_bundle(run, Path(tmp) / name, heldout=heldout)
            out[name] = {"export_s": time.perf_counter() - start}
        scorers = {name: Scorer(Path(tmp) / name, threads=1) for name in runs}
        tokens = {name: sum(len(s.token_logprobs) for s in scorer.score(sentences)) for name, scorer in scorers.items()}
        seconds = time_interleaved({name: lambda s=s: s.score(sentences) for name, s in scorers.items()}, rounds)
    for name in runs:
        out[name]["scorer_tokens_per_s"] = tokens[name] / seconds[name]
    return out
