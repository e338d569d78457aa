"""End-to-end rescoring throughput on LibriSpeech dev_other 30-best -> rescore_throughput.json

    python -m benchmarks.rescore_throughput --threads 1

What ``lm-rescore nbest`` does with a weights file, timed by stage and without the score cache: read the lists
(I/O), neural LM scores (prefix-shared ``step`` graph), n-gram scores (KenLM), features and choices, write the
reranked list and report (I/O). Reports hypotheses per second and each stage's share of the time.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from benchmarks.common import DATA_DIR, RESULTS, write_result
from benchmarks.rescoring_models import GUTENBERG
from lmserve.core.atomic import atomic_write_text
from lmserve.rescoring.lmscores import compute
from lmserve.rescoring.nbest import read_nbest, write_nbest
from lmserve.rescoring.rescore import report, reranked, setup_from_record
from lmserve.rescoring.tune import read_weights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--weights", default=str(RESULTS / "rescore_librispeech_first_pass_plus_ours.weights.json"))
    args = parser.parse_args()
    setup = setup_from_record(read_weights(args.weights))
    models = GUTENBERG.models(args.threads)
    seconds: dict[str, float] = {}

    start = time.perf_counter()
    nbest = read_nbest(DATA_DIR / "librispeech-nbest" / "dev_other.tar.gz")
    seconds["read"] = time.perf_counter() - start
    lm_scores = compute(nbest, models.scorer, models.ngram, models.normalizer, seconds=seconds)
    start = time.perf_counter()
    out, chosen = reranked(nbest, setup, lm_scores)
    seconds["features_and_choice"] = time.perf_counter() - start
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        write_nbest(out, Path(tmp) / "dev_other.rescored.jsonl", "jsonl")
        rep = report(nbest, chosen, "wer", bootstrap_samples=1000)
        atomic_write_text(Path(tmp) / "report.json", json.dumps(rep, default=float))
    seconds["write_and_report"] = time.perf_counter() - start
    total = sum(seconds.values())
    hyps = nbest.num_hypotheses
    metrics = {
        "hypotheses_per_s": hyps / total,
        "lists_per_s": len(nbest) / total,
        "total_s": total,
        **{f"{k}_s": v for k, v in seconds.items()},
        **{f"{k}_share": v / total for k, v in seconds.items()},
        "io_share": (seconds["read"] + seconds["write_and_report"]) / total,
        "wer_rescored": rep["rescored"]["wer"],
    }
    write_result(
        "rescore_throughput", metrics, hypotheses=hyps, lists=len(nbest), threads=args.threads, weights=args.weights
    )
    print({k: round(v, 3) for k, v in metrics.items()})


if __name__ == "__main__":
    main()
