"""The LibriSpeech rescoring protocol: tune on one list, report on any number of others, one result file per list.

    python -m benchmarks.rescore_protocol --tune DATA/dev_clean.tar.gz --report DATA/dev_other.tar.gz [more lists] \\
        --lm var/bundles/demo --ngram var/ngrams/demo_3gram.bin --normalize ptb --name rescore_protocol_demo \\
        [--cv 5 --cv-with DATA/dev_other.tar.gz]

Each system is a first-pass score (weight fixed at 1) plus the recipe's features of our LMs (by default ``interp`` at
the λ of ``--lambdas`` that tunes best, ``length`` and ``oov``, the count of words outside the LM's vocabulary, with
``--bounds interp=0:,oov=:0``: the recipe that 5-fold cross-validation over LibriSpeech dev_clean ∪ dev_other chose,
``benchmarks.rescore_recipes``), tuned on ``--tune`` alone, optionally (``--folds K``) with the guard of
``rescoring.tune.tune_guarded`` (K-fold cross-validation of the tune list; the tuned weights are kept only when
``--require-folds`` of its held-out folds gain), and applied unchanged to every ``--report`` list:
``NAME_LIST.json`` per list (``LIST``: the file name up to its first dot), with the weights files beside them. A
further held-out list needs no code: add it to ``--report``.

Per report list: the first pass alone (the 1-best), each system's base alone (e.g. AM only), each system, the base
with the list's own LM weight re-tuned (``--retune``, e.g. ESPnet's ``lm``: what our LM must beat to earn its place),
the oracle, and a paired bootstrap of each system against the 1-best.

``--cv K --cv-with LIST...`` adds ``NAME_cv.json``: K-fold cross-validation over the union of the tune list and those
lists (never a test list) of the whole recipe, guard included if any (nested: each fold's guard cross-validates
within its training part), λ fixed at the one chosen on the tune list; per fold the held-out gain over the 1-best, and
``folds_improved``. That is how a recipe is chosen; the weights that ``--report`` lists get are tuned on ``--tune`` only.

LM scores are computed once per list and models and cached in ``--cache-dir`` (``rescoring.lmscores``): a re-run,
or one with another recipe, only tunes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from benchmarks.common import RESULTS, ROOT, write_result
from lmserve.rescoring import metrics, overlap
from lmserve.rescoring.nbest import read_nbest
from lmserve.rescoring.rescore import LanguageModels, Setup, references_of, report, setup_record, tune, tuning_set
from lmserve.rescoring.tune import (
    TuneResult,
    TuningSet,
    cross_validate,
    fold_indices,
    guarded_tuner,
    parse_bounds,
    tune_weights,
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
    pooled = [args.tune, *args.cv_with]
    per_system = {}
    for name, base in systems.items():
        t = tuned[name]
        parts = [tuning_set(lists[p][0], t.setup, lists[p][1], "wer") for p in pooled]
        data = TuningSet(
            "+".join(list_name(p) for p in pooled),
            t.setup.features,
            "wer",
            [x for part in parts for x in part.features],
            [s for part in parts for s in part.stats],
        )
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
        protocol=f"{args.cv}-fold cross-validation over {' ∪ '.join(list_name(p) for p in pooled)} of the recipe "
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


# -- the protocol for any set: K-fold CV inside it, or tuned on some sets and applied to another ------------------
# (``benchmarks.rescore_sets`` runs it on WMT22, HyPoradise and ATIS)

SYSTEM_PREFIX = "sys_"  # the system indicators of lists read from system outputs (``rescoring.nbest.wmt``)


def system_names(nbest) -> list[str]:
    """The systems whose indicators a list carries, in the order the reader wrote them."""
    return [f.removeprefix(SYSTEM_PREFIX) for f in nbest.feature_names() if f.startswith(SYSTEM_PREFIX)]


def system_choice(nbest, system: str) -> np.ndarray:
    """Per entry the candidate that ``system`` produced: that system's own output as a choice."""
    feature = SYSTEM_PREFIX + system
    return np.array([next(k for k, h in enumerate(e.hypotheses) if h.features[feature]) for e in nbest])


