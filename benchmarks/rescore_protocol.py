"""The LibriSpeech rescoring protocol: tune on one list, report on others -> NAME_LIST.json per list, NAME_cv.json

    python -m benchmarks.rescore_protocol --tune DATA/dev_clean.tar.gz --report DATA/dev_other.tar.gz [more lists] \\
        --lm var/bundles/demo --ngram var/ngrams/demo_3gram.bin --normalize ptb --name rescore_protocol_demo \\
        [--cv 5 --cv-with DATA/dev_other.tar.gz]

Each system (``--system NAME=BASE``) is its base score fixed at 1 plus the recipe (``--features``, λ from
``--lambdas``), tuned on ``--tune`` alone (``--folds K``: with ``rescoring.tune``'s guard) and applied unchanged to
every ``--report`` list, beside the 1-best, each base alone, the base with the list's own LM re-weighted
(``--retune``), the oracle and paired bootstraps; ``--cv K`` cross-validates the recipe over ``--tune`` and
``--cv-with`` (guard nested, λ fixed at the tune list's). LM scores are cached in ``--cache-dir``. The protocol for
any lists is ``lm-rescore evaluate`` (``rescoring.evaluation``); this script keeps these result files' layout.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from benchmarks.common import RESULTS, ROOT, write_result
from lmserve.rescoring import metrics
from lmserve.rescoring.evaluation import pooled
from lmserve.rescoring.nbest import read_nbest
from lmserve.rescoring.rescore import LanguageModels, Setup, references_of, report, setup_record, tune, tuning_set
from lmserve.rescoring.tune import (
    cross_validate,
    guarded_tuner,
    parse_bounds,
    weight_spread,
    write_weights,
)

AM = "am=0.6*decoder+0.4*ctc"
RECIPE = "interp,length,oov"  # next to each system's base score
# an LM weight below 0 rewards what the LM finds unlikely (a length proxy, not an LM); an OOV weight above 0 rewards
# words the LM does not know (the <unk> probability is the mass of all of them)
RECIPE_BOUNDS = "interp=0:,oov=:0"


def list_name(path: Path) -> str:
    return path.name.split(".")[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tune", type=Path, required=True, help="the list weights are tuned on (e.g. dev_clean)")
    parser.add_argument("--report", type=Path, nargs="*", default=[], help="lists the tuned weights are applied to")
    parser.add_argument("--lm", type=Path, required=True, help="neural LM bundle")
    parser.add_argument("--ngram", type=Path, required=True, help="n-gram (KenLM binary or ARPA)")
    parser.add_argument(
        "--normalize", default="librispeech", help="text preset of the hypotheses (default: %(default)s)"
    )
    parser.add_argument("--name", default="rescore_protocol", help="result files NAME_LIST.json (default: %(default)s)")
    parser.add_argument(
        "--system",
        action="append",
        metavar="NAME=BASE",
        help="a system: its base score (fixed at 1) plus the recipe (default: first_pass_plus_ours=score and "
        "am_plus_ours=am)",
    )
    parser.add_argument("--define", action="append", default=[AM], metavar="NAME=EXPR", help=f"default: {AM}")
    parser.add_argument("--features", default=RECIPE, help="the recipe's features (default: %(default)s)")
    parser.add_argument("--bounds", default=RECIPE_BOUNDS, help="weight limits (default: %(default)s)")
    parser.add_argument("--penalty", type=float, default=0.0)
    parser.add_argument("--lambdas", default="0.2,0.3,0.4,0.5,0.6,0.7,0.8")
    parser.add_argument("--restarts", type=int, default=10)
    parser.add_argument("--folds", type=int, default=0, help="the guard's folds of the tune list (0: no guard)")
    parser.add_argument("--require-folds", type=int, help="folds that must gain (default: all of --folds)")
    parser.add_argument("--retune", default="lm", help="the list's own LM score, re-weighted as a reference ('' off)")
    parser.add_argument("--cv", type=int, default=0, help="K-fold CV of the recipe over --tune and --cv-with")
    parser.add_argument("--cv-with", type=Path, nargs="*", default=[], help="dev lists pooled with --tune for --cv")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cache-dir", type=Path, help="LM score caches (default: var/cache/BUNDLE__NGRAM)")
    args = parser.parse_args()
    if not args.report and not args.cv:
        parser.error("nothing to do: give --report lists and/or --cv")
    systems = dict(s.split("=", 1) for s in (args.system or ["first_pass_plus_ours=score", "am_plus_ours=am"]))
    require = args.folds if args.require_folds is None else args.require_folds
    bounds = parse_bounds(args.bounds)
    lambdas = [float(x) for x in args.lambdas.split(",")]
    search = {"restarts": args.restarts, "bounds": bounds, "penalty": args.penalty}
    cache = args.cache_dir or ROOT / "var" / "cache" / f"{args.lm.name}__{args.ngram.stem}"
    models = LanguageModels.load(args.lm, args.ngram, args.normalize, args.threads)
    lists = {}
    for path in dict.fromkeys([args.tune, *args.report, *args.cv_with]):
        nbest = read_nbest(path)
        lists[path] = (nbest, models.scores(nbest, cache / f"{list_name(path)}.lmscores.jsonl", progress=True))

    dev, dev_scores = lists[args.tune]
    tuned = {}
    for name, base in systems.items():
        setup = Setup.parse(f"{base},{args.features}", args.define)
        tuned[name] = tune(
            dev, setup, dev_scores, "wer", fixed=base, lambdas=lambdas, folds=args.folds, require_folds=require,
            **search,
        )  # fmt: skip
        weights = RESULTS / f"{args.name}_{name}.weights.json"
        write_weights(weights, tuned[name].result, setup_record(models, tuned[name].setup))
        print(f"{name}: adopted {tuned[name].adopted}, weights {tuned[name].result.weights}")
    retuned = None
    if args.retune:
        retuned = tune(dev, Setup.parse(f"score,{args.retune}"), None, "wer", fixed="score", restarts=args.restarts)

    for path in args.report:
        nbest, scores = lists[path]
        refs = references_of(nbest, "wer")
        texts = [[h.text for h in e.hypotheses] for e in nbest]
        figures = {"wer_first_pass": _wer(refs, texts, np.zeros(len(texts), dtype=np.int64))}
        figures["wer_oracle"] = _wer(refs, texts, metrics.oracle_wer(refs, texts))
        details = {}
        for name, base in systems.items():
            alone = Setup.parse(base, args.define)
            alone.weights = {base: 1.0}
            figures[f"wer_{base}_alone"] = _wer(refs, texts, alone.choose(nbest, None))
            t = tuned[name]
            rep = report(nbest, t.setup.choose(nbest, scores), "wer")
            figures[f"wer_{name}"] = rep["rescored"]["wer"]
            figures[f"{name}_bootstrap_p_vs_first_pass"] = rep["bootstrap"]["p_value"]
            details[name] = _details(t, rep, f"{args.name}_{name}.weights.json")
        if retuned is not None:
            rep = report(nbest, retuned.setup.choose(nbest, None), "wer")
            figures[f"wer_first_pass_retuned_{args.retune}"] = rep["rescored"]["wer"]
            details[f"first_pass_retuned_{args.retune}"] = {"weights": retuned.result.weights, **_dev(retuned)}
        write_result(
            f"{args.name}_{list_name(path)}",
            figures,
            protocol=f"weights and λ tuned on {list_name(args.tune)} only, applied unchanged to {list_name(path)}; "
            f"recipe: base (fixed 1) + {args.features}, bounds {args.bounds or 'none'}, penalty {args.penalty}, "
            f"{args.restarts} restarts per method; "
            + (
                f"kept only when {require} of {args.folds} folds of {list_name(args.tune)} gain under cross-validation"
                if args.folds > 1
                else "no guard"
            ),
            systems=systems,
            definitions=args.define,
            details=details,
            signature=metrics.WER_SIGNATURE,
            models=setup_record(models, Setup([])),
        )
        print(list_name(path), {k: round(v, 3) for k, v in figures.items()})

    if args.cv:
        cross_validation(args, systems, lists, tuned, require, search)


def cross_validation(args, systems: dict, lists: dict, tuned: dict, require: int, search: dict) -> None:
    """K-fold CV of the guarded recipe over the pooled dev lists, one system after another (module docstring)."""
    dev_lists = [args.tune, *args.cv_with]
    per_system = {}
    for name, base in systems.items():
        t = tuned[name]
        data = pooled([tuning_set(lists[p][0], t.setup, lists[p][1], "wer") for p in dev_lists])
        tuner = guarded_tuner(args.folds, require) if args.folds > 1 else None
        cv = cross_validate(data, k=args.cv, fixed=base, tuner=tuner, **search)
        summary = cv.summary()
        per_system[name] = {**summary, "lambda": t.setup.lam, "spread_of_gains": _spread(summary["fold_gains"])}
        print(name, f"CV {cv.baseline_metric:.3f} -> {cv.heldout_metric:.3f}, {cv.folds_improved}/{args.cv} improved")
    first = per_system[next(iter(systems))]
    write_result(
        f"{args.name}_cv",
        {
            "folds": first["folds"],
            "folds_improved": first["folds_improved"],
            "wer_baseline": first["baseline_metric"],
            "wer_heldout": first["heldout_metric"],
            "gain_mean": first["spread_of_gains"]["mean"],
            "gain_std": first["spread_of_gains"]["std"],
            "gain_min": first["spread_of_gains"]["min"],
        },
        protocol=f"{args.cv}-fold cross-validation over {' ∪ '.join(list_name(p) for p in dev_lists)} of the recipe "
        f"(base + {args.features}, bounds {args.bounds or 'none'}, "
        + (f"guard {require}/{args.folds} folds nested in each training part" if args.folds > 1 else "no guard")
        + f"); λ fixed at the one chosen on {list_name(args.tune)}; the top-level figures are the "
        f"first system's ({next(iter(systems))})",
        systems=per_system,
        signature=metrics.WER_SIGNATURE,
    )


def _wer(refs: list[str], texts: list[list[str]], chosen: np.ndarray) -> float:
    return metrics.wer_report(refs, metrics.pick(texts, chosen))["wer"]


def _dev(t) -> dict:
    return {
        "tune_wer_before": t.result.baseline_metric,
        "tune_wer_tuned": t.result.dev_metric,
        "restart_weight_spread": t.result.weight_spread,
        "tuning_runs_spread": t.result.spread,
    }


def _details(t, rep: dict, weights_file: str) -> dict:
    return {
        **_dev(t),
        "adopted": t.adopted,
        "lambda": t.setup.lam,
        "tune_wer_by_lambda": {str(k): v for k, v in t.by_lambda.items()},
        "weights": t.result.weights,
        "weights_file": f"benchmarks/results/{weights_file}",
        "guard": {k: v for k, v in (t.cross_validation or {}).items() if k != "chosen"},
        "report": {k: rep[k] for k in ("rescored", "bootstrap", "changed_choices")},
    }


def _spread(values: list[float]) -> dict[str, float]:
    spread = weight_spread([{"x": v} for v in values])["x"]
    return {k: spread[k] for k in ("mean", "std", "min", "max")}


if __name__ == "__main__":
    main()
