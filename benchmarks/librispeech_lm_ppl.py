"""Perplexity of a LibriSpeech LM pair on the dev references -> librispeech_lm_ppl.json

    python -m benchmarks.librispeech_lm_ppl --lm var/bundles/librispeech_lm --ngram var/ngrams/glarge_5gram.bin

The references of the ESPnet 30-best lists (``--tune``, default dev_clean, and ``--report``, default dev_other) go
through the ``librispeech`` preset, as the hypotheses do when they are rescored. Both models score the same tokens:
the bundle's words, every other word as ``<unk>`` (its probability counts, as in Kaldi's and SRILM's perplexities
with an open-vocabulary LM: the OOV rate is reported beside), and ``</s>`` after each sentence. For a subword bundle
a word's log-probability is the sum of its pieces', the perplexity is per word and nothing is out of vocabulary. The
per-word interpolation weight λ of the neural LM is the one with the lowest perplexity on the ``--tune`` references
and is applied unchanged to the ``--report`` references. ``--run`` adds the LM's training figures from its run's
results.json (tokens seen, training seconds summed over resumed segments, its own valid/test perplexity).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.common import DATA_DIR, write_result
from benchmarks.rescoring_models import best_lambda, perplexities, sentence_token_scores
from lmserve.rescoring.nbest import read_nbest
from lmserve.rescoring.rescore import LanguageModels, references_of

LISTS = DATA_DIR / "librispeech-nbest"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lm", type=Path, required=True, help="neural LM bundle")
    parser.add_argument("--ngram", type=Path, required=True, help="n-gram built --like the bundle")
    parser.add_argument("--tune", type=Path, default=LISTS / "dev_clean.tar.gz", help="λ is chosen on its references")
    parser.add_argument("--report", type=Path, default=LISTS / "dev_other.tar.gz")
    parser.add_argument("--run", type=Path, help="the LM's training run: its figures go in too")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--name", default="librispeech_lm_ppl")
    args = parser.parse_args()
    models = LanguageModels.load(args.lm, args.ngram, "librispeech", args.threads)
    scores = {}
    for key, path in (("dev_clean", args.tune), ("dev_other", args.report)):
        references = references_of(read_nbest(path), "wer")
        scores[key] = (*sentence_token_scores(references, models), len(references))
    lam = best_lambda(*scores["dev_clean"][:2])
    metrics, details = {"lambda": lam}, {}
    for key, (neural, ngram, oov, sentences) in scores.items():
        ppl = perplexities(neural, ngram, lam)
        metrics |= {
            f"{key}_ref_ppl": ppl["neural"],
            f"ngram_{key}_ref_ppl": ppl["ngram"],
            f"interp_{key}_ref_ppl": ppl["interpolated"],
            f"{key}_oov_rate": oov / (len(neural) - sentences),
        }
        details[key] = {"sentences": sentences, "tokens": len(neural), "oov": oov}
    if args.run:
        run = json.loads((args.run / "results.json").read_text())
        metrics |= {
            f"train_{key}": run[key] for key in ("tokens_seen", "train_seconds", "wall_seconds", "tokens_per_s")
        }
        metrics |= {"train_valid_ppl": run["valid"]["ppl"], "train_test_ppl": run["test"]["ppl"]}
    print("\n".join(f"{k}: {v:.4g}" for k, v in metrics.items()))
    write_result(
        args.name,
        metrics,
        details=details,
        lm=str(args.lm),
        ngram=str(args.ngram),
        run=args.run and str(args.run),
        lists={"tune": str(args.tune), "report": str(args.report)},
        targets={"dev_other_ref_ppl": "<= 120 (issue 19; 204 before)"},
    )


if __name__ == "__main__":
    main()