def reranked_choice(data: TuningSet, weights: dict[str, float]) -> np.ndarray:
    return data.choose(np.array([weights[f] for f in data.feature_names]))


def _pooled(parts: list[TuningSet]) -> TuningSet:
    first = parts[0]
    return TuningSet(
        "+".join(p.name for p in parts),
        first.feature_names,
        first.metric,
        [x for p in parts for x in p.features],
        [s for p in parts for s in p.stats],
    )


def _stats(data: TuningSet, chosen: np.ndarray) -> np.ndarray:
    return np.stack([data.stats[i][k] for i, k in enumerate(chosen)])


def _baselines(nbest, data: TuningSet) -> tuple[dict[str, np.ndarray], str | None]:
    """The choices rescoring is compared with: the first pass, and for lists of systems the best single system
    (highest corpus metric over the whole list, as if picked with the references), with that system's name."""
    choices = {"1best": np.zeros(len(data), dtype=np.int64)}
    systems = system_names(nbest)
    if not systems:
        return choices, None
    sign = 1 if metrics.HIGHER_IS_BETTER[data.metric] else -1
    by_system = {s: system_choice(nbest, s) for s in systems}
    best = max(systems, key=lambda s: sign * data.score(by_system[s]))
    return {**choices, "best_system": by_system[best]}, best


def _figures(nbest, data: TuningSet, chosen: np.ndarray, base: dict, best_name: str | None) -> tuple[dict, dict]:
    """Corpus figures of ``chosen`` beside the baselines (``_baselines``), with paired bootstraps (and chrF for MT)."""
    m = data.metric
    figures = {f"{m}_1best": data.score(base["1best"]), f"{m}_rescored": data.score(chosen)}
    signature = metrics.WER_SIGNATURE
    details: dict = {"changed_choices": int(np.count_nonzero(chosen))}
    if m == "bleu":
        refs = references_of(nbest, "bleu")
        texts = [[h.text for h in e.hypotheses] for e in nbest]
        chrf = {k: metrics.chrf_report(refs, metrics.pick(texts, c)) for k, c in {**base, "rescored": chosen}.items()}
        signature = metrics.bleu_report(refs, metrics.pick(texts, chosen))["signature"]
        details["chrf_signature"] = chrf["rescored"]["signature"]
        figures["reranked_bleu"] = figures["bleu_rescored"]
        figures["reranked_chrf"] = chrf["rescored"]["chrf"]
        figures["chrf_1best"] = chrf["1best"]["chrf"]
        if "best_system" in base:
            figures["best_system_bleu"] = data.score(base["best_system"])
            figures["best_system_chrf"] = chrf["best_system"]["chrf"]
            details["best_system"] = best_name
    else:
        figures["wer_oracle"] = data.score(np.array([int(np.argmin(s[:, 0])) for s in data.stats]))
    details["signature"] = signature
    details["bootstrap"] = {
        f"rescored_vs_{k}": metrics.paired_bootstrap_stats(
            m, _stats(data, c), _stats(data, chosen), signature=signature
        )
        for k, c in base.items()
    }
    return figures, details


def leakage(lists: dict, texts: list[Path], normalizer) -> dict[str, dict]:
    """The leakage guard (``rescoring.overlap``) over the LM training ``texts``, once for the references of all
    ``lists`` (name -> NBestList), reported per list: how many of its references share an 8-word window with the text
    (normalised as the LMs see them)."""
    refs, owners = [], []
    for name, nbest in lists.items():
        for entry in nbest:
            refs += entry.references
            owners += [name] * len(entry.references)
    found = overlap.measure(refs, texts, reference_view=normalizer.normalize, ids=owners, offenders=len(refs))
    result = {}
    for name in lists:
        total, matched = owners.count(name), [o for o in found.offenders if o.id == name]
        result[name] = {
            "references": total,
            "matched_references": len(matched),
            "share_references": len(matched) / total,
            "worst": [o.text for o in matched[:3]],
            "n": found.n,
            "text_files": found.text_files,
            "text_words": found.text_words,
            "warning": len(matched) / total > overlap.WARN_SHARE,
        }
    return result


