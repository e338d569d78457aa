"""``lm-rescore evaluate``: will rescoring help on my data? A recipe judged only on entries its weights never saw,
beside the systems that say what the LMs added (``rescoring.evaluation``).

    lm-rescore evaluate dev.jsonl --metric wer --features am,neural,ngram,oov_lm,length --define am=0.6*decoder+0.4*ctc \\
        --fixed am --lm BUNDLE --ngram NGRAM --cv 5 --first-pass am --out eval.json
    lm-rescore evaluate chime4=test_chime4.json.gz td3=test_td3.json.gz --metric wer ... --transfer
    lm-rescore evaluate test.jsonl --tune dev_a.jsonl dev_b.jsonl --metric wer ...

Protocols (any together; ``--cv 5`` when none is asked for): ``--cv K`` (folds ``--fold-mode random|contiguous|
document``, over the union of the lists or ``--cv-over each`` list on its own; ``--guard G``: the tuning guard
nested, per list), ``--tune LIST...`` (tuned there, reported on every LIST), ``--transfer`` (leave one list out).
Every protocol runs the recipe and its baselines (1best, no_lm, ngram_only, first_pass with ``--first-pass``,
best_system for lists of MT systems) and ablations (``--ablate``) on the same folds, tuned the same way, with a
paired bootstrap of the recipe against each; the in-sample ceiling is printed as a diagnostic. One table is printed,
one JSON written (``--out``).

A list is ``[NAME=]PATH`` (any format lm-rescore reads; NAME defaults to the file name up to its first dot).
``sys_*`` in ``--features`` stands for every system indicator of the lists (``rescoring.nbest.wmt``). LM scores
are cached per list in ``--cache-dir`` (default: beside ``--out``): a second run, or one with another recipe, only
tunes.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from lmserve.core.atomic import atomic_write_text
from lmserve.core.fingerprints import fingerprints
from lmserve.core.outputs import check_outputs
from lmserve.core.textnorm import PRESETS
from lmserve.rescoring.context import CONTEXTS
from lmserve.rescoring.evaluation import (
    FOLD_MODES,
    FORMAT,
    FORMAT_VERSION,
    GROUPS,
    SYSTEMS_WILDCARD,
    Evaluation,
    ListData,
    Recipe,
    document_ids,
    expand_systems,
    format_table,
)
from lmserve.rescoring.features import check_features, check_models, models_needed
from lmserve.rescoring.nbest import FORMATS, MAX_WORDS, NBestList, read_nbest
from lmserve.rescoring.nbest.checks import parse_defaults
from lmserve.rescoring.rescore import LanguageModels, Setup, check_normalisation, references_of
from lmserve.rescoring.tune import LENGTH_RATIO_HELP, METHODS, check_bounds, parse_bounds, parse_length_ratio

LAMBDAS = "0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9"
NAMED = re.compile(r"([A-Za-z0-9_][\w.-]*)=(.+)")


def add_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "evaluate",
        help="will rescoring help on my data? cross-validation, held-out lists, transfer; baselines and ablations",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("lists", nargs="+", metavar="[NAME=]LIST", help="the lists evaluated (reported)")
    p.add_argument(
        "--tune", nargs="+", metavar="[NAME=]LIST", help="held out: tune on the union of these, report on every LIST"
    )
    p.add_argument("--metric", choices=("wer", "bleu"), required=True)
    p.add_argument("--features", required=True, help="the recipe: comma-separated features (sys_*: every system)")
    p.add_argument("--fixed", help="the feature whose weight stays 1 (default: the first)")
    p.add_argument("--define", action="append", default=[], metavar="NAME=EXPR", help="e.g. am=0.6*decoder+0.4*ctc")
    p.add_argument(
        "--first-pass",
        metavar="FEATURES",
        help="a baseline of the first pass's own features, tuned the same way, e.g. am (AM only) or score",
    )
    p.add_argument("--lm", help="neural LM bundle")
    p.add_argument("--ngram", help="n-gram model (ARPA, KenLM binary or a mixture)")
    p.add_argument(
        "--normalize", choices=sorted(PRESETS), help="text normalisation for the LMs (default: the bundle's)"
    )
    p.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads (0 = all cores)")
    p.add_argument(
        "--context",
        choices=CONTEXTS,
        help="document context: the neural LM reads each document's earlier utterances (their first-pass 1-best) "
        "before scoring the next; documents by list order, by utterance id or by a JSON Lines document field (rescoring.context)",
    )
    p.add_argument("--cv", type=int, help="K-fold cross-validation (default 5 when neither --tune nor --transfer)")
    p.add_argument("--fold-mode", choices=FOLD_MODES, default="contiguous", help="folds (default: %(default)s)")
    p.add_argument(
        "--document-id",
        metavar="REGEX",
        help="--fold-mode document: each entry's document, the first group of REGEX in its id (e.g. '^(.*)-[^-]*$')",
    )
    p.add_argument(
        "--cv-over",
        choices=("union", "each"),
        default="union",
        help="union: folds of every list tuned together; each: every list on its own (default: %(default)s)",
    )
    p.add_argument(
        "--guard",
        type=int,
        default=0,
        metavar="G",
        help="nest the tuning guard: weights kept only when every list gains on --require-folds of G folds",
    )
    p.add_argument("--require-folds", type=int, help="the guard's folds that must gain (default: all G)")
    p.add_argument("--transfer", action="store_true", help="leave one list out: each list tuned on the others")
    p.add_argument("--transfer-pool", metavar="NAME,...", help="the lists --transfer tunes on (default: all)")
    p.add_argument(
        "--ablate",
        metavar="GROUP,...",
        help=f"feature groups to leave out one at a time, some of {', '.join(GROUPS)}, or none (default: every "
        "group of the recipe but the LMs', whose part the baselines show)",
    )
    p.add_argument("--no-ceiling", action="store_true", help="skip the in-sample ceiling (a diagnostic)")
    p.add_argument("--lambdas", default=LAMBDAS, help="λ values tried for interp, chosen in each training part")
    p.add_argument("--methods", default=",".join(METHODS), help=f"scipy methods among {', '.join(METHODS)}")
    p.add_argument("--restarts", type=int, default=5, help="random restarts per method (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bounds", default="", metavar="NAME=LOW:HIGH,...", help="weight limits, e.g. neural=0:")
    p.add_argument("--penalty", type=float, default=0.0, help="α of α·Σu² on the rescaled weights (metric units)")
    p.add_argument("--length-ratio", metavar="LOW:HIGH", help=LENGTH_RATIO_HELP)
    p.add_argument("--bootstrap-samples", type=int, default=1000)
    p.add_argument("--out", type=Path, help="the JSON report to write")
    p.add_argument("--cache-dir", type=Path, help="LM score caches, NAME.lmscores.jsonl (default: beside --out)")
    p.add_argument("--format", choices=sorted(FORMATS), help="the lists' format (default: detected)")
    p.add_argument("--max-words", type=int, default=MAX_WORDS, help="longest hypothesis (default: %(default)s)")
    p.add_argument("--feature-default", action="append", default=[], metavar="NAME=VALUE")
    p.add_argument(
        "--allow-unnormalised", action="store_true", help="allow interp with a neural LM whose scores are unnormalised"
    )
    p.add_argument("--no-overlap-check", action="store_true", help="skip the leakage check of the bundle's text")
    p.add_argument("--quiet", action="store_true", help="no progress")
    p.set_defaults(func=run_evaluate, conflicts=_conflicts)


def _conflicts(args) -> str | None:
    if args.fold_mode == "document" and not args.document_id:
        return "--fold-mode document needs --document-id REGEX (each entry's document, from its id)"
    if args.document_id and args.fold_mode != "document":
        return f"--document-id with --fold-mode {args.fold_mode}: documents are only read for --fold-mode document"
    if args.require_folds is not None and not args.guard:
        return "--require-folds without --guard G"
    if args.transfer_pool and not args.transfer:
        return "--transfer-pool without --transfer"
    if args.cv_over == "each" and args.cv is None and (args.tune or args.transfer):
        return "--cv-over each without --cv K"
    return None


def named(values: list[str]) -> dict[str, Path]:
    """``[NAME=]PATH`` arguments by name (NAME: the file name up to its first dot when not given)."""
    out: dict[str, Path] = {}
    for value in values:
        match = NAMED.fullmatch(value)
        name, path = (match.group(1), Path(match.group(2))) if match and "/" not in match.group(1) else (None, None)
        if name is None:
            path = Path(value)
            name = path.name.split(".")[0] or path.name
        if name in out:
            raise ValueError(f"two lists named {name!r} ({out[name]}, {path}): name them, NAME=LIST")
        out[name] = path
    return out


def _numbers(text: str, flag: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or not all(0 < v < 1 for v in values):
        raise ValueError(f"{flag} {text!r}: expected comma-separated numbers in (0, 1)")
    return values


def run_evaluate(args) -> int:
    start = time.perf_counter()
    say = (lambda *a: None) if args.quiet else (lambda *a: print("lm-rescore evaluate:", *a, file=sys.stderr))
    report_paths, tune_paths = named(args.lists), named(args.tune or [])
    if clash := set(report_paths) & set(tune_paths):
        raise ValueError(f"list {sorted(clash)[0]!r} is both reported and tuned on (--tune): report other lists")
    cv = args.cv if args.cv is not None else (5 if not (args.tune or args.transfer) else None)
    if cv is not None and cv < 2:
        raise ValueError(f"--cv {cv}: expected at least 2 folds")
    if args.transfer and len(report_paths) < 2:
        raise ValueError("--transfer needs two lists or more (each is tuned on the others)")
    pool = args.transfer_pool.split(",") if args.transfer_pool else None
    if pool and (unknown := [p for p in pool if p not in report_paths]):
        raise ValueError(f"--transfer-pool: no list named {unknown[0]!r}; the lists are {', '.join(report_paths)}")
    require = args.require_folds if args.require_folds is not None else args.guard
    if args.guard and (args.guard < 2 or not 1 <= require <= args.guard):
        raise ValueError(f"--guard {args.guard} --require-folds {require}: expected G >= 2 and 1 to G folds")
    guard = (args.guard, require) if args.guard else None
    features = [f.strip() for f in args.features.split(",")]
    definitions = Setup.parse(["x"], args.define).definitions  # the definitions' syntax, before anything is read
    lambdas = _numbers(args.lambdas, "--lambdas")
    methods = [m.strip() for m in args.methods.split(",")]
    if unknown := [m for m in methods if m not in METHODS]:
        raise ValueError(f"--methods {args.methods!r}: unknown method {unknown[0]!r}; expected some of {METHODS}")
    if not args.penalty >= 0 or args.restarts < 0 or args.bootstrap_samples < 1:
        raise ValueError("--penalty, --restarts: expected numbers >= 0; --bootstrap-samples: at least 1")
    bounds = parse_bounds(args.bounds)
    length_ratio = parse_length_ratio(args.length_ratio, args.metric)
    ablate = None if args.ablate is None else [g for g in args.ablate.split(",") if g and g != "none"]
    if ablate and (unknown := [g for g in ablate if g not in GROUPS]):
        raise ValueError(f"--ablate {args.ablate!r}: unknown group {unknown[0]!r}; expected some of {GROUPS}")
    cache_dir = args.cache_dir or (args.out.parent if args.out else None)
    models_given = bool(args.lm or args.ngram)
    all_paths = {**tune_paths, **report_paths}
    caches = {n: cache_dir / f"{n}.lmscores.jsonl" for n in all_paths} if cache_dir and models_given else {}
    check_outputs(
        {"--out": args.out, **{f"the score cache of {n}": p for n, p in caches.items()}},
        {
            "LIST": list(report_paths.values()),
            "--tune": list(tune_paths.values()),
            "--lm": args.lm,
            "--ngram": args.ngram,
        },
    )

    defaults = parse_defaults(args.feature_default)
    lists = {}
    for name, path in all_paths.items():
        nbest = read_nbest(path, args.format, feature_defaults=defaults, max_words=args.max_words)
        lists[name] = NBestList(nbest.entries, name)
        references_of(lists[name], args.metric)
    each = cv is not None and args.cv_over == "each"
    by_systems = _expansions(features, lists, list(report_paths), each, bool(args.tune or args.transfer))
    first = [f.strip() for f in args.first_pass.split(",")] if args.first_pass else []
    if lm_read := [f for f in first if models_needed(f, definitions, bool(args.lm))]:
        raise ValueError(f"--first-pass {args.first_pass}: a first-pass baseline reads no LM ({lm_read[0]!r} does)")
    for group, expanded in by_systems:
        fixed = args.fixed or expanded[0]
        if fixed not in expanded:
            raise ValueError(f"--fixed {fixed!r}: not one of --features {','.join(expanded)}")
        check_bounds(bounds, expanded, fixed)
        for name in group if len(by_systems) > 1 else lists:
            check_features(lists[name], [*expanded, *first], definitions, lambdas[0], models_given)
        check_models([*expanded, *first], definitions, bool(args.lm), bool(args.ngram))

    models = None
    if models_given:
        models = LanguageModels.load(args.lm, args.ngram, args.normalize, args.threads, context=args.context)
        check_normalisation(
            getattr(models, "normalisation", None), Setup(features, definitions), args.allow_unnormalised
        )
    overlaps, data = {}, {}
    for name, nbest in lists.items():
        scores = None
        if models is not None:
            from lmserve.rescoring.commands.rescore_cli import _overlap_check

            overlaps[name] = _overlap_check(args, models, nbest)
            say(f"LM scores of {name} ({len(nbest)} lists)")
            scores = models.scores(nbest, caches.get(name), progress=not args.quiet)
        documents = document_ids(nbest, args.document_id) if args.fold_mode == "document" else None
        data[name] = ListData(name, nbest, scores, documents)

    search = {"methods": methods, "restarts": args.restarts, "penalty": args.penalty, "bounds": bounds}
    search["length_ratio"] = length_ratio
    sections: dict = {}
    records = []
    for group, expanded in by_systems:
        fixed = args.fixed or expanded[0]
        recipe = Recipe(tuple(expanded), fixed, definitions, tuple(lambdas), search)
        first_pass = None
        if args.first_pass:
            first_pass = Recipe(tuple(first), first[0], definitions, tuple(lambdas), search)
        tune_names = list(tune_paths) if len(by_systems) == 1 else []
        evaluation = Evaluation(
            [data[n] for n in [*tune_names, *group]],
            args.metric,
            recipe,
            bool(args.lm),
            bool(args.ngram),
            first_pass,
            ablate,
            args.seed,
            args.bootstrap_samples,
        )
        records.append(evaluation.record())
        if cv is not None:
            say(f"{cv}-fold cross-validation of {len(evaluation.variants)} systems over {', '.join(group)}")
            _merge(
                sections,
                "cross_validation",
                evaluation.cross_validation(cv, args.fold_mode, args.cv_over, guard, group),
            )
        if tune_names:
            say(f"tuned on {', '.join(tune_names)}, reported on {', '.join(group)}")
            sections["held_out"] = evaluation.held_out(tune_names, group, guard)
        if args.transfer:
            say(f"leave one list out over {', '.join(group)}")
            sections["transfer"] = evaluation.transfer(pool, guard, group)
        if not args.no_ceiling:
            say("in-sample ceiling (a diagnostic)")
            _merge(sections, "in_sample_ceiling", evaluation.ceilings(group))
    result = {"format": FORMAT, "format_version": FORMAT_VERSION, **records[0]}
    if len(records) > 1:
        result["recipe_by_list"] = {g[0]: r["recipe"] for (g, _), r in zip(by_systems, records, strict=True)}
    result["lists"] = {
        name: {
            "path": str(path),
            "role": "tune" if name in tune_paths else "report",
            "entries": len(lists[name]),
            "hypotheses": lists[name].num_hypotheses,
            **({"overlap": overlaps[name]} if overlaps.get(name) else {}),
        }
        for name, path in all_paths.items()
    }
    if models is not None:
        result["models"] = {**models.paths, "fingerprints": fingerprints(models.paths)}
    result |= sections
    argv = getattr(args, "argv", None)
    result["command"] = None if argv is None else "lm-rescore " + shlex.join(argv)
    result["seconds"] = round(time.perf_counter() - start, 1)
    result["date"] = datetime.now(UTC).isoformat(timespec="seconds")
    print(format_table(result))
    if args.out:
        atomic_write_text(args.out, json.dumps(result, indent=2) + "\n")
        say(f"-> {args.out}")
    return 0


def _expansions(features, lists, names, each: bool, pooled: bool) -> list[tuple[list[str], list[str]]]:
    """The reported lists (``names``) in groups that share the recipe's features (``sys_*`` expanded over every
    list, tune lists too): one group unless the lists carry different systems, which only ``--cv-over each`` alone
    can evaluate (each list on its own)."""
    if SYSTEMS_WILDCARD not in features:
        return [(list(names), list(features))]
    try:
        return [(list(names), expand_systems(features, list(lists.values())))]
    except ValueError:
        if not each or pooled:
            raise
    return [([n], expand_systems(features, [lists[n]])) for n in names]


def _merge(sections: dict, key: str, part: dict) -> None:
    """A protocol's section of one group of lists merged into the sections of the others (their lists joined)."""
    if key not in sections:
        sections[key] = part
    else:
        sections[key]["lists"].update(part["lists"])
