"""Cross-validated rescoring of the small sets: WSJ dev 5-best (2 folds, WER) -> rescore_wsj_dev.json and Joshua bn-en
k-best (5 folds, BLEU) -> rescore_joshua.json

    python -m benchmarks.rescore_cv --set wsj --threads 1
    python -m benchmarks.rescore_cv --set joshua --threads 1

Both use the PTB pair (benchmarks/rescoring_models.py) unless ``--lm``/``--ngram`` name another (for example an
open-vocabulary model: ``--lm var/bundles/librispeech_lm_subword --ngram var/ngrams/glarge_5gram.bin --normalize
librispeech --heldout var/gutenberg-large/valid.txt.gz``): hypotheses through the ``ptb`` preset (``--normalize``),
neural LM and n-gram log-probabilities, their per-word interpolation with λ fixed from the validation perplexity of
the LM's own held-out text (``--heldout``), length and OOV count, next to the decoder's own score (fixed weight 1). Each fold's weights are tuned on the other folds only; the rescored
figure pools the held-out choices. The weights tuned on the whole set are saved next to the result.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from benchmarks.common import DATA_DIR, RESULTS, write_result
from benchmarks.rescoring_models import PTB, best_lambda, token_scores
from lmserve.rescoring import metrics
from lmserve.rescoring.nbest import read_nbest
from lmserve.rescoring.rescore import LanguageModels, Setup, references_of, setup_record, tune
from lmserve.rescoring.tune import write_weights

SETS = {
    "wsj": {
        "list": DATA_DIR / "wsj-nbest" / "dev.json",
        "references": None,
        "metric": "wer",
        "folds": 2,
        "base": "score",
        "result": "rescore_wsj_dev",
    },
    "joshua": {
        "list": DATA_DIR / "joshua-bn-en" / "output.gold",
        "references": [DATA_DIR / "joshua-bn-en" / f"reference.en.{k}" for k in range(4)],
        "metric": "bleu",
        "folds": 5,
        "base": "total",
        "result": "rescore_joshua",
    },
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--set", choices=sorted(SETS), required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--restarts", type=int, default=5)
    parser.add_argument("--features", default="neural,ngram,interp,length,oov", help="ours, next to the decoder's")
    parser.add_argument("--lm", type=Path, help="neural LM bundle (default: the PTB pair's)")
    parser.add_argument("--ngram", type=Path, help="n-gram built --like --lm")
    parser.add_argument("--normalize", default="ptb", help="text preset of the hypotheses (default: %(default)s)")
    parser.add_argument("--heldout", type=Path, help="the LM's held-out text that fixes λ (default: PTB valid)")
    args = parser.parse_args()
    if args.lm and not (args.ngram and args.heldout):
        parser.error("--lm needs --ngram and --heldout")
    spec = SETS[args.set]
    nbest = read_nbest(spec["list"], references=spec["references"])
    if args.lm:
        heldout_models = LanguageModels.load(args.lm, args.ngram, None, args.threads)
        lam = best_lambda(*token_scores(args.heldout, heldout_models)[:2])
        models = LanguageModels.load(args.lm, args.ngram, args.normalize, args.threads)
    else:
        lam = best_lambda(*token_scores(PTB.valid, PTB.models(args.threads, hypotheses=False))[:2])
        models = PTB.models(args.threads)
    cache = RESULTS.parent.parent / "var" / "cache" / f"{args.set}.lmscores.jsonl"
    lm_scores = models.scores(nbest, cache, progress=True)
    setup = Setup.parse(f"{spec['base']},{args.features}")
    tuned = tune(
        nbest, setup, lm_scores, spec["metric"], fixed=spec["base"], lambdas=(lam,), folds=spec["folds"],
        restarts=args.restarts,
    )  # fmt: skip
    cv = tuned.cross_validation
    weights_path = RESULTS / f"{spec['result']}.weights.json"
    write_weights(weights_path, tuned.result, setup_record(models, tuned.setup), cross_validation=cv)

    texts = [[h.text for h in e.hypotheses] for e in nbest]
    refs = references_of(nbest, spec["metric"])
    first = metrics.pick(texts, np.zeros(len(texts), dtype=np.int64))
    rescored = metrics.pick(texts, np.array(cv["chosen"]))
    bootstrap = metrics.paired_bootstrap(spec["metric"], refs, first, rescored, samples=1000)
    oov_words = sum(s.oov for row in lm_scores for s in row)
    words = sum(len(h.text.split()) for e in nbest for h in e.hypotheses)
    if spec["metric"] == "wer":
        oracle = metrics.pick(texts, metrics.oracle_wer(refs, texts))
        figures = {
            "wer_1best": metrics.wer_report(refs, first)["wer"],
            "wer_rescored": metrics.wer_report(refs, rescored)["wer"],
            "wer_oracle": metrics.wer_report(refs, oracle)["wer"],
        }
        figures["relative_reduction"] = 1 - figures["wer_rescored"] / figures["wer_1best"]
        signature = metrics.WER_SIGNATURE
    else:
        oracle = metrics.pick(texts, metrics.oracle_bleu(refs, texts))
        reports = {
            name: metrics.bleu_report(refs, hyps)
            for name, hyps in (("1best", first), ("rescored", rescored), ("oracle", oracle))
        }
        figures = {f"bleu_{name}": r["bleu"] for name, r in reports.items()}
        figures["bleu_gain"] = figures["bleu_rescored"] - figures["bleu_1best"]
        signature = reports["1best"]["signature"]
    write_result(
        spec["result"],
        {**figures, "bootstrap_p": bootstrap["p_value"], "lambda": lam, "oov_rate": oov_words / max(words, 1)},
        protocol=f"{spec['folds']}-fold cross-validation over utterances; weights tuned on the other folds only; "
        f"decoder score '{spec['base']}' fixed at 1",
        features=list(tuned.setup.features),
        fold_metrics=cv["fold_metrics"],
        fold_weights=cv["fold_weights"],
        bootstrap=bootstrap,
        signature=signature,
        weights_file=str(weights_path.relative_to(RESULTS.parent.parent)),
        models=setup_record(models, tuned.setup),
    )
    print({k: round(v, 4) for k, v in figures.items()}, "p", bootstrap["p_value"])


if __name__ == "__main__":
    main()
