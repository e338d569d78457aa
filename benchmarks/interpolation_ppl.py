"""Per-word linear interpolation of the neural LM and the 4-gram: perplexity on PTB test and held-out Gutenberg books
against each model alone -> interpolation_ppl.json

    python -m benchmarks.interpolation_ppl --threads 1

Both models score the same tokens (the n-gram is built like the bundle: same vocabulary, other words as ``<unk>``),
so the mixture is a distribution over the same words and its perplexity a true one. λ (the neural weight) is chosen on
the validation text and then applied to the test text. ``--skip-gutenberg`` leaves the Gutenberg pair out (its model
trains for about 40 minutes).
"""

from __future__ import annotations

import argparse

from benchmarks.common import write_result
from benchmarks.rescoring_models import GUTENBERG, PTB, best_lambda, perplexities, token_scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--skip-gutenberg", action="store_true")
    args = parser.parse_args()
    metrics, details = {}, {}
    for pair in [PTB] if args.skip_gutenberg else [PTB, GUTENBERG]:
        models = pair.models(args.threads, hypotheses=False)
        lam = best_lambda(*token_scores(pair.valid, models)[:2])
        neural, ngram, oov = token_scores(pair.test, models)
        ppl = perplexities(neural, ngram, lam)
        for name, value in ppl.items():
            metrics[f"{pair.name}_{name}"] = value
        metrics[f"{pair.name}_lambda"] = lam
        details[pair.name] = {
            "bundle": str(pair.bundle),
            "ngram": str(pair.ngram),
            "order": pair.order,
            "test_tokens": int(len(neural)),
            "test_oov": oov,
            "lambda_from": str(pair.valid),
        }
        print(pair.name, {k: round(v, 2) for k, v in ppl.items()}, "lambda", lam)
    write_result("interpolation_ppl", metrics, details=details)


if __name__ == "__main__":
    main()
