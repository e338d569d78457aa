"""Which tuning recipe transfers: each recipe tuned on one list, applied to another, and cross-validated over both
-> NAME.json (default rescore_recipes.json)

    python -m benchmarks.rescore_recipes --tune DATA/dev_clean.tar.gz --report DATA/dev_other.tar.gz \\
        --lm var/bundles/demo --ngram var/ngrams/demo_3gram.bin --normalize ptb --cache-dir var/rescore

Per recipe (``RECIPES``; base: the first pass ``score`` fixed at 1): the tune list's WER before and after tuning,
the report list's with those weights, and 5-fold CV over both lists (guards nested, λ fixed at the tune list's
choice). The recipe is chosen by the CV, not by the report list; ``lm-rescore evaluate`` judges one recipe the same
way on any lists.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.common import ROOT, write_result
from benchmarks.rescore_protocol import list_name
from lmserve.rescoring.evaluation import pooled
from lmserve.rescoring.nbest import read_nbest
from lmserve.rescoring.rescore import LanguageModels, Setup, tune, tuning_set
from lmserve.rescoring.tune import cross_validate, guarded_tuner, parse_bounds

LAMBDAS = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
RECIPES = {  # name: features next to score, λ values, bounds, penalty, restarts, guard (folds of the tune list)
    "six_features_before": ("neural,ngram,interp,length,oov", (0.5,), "", 0.0, 2, 0),
    "neural_ngram_length": ("neural,ngram,length", (0.5,), "", 0.0, 2, 0),
    "interp_length": ("interp,length", LAMBDAS, "", 0.0, 2, 0),
    "interp_length_bounded": ("interp,length", LAMBDAS, "interp=0:", 0.0, 2, 0),
    "interp_length_bounded_penalty": ("interp,length", LAMBDAS, "interp=0:", 0.05, 2, 0),
    "interp_length_bounded_10_restarts": ("interp,length", LAMBDAS, "interp=0:", 0.0, 10, 0),
    "interp_length_bounded_guarded": ("interp,length", LAMBDAS, "interp=0:", 0.0, 10, 5),
    # a closed vocabulary scores every unknown word as <unk>, whose probability is the mass of all of them: the count
    # of such words, its weight at most 0, is the OOV penalty of speech toolkits
    "interp_length_oov_bounded_10_restarts": ("interp,length,oov", LAMBDAS, "interp=0:,oov=:0", 0.0, 10, 0),
    "interp_length_oov_bounded_guarded": ("interp,length,oov", LAMBDAS, "interp=0:,oov=:0", 0.0, 10, 5),
    # the first pass's own LM score (ESPnet's `lm`) re-weighted beside ours: its weight in `score` was set for search;
    # and alone, with no LM of ours: the bar ours must clear (λ is not used without interp)
    "lm_interp_length_oov_bounded_10_restarts": ("lm,interp,length,oov", LAMBDAS, "interp=0:,oov=:0", 0.0, 10, 0),
    "lm_length_no_lm_of_ours": ("lm,length", (0.5,), "", 0.0, 10, 0),
    # every part of the first pass re-weighted (score = 0.6 decoder + 0.4 ctc + 0.6 lm fixed at 1, ctc and lm free):
    # with ours, and without it (the bar)
    "ctc_lm_interp_length_oov_bounded_10_restarts": (
        "ctc,lm,interp,length,oov",
        LAMBDAS,
        "interp=0:,oov=:0",
        0.0,
        10,
        0,
    ),
    "ctc_lm_length_no_lm_of_ours": ("ctc,lm,length", (0.5,), "", 0.0, 10, 0),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tune", type=Path, required=True)
    parser.add_argument("--report", type=Path, required=True)
    parser.add_argument("--lm", type=Path, required=True)
    parser.add_argument("--ngram", type=Path, required=True)
    parser.add_argument("--normalize", default="librispeech")
    parser.add_argument("--name", default="rescore_recipes")
    parser.add_argument("--folds", type=int, default=5, help="cross-validation folds over the union")
    parser.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated names (default: all)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cache-dir", type=Path)
    args = parser.parse_args()
    cache = args.cache_dir or ROOT / "var" / "cache" / f"{args.lm.name}__{args.ngram.stem}"
    models = LanguageModels.load(args.lm, args.ngram, args.normalize, args.threads)
    lists = []
    for path in (args.tune, args.report):
        nbest = read_nbest(path)
        lists.append((nbest, models.scores(nbest, cache / f"{list_name(path)}.lmscores.jsonl", progress=True)))
    (dev, dev_scores), (other, other_scores) = lists
    rows = {}
    for name in args.recipes.split(","):
        features, lambdas, bounds_text, penalty, restarts, guard = RECIPES[name]
        search = {"restarts": restarts, "bounds": parse_bounds(bounds_text), "penalty": penalty}
        setup = Setup.parse(f"score,{features}")
        t = tune(dev, setup, dev_scores, "wer", "score", lambdas, guard, require_folds=guard, **search)
        report_wer = tuning_set(other, t.setup, other_scores, "wer").evaluate(
            [t.result.weights[f] for f in t.setup.features]
        )
        union = pooled([tuning_set(nbest, t.setup, scores, "wer") for nbest, scores in lists])
        tuner = guarded_tuner(guard, guard) if guard else None
        cv = cross_validate(union, k=args.folds, fixed="score", tuner=tuner, **search).summary()
        rows[name] = {
            "features": f"score,{features}",
            "lambdas": list(lambdas),
            "bounds": bounds_text,
            "penalty": penalty,
            "restarts": restarts,
            "guard_folds": guard,
            "lambda": t.setup.lam,
            "adopted": t.adopted,
            "weights": t.result.weights,
            f"wer_{list_name(args.tune)}_before": t.result.baseline_metric,
            f"wer_{list_name(args.tune)}_tuned": t.result.dev_metric,
            f"wer_{list_name(args.report)}": report_wer,
            "restart_weight_spread": t.result.weight_spread,
            "cv": {k: v for k, v in cv.items() if k != "fold_weights"},
        }
        print(
            f"{name:36s} {t.result.baseline_metric:.3f} -> {t.result.dev_metric:.3f}, {list_name(args.report)} "
            f"{report_wer:.3f}; CV {cv['baseline_metric']:.3f} -> {cv['heldout_metric']:.3f} "
            f"({cv['folds_improved']}/{cv['folds']} folds gain)",
            flush=True,
        )
    write_result(
        args.name,
        {name: {k: v for k, v in row.items() if k.startswith("wer_")} for name, row in rows.items()},
        protocol=f"tuned on {list_name(args.tune)}, applied to {list_name(args.report)}; {args.folds}-fold CV over "
        "both (λ fixed at the tune list's choice; guarded recipes nested)",
        recipes=rows,
        models=models.paths,
    )


if __name__ == "__main__":
    main()
