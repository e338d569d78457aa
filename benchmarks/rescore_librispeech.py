"""LibriSpeech dev_other 30-best rescoring with weights tuned on dev_clean -> rescore_librispeech_dev_other.json

    python -m benchmarks.rescore_librispeech --threads 1

The Gutenberg pair (benchmarks/rescoring_models.py: 2x256 adaptive-softmax LSTM and 4-gram, both on the prepared
Gutenberg books, in-domain for LibriSpeech) adds its features to two first-pass scores:

- AM only: ``am = 0.6*decoder + 0.4*ctc`` (ESPnet's score without its Transformer LM), plus ours;
- full first pass: ``score = am + 0.6*lm`` as the decoder ranked, plus ours.

Weights and λ are tuned on dev_clean only (Powell and Nelder-Mead with restarts) and applied to dev_other unchanged;
the weights files are saved next to the result, so ``lm-rescore nbest dev_other.tar.gz --weights FILE`` repeats it.
"""

from __future__ import annotations

import argparse

from benchmarks.common import DATA_DIR, RESULTS, ROOT, write_result
from benchmarks.rescoring_models import GUTENBERG
from lmserve.rescoring import metrics
from lmserve.rescoring.nbest import read_nbest
from lmserve.rescoring.rescore import Setup, references_of, report, setup_record, tune
from lmserve.rescoring.tune import write_weights

AM = "am=0.6*decoder+0.4*ctc"
PROTOCOLS = {"am_plus_ours": "am", "first_pass_plus_ours": "score"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--restarts", type=int, default=5)
    parser.add_argument("--features", default="neural,ngram,interp,length,oov", help="ours, next to the first pass")
    parser.add_argument("--lambdas", default="0.2,0.4,0.5,0.6,0.8")
    args = parser.parse_args()
    lists = DATA_DIR / "librispeech-nbest"
    dev, test = read_nbest(lists / "dev_clean.tar.gz"), read_nbest(lists / "dev_other.tar.gz")
    models = GUTENBERG.models(args.threads)
    cache = ROOT / "var" / "cache"
    dev_scores = models.scores(dev, cache / "dev_clean.lmscores.jsonl", progress=True)
    test_scores = models.scores(test, cache / "dev_other.lmscores.jsonl", progress=True)

    refs = references_of(test, "wer")
    texts = [[h.text for h in e.hypotheses] for e in test]
    baseline = {
        "am_only": Setup.parse("am", [AM]),
        "first_pass": Setup.parse("score"),
    }
    figures = {}
    for name, setup in baseline.items():
        setup.weights = {setup.features[0]: 1.0}
        figures[f"wer_{name}"] = metrics.wer_report(refs, metrics.pick(texts, setup.choose(test, None)))["wer"]
    figures["wer_oracle"] = metrics.wer_report(refs, metrics.pick(texts, metrics.oracle_wer(refs, texts)))["wer"]
    details = {}
    for name, base in PROTOCOLS.items():
        setup = Setup.parse(f"{base},{args.features}", [AM] if base == "am" else [])
        lambdas = [float(x) for x in args.lambdas.split(",")]
        tuned = tune(dev, setup, dev_scores, "wer", fixed=base, lambdas=lambdas, restarts=args.restarts)
        weights_path = RESULTS / f"rescore_librispeech_{name}.weights.json"
        write_weights(weights_path, tuned.result, setup_record(models, tuned.setup))
        chosen = tuned.setup.choose(test, test_scores)
        rep = report(test, chosen, "wer")
        figures[f"wer_{name}"] = rep["rescored"]["wer"]
        figures[f"{name}_bootstrap_p_vs_first_pass"] = rep["bootstrap"]["p_value"]
        details[name] = {
            "dev_clean_wer_before": tuned.result.baseline_metric,
            "dev_clean_wer_tuned": tuned.result.dev_metric,
            "dev_clean_wer_by_lambda": {str(k): v for k, v in tuned.by_lambda.items()},
            "lambda": tuned.setup.lam,
            "weights": tuned.result.weights,
            "weights_file": str(weights_path.relative_to(ROOT)),
            "tuning_runs_spread": tuned.result.spread,
            "dev_other": {k: rep[k] for k in ("rescored", "bootstrap", "changed_choices")},
        }
        print(name, round(figures[f"wer_{name}"], 3), "dev_clean", round(tuned.result.dev_metric, 3))
    oov = sum(s.oov for row in test_scores for s in row) / max(
        1, sum(len(s.neural) - 1 for row in test_scores for s in row)
    )
    write_result(
        "rescore_librispeech_dev_other",
        {**figures, "oov_rate": oov},
        protocol="weights and lambda tuned on dev_clean, applied to dev_other; am = 0.6*decoder + 0.4*ctc",
        details=details,
        signature=metrics.WER_SIGNATURE,
        models=setup_record(models, Setup([])),
    )
    print({k: round(v, 3) for k, v in figures.items()})


if __name__ == "__main__":
    main()
