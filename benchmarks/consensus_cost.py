"""What the consensus feature costs next to the neural LM, on the same 30-best lists -> consensus_cost.json

    python -m benchmarks.consensus_cost --lm var/bundles/english_lm [--lists 300] [--threads 2]

The first ``--lists`` utterances of LibriSpeech dev_other (ESPnet's 30-best lists): the seconds to compute
``consensus_wer`` (minimum Bayes risk with 1 - WER, ``rescoring.consensus``) and ``consensus_wer@score`` for every
hypothesis, against the seconds the neural LM takes to score the same hypotheses (``rescoring.lmscores.compute``, no
cache), each the best of three runs in this one process.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchmarks.common import DATA_DIR, write_result
from lmserve.rescoring.features import feature_matrices
from lmserve.rescoring.lmscores import compute
from lmserve.rescoring.nbest import NBestList, read_nbest
from lmserve.rescoring.rescore import LanguageModels

FEATURES = ("consensus_wer", "consensus_wer@score")


def best_of(runs: int, work) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lm", type=Path, required=True)
    parser.add_argument("--normalize", default="librispeech")
    parser.add_argument("--lists", type=int, default=300)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    whole = read_nbest(DATA_DIR / "librispeech-nbest" / "dev_other.tar.gz")
    nbest = NBestList(whole.entries[: args.lists], f"{whole.name}[:{args.lists}]")
    models = LanguageModels.load(args.lm, None, args.normalize, args.threads)
    neural = best_of(3, lambda: compute(nbest, models.scorer, None, models.normalizer))
    consensus = {f: best_of(3, lambda f=f: feature_matrices(nbest, [f])) for f in FEATURES}
    write_result(
        "consensus_cost",
        {
            "consensus_s": consensus["consensus_wer"],
            "consensus_weighted_s": consensus["consensus_wer@score"],
            "neural_lm_s": neural,
            "consensus_over_neural": consensus["consensus_wer"] / neural,
        },
        lists=len(nbest),
        hypotheses=nbest.num_hypotheses,
        lm=str(args.lm),
        threads=args.threads,
    )


if __name__ == "__main__":
    main()