def _bounded(search: dict, setup: Setup) -> dict:
    """``search`` with only the bounds of the recipe's own features (one bounds setting serves its ablations)."""
    return {**search, "bounds": {k: v for k, v in (search.get("bounds") or {}).items() if k in setup.features}}


def kfold(
    nbest, scores, setup: Setup, metric: str, k: int, fixed: str, search: dict, guard: int = 0
) -> tuple[dict, dict]:
    """K-fold CV over contiguous entries of one set: every entry chosen by weights tuned without its fold. ``guard``
    (> 1): the recipe with ``lm-rescore tune --cv guard --require-folds guard``'s guard nested in each training part,
    so that a fold keeps the first pass unless every one of ``guard`` folds of its training part gains."""
    data = tuning_set(nbest, setup, scores, metric)
    tuner = guarded_tuner(guard, guard) if guard > 1 else None
    cv = cross_validate(data, k=k, fixed=fixed, contiguous=True, tuner=tuner, **_bounded(search, setup))
    base, best_name = _baselines(nbest, data)
    figures, details = _figures(nbest, data, cv.chosen, base, best_name)
    sign = 1 if metrics.HIGHER_IS_BETTER[metric] else -1
    per_fold = []
    for j, fold in enumerate(fold_indices(len(data), k, contiguous=True)):
        part = data.subset(fold, f"{data.name}[fold {j}]")
        row = {"entries": len(fold), "rescored": part.score(cv.chosen[fold])}
        row.update({name: part.score(c[fold]) for name, c in base.items()})
        row["weights"] = cv.folds[j].weights
        per_fold.append(row)
    figures["folds"] = k
    figures["folds_improved"] = sum(sign * (r["rescored"] - r["1best"]) > 0 for r in per_fold)
    if "best_system" in base:
        figures["folds_beating_best"] = sum(r["rescored"] >= r["best_system"] for r in per_fold)
    details.update({"features": list(setup.features), "definitions": setup.definitions, "fixed": fixed})
    details.update({"search": search, "per_fold": per_fold, "weight_spread": cv.weight_spread})
    if guard > 1:
        details["guard"] = f"{guard} of {guard} folds of each training part must gain"
    return figures, details


def in_sample_ceiling(nbest, scores, setup: Setup, metric: str, fixed: str, search: dict) -> float:
    """The set's figure with weights tuned on the set itself: a diagnostic, never a result (it has seen the
    references). Where even this misses a target, the recipe's features are what fall short, not the protocol."""
    data = tuning_set(nbest, setup, scores, metric)
    return data.score(reranked_choice(data, tune_weights(data, fixed=fixed, **_bounded(search, setup)).weights))


def tuned_on(train, train_scores, setup: Setup, metric: str, fixed: str, search: dict) -> tuple[str, TuneResult]:
    """The weights tuned on ``train`` (a list, or several pooled), with the pooled set's name."""
    trains = train if isinstance(train, list) else [train]
    train_scores = train_scores if isinstance(train, list) else [train_scores]
    data = _pooled([tuning_set(n, setup, s, metric) for n, s in zip(trains, train_scores, strict=True)])
    return data.name, tune_weights(data, fixed=fixed, **_bounded(search, setup))


def transfer(tuned: tuple[str, TuneResult], test, test_scores, setup: Setup, metric: str):
    """Weights tuned on other lists (``tuned_on``: the pooled lists' name and the result) applied unchanged to
    ``test``; one tuning serves every set that takes the weights of the same lists."""
    name, result = tuned
    test_data = tuning_set(test, setup, test_scores, metric)
    figures, details = _figures(
        test, test_data, reranked_choice(test_data, result.weights), *_baselines(test, test_data)
    )
    details["report"] = details["bootstrap"]["rescored_vs_1best"]
    details.update({"tuned_on": name, "tune_before": result.baseline_metric, "tune_after": result.dev_metric})
    details.update({"weights": result.weights, "features": list(setup.features), "definitions": setup.definitions})
    return figures, details


if __name__ == "__main__":
    main()
