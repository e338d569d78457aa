"""``lm-rescore tune`` and ``lm-rescore nbest``: the batch rescoring job on the command line (``rescoring.rescore``).

    lm-rescore tune DEV_LIST --lm BUNDLE --ngram MODEL --metric wer --features am,neural,ngram,interp,length \\
        --define am=0.6*decoder+0.4*ctc --fixed am --out dev.weights.json
    lm-rescore nbest TEST_LIST --weights dev.weights.json --out test.rescored.jsonl --report test.report.json

``tune`` reads only the dev list, or several tuned on as one (and the models); ``nbest`` applies the weights file,
which names the models, text normalisation, definitions and λ it was tuned with, to any other list. ``tune`` says
what the LMs added (the recipe without them, tuned alike: ``rescoring.evaluation.lms_added``) and records what its
lists looked like (``rescoring.liststats``), so that ``nbest`` warns of a list unlike them; ``nbest`` reports what the
LM terms changed on its list. ``lm-rescore evaluate`` (``evaluate_cli``) is the whole protocol, with baselines.

Both write an HTML error analysis with ``--html`` (``rescoring.report_html``), and both check the list's references
against the training text the neural LM's manifest names (``rescoring.overlap``; ``lm-rescore overlap`` runs that
check on any text), warning of a test-set leak. ``interp`` is refused for a bundle whose scores are unnormalised.

Both check everything they were given before a model runs: the flags, the list (``rescoring.nbest.checks``) and its
references, the features the weights use, and that every output can be written. Outputs appear complete or not at
all (``core.atomic``).

With ``--server HOST:PORT`` (and ``--server-model NAME``) both take their LM scores from a running ``lm-serve``
instead of loading models: ``rescoring.commands.remote`` (over the lm-serve client, ``rescoring.client``) is
imported only then, so the engine never needs gRPC, and ``rescoring`` never imports ``server`` (docs/design.md). ``nbest``
takes a fleet, ``--server A,B,…`` with ``--concurrency C``: whole lists as ``RescoreNBest`` calls
(``rescoring.commands.fleet``).

``nbest --shard K/N`` rescores the K-th of N ranges of the list and ``merge`` joins the shards' outputs and reports
into exactly one run's; ``tune --shard K/N`` computes the LM scores of one range into a score cache, ``merge
--caches`` joins them into the whole list's, and ``tune --cache`` tunes on that without running a model (the search
itself reads every utterance at once; it takes seconds): ``rescoring.commands.shards``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from lmserve.core.atomic import atomic_write_text
from lmserve.core.fingerprints import check_fingerprints
from lmserve.core.outputs import check_outputs
from lmserve.core.textnorm import PRESETS
from lmserve.rescoring import overlap
from lmserve.rescoring.commands.shards import (
    Shard,
    cache_shard,
    fingerprint,
    merge,
    merge_caches,
    merged_format,
    read_shards,
    renumbered,
    shard_output,
    shard_record,
    write_report,
)
from lmserve.rescoring.context import CONTEXTS, document_keys
from lmserve.rescoring.evaluation import format_lms_added, lm_terms_report, lm_terms_stats, lms_added
from lmserve.rescoring.features import check_features
from lmserve.rescoring.liststats import carried_features, compare, list_statistics
from lmserve.rescoring.lmscores import check_lambda, texts_fingerprint, write_cache
from lmserve.rescoring.nbest import (
    FOLDER_FORMATS,
    FORMATS,
    MAX_WORDS,
    NBestList,
    output_format,
    read_nbest,
    write_nbest,
)
from lmserve.rescoring.nbest.checks import parse_defaults
from lmserve.rescoring.nbest.files import read_text
from lmserve.rescoring.nbest.parsing import split_lines
from lmserve.rescoring.ngram import NgramError
from lmserve.rescoring.overlap import DEFAULT_N, WARN_SHARE
from lmserve.rescoring.rescore import (
    LanguageModels,
    Setup,
    check_normalisation,
    format_report,
    references_of,
    report_from_stats,
    reranked,
    setup_from_record,
    setup_record,
    utterance_stats,
)
from lmserve.rescoring.rescore import tune as tune_setup
from lmserve.rescoring.scorer_args import add_device_argument, add_precision_argument, precision_conflict
from lmserve.rescoring.tune import (
    LENGTH_RATIO_HELP,
    METHODS,
    check_bounds,
    format_stability,
    parse_bounds,
    parse_length_ratio,
    read_weights,
    write_weights,
)

OFFENDERS = 5  # the worst references the leakage check lists in a report


def add_commands(sub: argparse._SubParsersAction) -> None:
    tune = sub.add_parser("tune", help="tune feature weights on dev lists (minimise WER or maximise BLEU)")
    _list_arguments(tune, several=True)
    _model_arguments(tune)
    tune.add_argument("--metric", choices=("wer", "bleu"), required=True)
    tune.add_argument("--features", required=True, help="comma-separated: list features, neural, ngram, interp, ...")
    tune.add_argument("--define", action="append", default=[], metavar="NAME=EXPR", help="e.g. am=0.6*decoder+0.4*ctc")
    tune.add_argument("--fixed", help="the feature whose weight stays 1 (-1 for a cost, NAME_cost; default: the first)")
    tune.add_argument("--lambdas", default="0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9", help="λ values tried for interp")
    tune.add_argument("--methods", default=",".join(METHODS), help=f"scipy methods among {', '.join(METHODS)}")
    tune.add_argument("--restarts", type=int, default=5, help="random restarts per method (besides the first run)")
    tune.add_argument("--seed", type=int, default=0)
    tune.add_argument("--cv", type=int, default=0, help="k-fold cross-validation on the dev list (weights' stability)")
    tune.add_argument(
        "--require-folds", type=int, default=0, help="keep the first pass unless this many --cv folds gain"
    )
    tune.add_argument("--bounds", default="", metavar="NAME=LOW:HIGH,...", help="weight limits, e.g. interp=0:")
    tune.add_argument("--penalty", type=float, default=0.0, help="α of α·Σu² on the rescaled weights (metric units)")
    tune.add_argument("--length-ratio", metavar="LOW:HIGH", help=LENGTH_RATIO_HELP)
    tune.add_argument("--out", required=True, type=Path, help="weights file (JSON) to write")
    tune.add_argument(
        "--shard",
        metavar="K/N",
        help="only compute the LM scores of the K-th of N ranges of the list into its score cache (--cache, default "
        "LIST.shard-K-of-N.lmscores.jsonl beside --out) and stop; `lm-rescore merge --caches` joins the N caches into "
        "the whole list's, which tune --cache then reads (the search is not sharded: it needs every utterance)",
    )
    _report_arguments(tune)
    tune.set_defaults(func=run_tune, conflicts=_tune_conflicts)

    nbest = sub.add_parser("nbest", help="rerank lists with tuned weights; report 1-best, rescored and oracle")
    _list_arguments(nbest)
    _model_arguments(nbest, from_weights=True)
    nbest.add_argument("--weights", required=True, type=Path, help="weights file written by lm-rescore tune")
    nbest.add_argument(
        "--accept-changed-models",
        action="store_true",
        help="use models that differ from the ones the weights were tuned with (their fingerprints in the weights "
        "file), with a warning, instead of stopping",
    )
    nbest.add_argument("--out", required=True, type=Path, help="reranked list to write")
    nbest.add_argument(
        "--out-format", choices=sorted(FORMATS), help="default: the one --out's name says (.jsonl, .json: hyporadise)"
    )
    nbest.add_argument("--report", type=Path, help="JSON report to write (metrics need references)")
    nbest.add_argument("--no-metrics", action="store_true", help="lists without references: only rerank")
    nbest.add_argument(
        "--shard",
        metavar="K/N",
        help="rescore only the K-th (1-based) of N contiguous, equal ranges of the list's utterances, for a SLURM "
        "array (--shard $SLURM_ARRAY_TASK_ID/N) or a Kubernetes indexed Job (--shard $((JOB_COMPLETION_INDEX+1))/N); "
        "needs --report, which carries what `lm-rescore merge` needs to join the shards into one run's output",
    )
    nbest.add_argument(
        "--concurrency", type=int, default=8, help="with --server: RescoreNBest calls in flight (default: %(default)s)"
    )
    nbest.add_argument(
        "--deadline",
        type=float,
        default=120.0,
        help="with --server: seconds a call may go unanswered, retries on other targets included, before the run "
        "fails (default: %(default)s)",
    )
    nbest.add_argument(
        "--lists-per-call", type=int, default=1, help="with --server: n-best lists per RescoreNBest call"
    )
    _report_arguments(nbest)
    nbest.set_defaults(func=run_nbest, conflicts=_nbest_conflicts)

    merge = sub.add_parser(
        "merge", help="join the outputs and reports of nbest --shard K/N runs (or tune --shard caches) into one run's"
    )
    merge.add_argument("reports", nargs="*", type=Path, help="every shard's nbest --report (each names its output)")
    merge.add_argument("--out", type=Path, help="the merged list to write")
    merge.add_argument(
        "--out-format", choices=sorted(FORMATS), help="default: the one --out's name says, or the shards'"
    )
    merge.add_argument("--report", type=Path, help="the merged JSON report to write (shards run with references)")
    merge.add_argument("--caches", nargs="+", type=Path, help="instead: every tune --shard run's score cache")
    merge.add_argument("--cache", type=Path, help="with --caches: the whole list's score cache to write")
    merge.set_defaults(func=run_merge)

    overlap = sub.add_parser("overlap", help="leakage guard: the share of references that the LM text contains")
    overlap.add_argument("--text", nargs="+", required=True, type=Path, help="LM training text, plain or .gz")
    overlap.add_argument("--list", type=Path, help="n-best/k-best list whose references are checked")
    overlap.add_argument("--format", choices=sorted(FORMATS), help="the list's format (default: detected)")
    overlap.add_argument("--references", nargs="+", type=Path, help="reference files, one sentence per line")
    overlap.add_argument("-n", type=int, default=DEFAULT_N, help="window length in words (default: %(default)s)")
    overlap.add_argument("--normalize", choices=sorted(PRESETS), help="normalise the references first (e.g. ptb)")
    overlap.add_argument("--normalize-text", choices=sorted(PRESETS), help="normalise the LM text first (slower)")
    overlap.add_argument("--threshold", type=float, default=WARN_SHARE, help="warn above this share of references")
    overlap.add_argument("--offenders", type=int, default=10, help="worst references listed (default: %(default)s)")
    overlap.add_argument("--json", type=Path, help="write the result as JSON")
    overlap.set_defaults(func=run_overlap)


def _list_arguments(parser: argparse.ArgumentParser, several: bool = False) -> None:
    class ListOrSystems(argparse.Action):
        """LIST, or ``--systems FILE...``, whose first file then stands for LIST where the list's path is used (the
        score cache's default name, a shard's input fingerprint): one of the two, never both (argparse's group;
        ``tune``'s LIST..., which argparse cannot group, ``_list_conflicts``)."""

        def __call__(self, parser, namespace, values, option_string=None):
            if option_string:
                namespace.systems, namespace.list = values, values[0]
            elif isinstance(values, list):  # tune's LIST...: empty when --systems stands for it
                if values:
                    namespace.lists, namespace.list = values, values[0]
            elif values is not None:  # an absent LIST must not undo --systems
                namespace.list = values

    if several:
        given = parser
        parser.set_defaults(list=None, lists=None, systems=None)
    else:
        given = parser.add_mutually_exclusive_group(required=True)
    given.add_argument(
        "list",
        nargs="*" if several else "?",
        type=Path,
        action=ListOrSystems,
        metavar="LIST",
        **({"default": None} if several else {}),
        help="n-best/k-best list (file or folder, e.g. a WMT folder of system outputs; the format is detected)"
        + (
            "; several: tuned on together, as one list (the --require-folds guard then asks every list to gain on "
            "its held-out folds, not just their union)"
            if several
            else ""
        ),
    )
    given.add_argument(
        "--systems",
        nargs="+",
        type=Path,
        action=ListOrSystems,
        metavar="FILE",
        help="instead of LIST: plain MT outputs, one file per system, line i of each the same segment; read as "
        "k-best lists of their distinct translations (features votes and sys_NAME, NAME the file's name without "
        "its last suffix)",
    )
    parser.add_argument("--source", type=Path, help="with --systems: the source sentences, one a line")
    parser.add_argument("--format", choices=sorted(FORMATS), help="override format detection")
    parser.add_argument("--references", nargs="+", type=Path, help="reference files, one sentence per line")
    parser.add_argument(
        "--cache", type=Path, help="LM score cache (JSONL); default: LIST_NAME.lmscores.jsonl beside --out"
    )
    parser.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads (0 = all cores)")
    add_device_argument(parser)
    add_precision_argument(parser)
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument(
        "--feature-default",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="the value of feature NAME for hypotheses that lack it (default: such a hypothesis is an error)",
    )
    parser.add_argument(
        "--max-words",
        type=int,
        default=MAX_WORDS,
        help="longest hypothesis, in words (default: %(default)s, as lm-serve's limits.max_words)",
    )


def _list_conflicts(args) -> str | None:
    """Options of ``tune`` and ``nbest`` that cannot be honoured together (``command.parse_args``)."""
    lists = getattr(args, "lists", None)
    if args.list is None:
        return "give the list to read, LIST or --systems FILE..."
    if lists and args.systems:
        return "LIST with --systems: give one of them (--systems reads the systems' files as the list)"
    if lists and len(lists) > 1:
        several = next((f for f in ("cache", "references", "shard", "html") if getattr(args, f, None)), None)
        if several:
            return f"--{several} with several lists: tune them one by one, or join them into one list first"
    if args.systems and args.format:
        return f"--format {args.format} with --systems: --systems reads plain files, one per system"
    if args.source and not args.systems:
        return f"--source {args.source} without --systems: a list in a format carries its own source"
    if args.server and args.device != "cpu":
        return f"--device {args.device} with --server: the server's config (server.device) says where its models run"
    if args.server and args.precision != "fp32":
        return f"--precision {args.precision} with --server: the server's config (models.NAME.precision) says how"
    return precision_conflict(args)


def _tune_conflicts(args) -> str | None:
    if args.shard and (args.cv or args.html):
        return f"--shard with {'--cv' if args.cv else '--html'}: a shard only computes LM scores (merge, then tune)"
    return _list_conflicts(args)


def _nbest_conflicts(args) -> str | None:
    if args.no_metrics and args.html:
        return "--html with --no-metrics: the error analysis is of metrics; leave out one of them"
    if args.no_metrics and args.report and not args.shard:
        return "--report with --no-metrics: a report holds metrics (only a --shard's report is written without)"
    if args.shard and not args.report:
        return "--shard without --report: a shard's report carries what lm-rescore merge needs"
    if args.shard and args.html:
        return "--html with --shard: the HTML analysis is of a whole list (run nbest without --shard)"
    return _list_conflicts(args)


def _report_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--html", type=Path, help="self-contained HTML error analysis to write")
    parser.add_argument(
        "--allow-unnormalised", action="store_true", help="allow interp with a neural LM whose scores are unnormalised"
    )
    parser.add_argument(
        "--no-overlap-check", action="store_true", help="skip the leakage check against the LM's training text"
    )


def _model_arguments(parser: argparse.ArgumentParser, from_weights: bool = False) -> None:
    default = " (default: the one the weights were tuned with)" if from_weights else ""
    parser.add_argument("--lm", help=f"neural LM bundle{default}")
    parser.add_argument("--ngram", help=f"n-gram model, ARPA or KenLM binary{default}")
    parser.add_argument("--normalize", choices=sorted(PRESETS), help=f"text normalisation preset for the LMs{default}")
    parser.add_argument(
        "--server",
        metavar="HOST:PORT",
        help=f"score with a running lm-serve instead{default}"
        + ("; nbest: several, comma-separated (a fleet; see --concurrency)" if from_weights else ""),
    )
    parser.add_argument("--server-model", help=f"the served model (default: the server's default){default}")
    parser.add_argument(
        "--context",
        choices=CONTEXTS,
        help="document context: the neural LM reads the earlier utterances of each document (their first-pass "
        "1-best; nbest rescores again with its own choices) before scoring the next; documents by list order, by "
        "utterance id (SPEAKER-CHAPTER-UTT) or by a JSON Lines list's document field; with --shard, shards are cut "
        f"at document boundaries; needs a bundle trained in stream mode (docs/rescoring.md){default}",
    )
    parser.add_argument("--server-ca", type=Path, help="PEM file of the CA of a TLS server (implies TLS)")


def _models_given(args, saved: dict) -> bool:
    """Whether LM scores will be there: a model on the command line or in the weights file, or a server."""
    return any(getattr(args, name) or saved.get(name) for name in ("lm", "ngram", "server"))


def _check_saved_models(args, saved: dict, weights: Path) -> None:
    """The models a weights file names (where the command line does not override them) must exist, and the models to
    be used must be the ones the weights were tuned with (``core.fingerprints``), unless a server scores."""
    for name in ("lm", "ngram"):
        path = saved.get(name)
        if path and not getattr(args, name) and not args.server and not Path(path).exists():
            raise FileNotFoundError(
                f"{weights}: field 'setup.{name}': {path}: no such file or folder (or give --{name})"
            )
    local = {name: getattr(args, name) or saved.get(name) for name in ("lm", "ngram")}
    if args.server or (saved.get("server") and not any(getattr(args, n) for n in ("lm", "ngram", "normalize"))):
        return
    for warning in check_fingerprints(weights, saved.get("fingerprints"), local, args.accept_changed_models):
        print(f"lm-rescore: warning: {warning}", file=sys.stderr)


def _language_models(args, saved: dict, weights: Path | None = None, setup: Setup | None = None):
    """Models loaded here, or a running lm-serve's (``--server``, or the server the weights were tuned with): with
    ``setup`` (``nbest``) a fleet of them, answering ``RescoreNBest`` with the LM features of whole lists."""
    local = [name for name in ("lm", "ngram", "normalize") if getattr(args, name)]
    server = args.server or (None if local else saved.get("server"))
    context = args.context or saved.get("context")
    if server is None:
        try:
            return LanguageModels.load(
                args.lm or saved.get("lm"),
                args.ngram or saved.get("ngram"),
                args.normalize or saved.get("normalize"),
                args.threads,
                device=args.device,
                precision=args.precision,
                context=context,
            )
        except (ValueError, OSError, NgramError) as e:
            if weights is None or (args.lm and args.ngram):
                raise
            raise ValueError(f"{weights}: the models it names: {e}") from e
    if local:
        raise ValueError(f"--server scores with the served model's LMs and text settings: leave out --{local[0]}")
    if context:
        raise ValueError("--context scores with a local bundle: leave out --server")
    model = args.server_model or saved.get("model", "")
    if setup is not None:
        from lmserve.rescoring.commands.fleet import Fleet, FleetLanguageModels, parse_targets

        ca = None if args.server_ca is None else str(args.server_ca)
        fleet = Fleet(parse_targets(server), model, args.concurrency, args.deadline, ca)
        return FleetLanguageModels(fleet, setup, args.lists_per_call)
    from lmserve.rescoring.client import LMServeClient
    from lmserve.rescoring.commands.remote import RemoteLanguageModels

    client = LMServeClient(server, timeout=600, ca=args.server_ca, tls=args.server_ca is not None)
    return RemoteLanguageModels(client, model)


def _read_paths(args, saved: dict | None = None) -> dict:
    """What ``tune`` and ``nbest`` read, by the flag that names it (``core.outputs``): the list (or the systems'
    files and the source), references and models, and ``nbest``'s weights file with the models it names."""
    lists = getattr(args, "lists", None) or args.list
    given = {"--systems": args.systems, "--source": args.source} if args.systems else {"LIST": lists}
    given |= {"--references": args.references, "--lm": args.lm, "--ngram": args.ngram}
    if saved is not None:
        given["--weights"] = args.weights
        given |= {f"--weights' setup.{name}": saved.get(name) for name in ("lm", "ngram") if not getattr(args, name)}
    return given


def _cache_path(args, shard: Shard | None = None) -> Path:
    name = args.list.name.split(".")[0] + ("" if shard is None else f".{shard.suffix}")
    return args.cache or args.out.with_name(f"{name}.lmscores.jsonl")


def _list_cache(args, path: Path) -> Path:
    """The score cache of one of ``tune``'s several lists, beside ``--out``."""
    return args.out.with_name(f"{path.name.split('.')[0]}.lmscores.jsonl")


def _joined(parts: list[NBestList]) -> NBestList:
    """Several lists as one, to tune on together (their names joined with +)."""
    names = [part.name for part in parts]
    if len(set(names)) != len(names):
        raise ValueError(f"LIST: two lists named {names[0]!r}: give lists of distinct names (the files' up to a dot)")
    return NBestList([e for part in parts for e in part.entries], "+".join(names))


def _joined_scores(scores: list):
    return None if scores[0] is None else [row for part in scores for row in part]


def _read_list(args, path: Path | None = None) -> NBestList:
    if args.max_words < 1:
        raise ValueError(f"--max-words {args.max_words}: expected at least 1")
    defaults = parse_defaults(args.feature_default)
    if args.systems:
        from lmserve.rescoring.nbest import read_systems  # only --systems needs it

        return read_systems(
            args.systems, args.source, args.references, feature_defaults=defaults, max_words=args.max_words
        )
    path = args.list if path is None else path
    nbest = read_nbest(path, args.format, args.references, feature_defaults=defaults, max_words=args.max_words)
    return nbest if len(getattr(args, "lists", None) or []) < 2 else NBestList(nbest.entries, _name(path))


def _name(path: Path) -> str:
    return path.name.split(".")[0] or path.name


def _lambdas(text: str) -> list[float]:
    try:
        return [check_lambda(float(x)) for x in text.split(",")]
    except ValueError as e:
        raise ValueError(f"--lambdas {text!r}: expected comma-separated numbers in (0, 1) ({e})") from None


def _methods(text: str) -> list[str]:
    methods = [m.strip() for m in text.split(",")]
    if unknown := [m for m in methods if m not in METHODS]:
        raise ValueError(f"--methods {text!r}: unknown method {unknown[0]!r}; expected some of {', '.join(METHODS)}")
    return methods


def run_tune(args) -> int:
    start = time.perf_counter()
    setup = Setup.parse(args.features, args.define)  # every flag, the list and the outputs first: then the models
    lambdas, methods = _lambdas(args.lambdas), _methods(args.methods)
    if args.fixed is not None and args.fixed not in setup.features:
        raise ValueError(f"--fixed {args.fixed!r}: not one of --features {','.join(setup.features)}")
    bounds = check_bounds(parse_bounds(args.bounds), setup.features, args.fixed or setup.features[0])
    if not args.penalty >= 0:
        raise ValueError(f"--penalty {args.penalty}: expected a number >= 0")
    length_ratio = parse_length_ratio(args.length_ratio, args.metric)
    if args.require_folds and not 0 < args.require_folds <= args.cv:
        raise ValueError(f"--require-folds {args.require_folds}: expected 1 to --cv ({args.cv})")
    shard = Shard.parse(args.shard) if args.shard else None
    paths = args.lists or [args.list]
    caches = [_cache_path(args, shard)] if len(paths) == 1 else [_list_cache(args, path) for path in paths]
    check_outputs({"--out": args.out, "--cache": caches, "--html": args.html}, _read_paths(args))
    parts = [_read_list(args)] if len(paths) == 1 else [_read_list(args, path) for path in paths]
    nbest = parts[0] if len(parts) == 1 else _joined(parts)
    if args.cv and not 2 <= args.cv <= len(nbest):
        raise ValueError(f"--cv {args.cv}: expected 0 (none) or 2 to {len(nbest)} folds (the list's entries)")
    references_of(nbest, args.metric)
    check_features(nbest, setup.features, setup.definitions, lambdas[0], _models_given(args, {}))
    models = _language_models(args, {})
    check_normalisation(getattr(models, "normalisation", None), setup, args.allow_unnormalised)
    if shard:
        return _score_shard(args, models, nbest, _at_documents(shard, nbest, args.context))
    leakage = _overlap_check(args, models, nbest)
    lm_scores = _joined_scores(
        [models.scores(part, cache, progress=not args.quiet) for part, cache in zip(parts, caches, strict=True)]
    )
    owners = None if len(parts) == 1 else [part.name for part in parts for _ in part.entries]
    search = {"methods": methods, "restarts": args.restarts, "seed": args.seed, "bounds": bounds}
    search["length_ratio"] = length_ratio
    tuned = tune_setup(
        nbest, setup, lm_scores, args.metric, args.fixed, lambdas, args.cv,
        penalty=args.penalty, require_folds=args.require_folds, owners=owners, **search,
    )  # fmt: skip
    extra = {"cross_validation": tuned.cross_validation} if tuned.cross_validation else {}
    extra["adopted"] = tuned.adopted
    extra["dev_metric_by_lambda"] = {str(k): v for k, v in tuned.by_lambda.items()}
    if len(parts) > 1:
        extra["dev_lists"] = {part.name: len(part) for part in parts}
    paths_of = getattr(models, "paths", {}) or {}
    added = lms_added(
        tuned.data, tuned.setup, tuned.result.fixed, bool(paths_of.get("lm")), bool(paths_of.get("ngram")),
        {**search, "penalty": args.penalty}, args.cv,
        (tuned.cross_validation or {}).get("chosen"), tuned.result.dev_metric,
    )  # fmt: skip
    if added:
        extra["lms_added"] = added
    extra["list_statistics"] = list_statistics(nbest, carried_features(setup.features, setup.definitions, nbest))
    if leakage:
        extra["overlap"] = leakage
    write_weights(args.out, tuned.result, setup_record(models, tuned.setup), **extra)
    if args.html:
        from lmserve.rescoring.report_html import tune_plots, write_html

        ranked, chosen = reranked(nbest, tuned.setup, lm_scores)
        weights = {"file": str(args.out), **tuned.result.weights}
        rep = _full_report(nbest, chosen, args.metric, models, tuned.setup, weights, leakage)
        try:
            plots = tune_plots(tuned, args.metric)
        except ImportError:  # matplotlib comes with lmserve[train], not with the torch-free install
            print("lm-rescore: warning: --html: no plots without matplotlib (pip install matplotlib)", file=sys.stderr)
            plots = []
        write_html(args.html, rep, nbest, ranked, chosen, plots, title=f"lm-rescore tune: {nbest.name}")
    r = tuned.result
    print(
        f"{nbest.name}: {args.metric} {r.baseline_metric:.2f} -> {r.dev_metric:.2f} on the dev list "
        f"(runs: min {r.spread['min']:.2f}, mean {r.spread['mean']:.2f}, max {r.spread['max']:.2f})"
        + (f", λ = {tuned.setup.lam}" if tuned.setup.lam is not None else "")
    )
    if tuned.cross_validation:
        cv = tuned.cross_validation
        print(
            f"{cv['folds']}-fold cross-validation: held-out {args.metric} {cv['heldout_metric']:.2f} (baseline {cv['baseline_metric']:.2f})"
        )
    print(format_stability(r, tuned.cross_validation))
    if added:
        print(format_lms_added(added, args.metric))
    if not tuned.adopted:
        kept = f"{r.fixed} = {r.weights[r.fixed]:g}"
        print(f"fewer than {args.require_folds} folds gained: the first pass alone is kept ({kept})")
    print("weights: " + ", ".join(f"{k}={v:.4g}" for k, v in r.weights.items()) + f"  -> {args.out}")
    print(f"({time.perf_counter() - start:.1f} s)", file=sys.stderr)
    return 0


def _at_documents(shard: Shard | None, whole: NBestList, context: str | None) -> Shard | None:
    """With document context, the shard cut at document boundaries: it scores what one run scores."""
    return shard.at_documents(document_keys(whole, context)) if shard and context else shard


def _score_shard(args, models, whole: NBestList, shard: Shard) -> int:
    """``tune --shard``: the LM scores of one range of the list, cached with where they lie in the whole list."""
    part = shard.select(whole)
    cache = _cache_path(args, shard)
    scores = models.scores(part, None, progress=not args.quiet)
    write_cache(cache, models.cache_key(part), part, scores, cache_shard(shard, whole, models.cache_key(whole)))
    start = shard.bounds(len(whole))[0]
    print(f"shard {shard}: LM scores of entries {start + 1} to {start + len(part)} of {len(whole)} -> {cache}")
    return 0


def run_nbest(args) -> int:
    record = read_weights(args.weights)  # every flag, the list and the outputs first: then the models
    saved = record.get("setup", {})
    setup = setup_from_record(record)
    shard = Shard.parse(args.shard) if args.shard else None
    out_format = output_format(args.out, args.out_format)
    check_outputs(
        {"--out": args.out, "--cache": _cache_path(args, shard), "--report": args.report, "--html": args.html},
        _read_paths(args, saved),
        folders={"--out"} if out_format in FOLDER_FORMATS else (),
    )
    _check_saved_models(args, saved, args.weights)
    whole = _read_list(args)
    shard = _at_documents(shard, whole, args.context or saved.get("context"))
    nbest = shard.select(whole) if shard else whole
    if not args.no_metrics:
        references_of(whole, record["metric"])
    check_features(whole, setup.features, setup.definitions, setup.lam, _models_given(args, saved))
    drift = _list_drift(record, whole)
    models = _language_models(args, saved, args.weights, setup)
    check_normalisation(getattr(models, "normalisation", None), setup, args.allow_unnormalised)
    leakage = None if args.no_metrics else _overlap_check(args, models, nbest)
    lm_scores = models.scores(nbest, _cache_path(args, shard), progress=not args.quiet)
    ranked, chosen = reranked(nbest, setup, lm_scores)
    if getattr(models, "context", None):  # again, the LM reading what this pass chose instead of the 1-best
        history = [e.hypotheses[i].text for e, i in zip(nbest.entries, chosen, strict=True)]
        lm_scores = models.scores(nbest, None, progress=not args.quiet, history=history)
        ranked, chosen = reranked(nbest, setup, lm_scores)
    write_nbest(ranked, args.out, out_format)
    if args.no_metrics and not shard:
        print(f"{nbest.name}: {len(nbest)} lists reranked -> {args.out}")
        return 0
    stats, rep = None, {"list": nbest.name, "utterances": len(nbest), "hypotheses": nbest.num_hypotheses}
    if not args.no_metrics:
        stats = utterance_stats(nbest, chosen, record["metric"])
        weights = {"file": str(args.weights), **record["weights"]}
        rep = _full_report(nbest, chosen, record["metric"], models, setup, weights, leakage, stats)
        has_lm = bool((getattr(models, "paths", None) or {}).get("lm"))
        terms = lm_terms_stats(nbest, setup, lm_scores, record["metric"], has_lm)
        effect = None  # a shard's is the merge's to compute, from every shard's rows
        if terms is not None and not shard:
            effect = lm_terms_report(*terms, record["metric"], rep["1best"]["signature"], rep["bootstrap"]["samples"])
        added = {"on_this_list": effect, "at_tune_time": record.get("lms_added")}
        if terms is not None or added["at_tune_time"]:
            rep["lms_added"] = {k: v for k, v in added.items() if v or (k == "on_this_list" and terms)}
    if drift:
        rep["list_statistics"] = drift
    if shard:
        start = shard.bounds(len(whole))[0]
        if "overlap" in rep:  # its offenders numbered among the references of the whole list
            rep["overlap"] = renumbered(rep["overlap"], sum(len(e.references) for e in whole.entries[:start]))
        identity = _run_identity(args, whole, models, out_format, shard)
        rep["shard"] = shard_record(shard, whole, identity, args.out, out_format, args.report, stats)
        if stats is not None and terms is not None:
            rep["shard"]["lm_terms"] = {"features": terms[0], "stats": terms[1].tolist()}
    if args.report:
        write_report(args.report, rep)
    if args.html:
        from lmserve.rescoring.report_html import write_html

        write_html(args.html, rep, nbest, ranked, chosen)
    if stats is not None:
        print(format_report(rep))
        if (rep.get("lms_added") or {}).get("on_this_list"):
            print(_format_effect(rep["lms_added"]["on_this_list"], record["metric"]))
    if shard:
        print(f"shard {shard}: entries {start + 1} to {start + len(nbest)} of {len(whole)} -> {args.out}")
    return 0


def _list_drift(record: dict, nbest: NBestList) -> dict | None:
    """This list's statistics beside the ones the weights were tuned on (``rescoring.liststats``), each way it is
    far from them a warning on stderr; None for a weights file written before tune recorded them."""
    tuned = record.get("list_statistics")
    if not tuned:
        return None
    now = list_statistics(nbest, [f for f in tuned.get("features", {}) if f in set(nbest.feature_names())])
    warnings = compare(tuned, now)
    for warning in warnings:
        print(f"lm-rescore: warning: {nbest.name}: {warning} (tuned on {record['dev_set']})", file=sys.stderr)
    return {"tuned": tuned, "this_list": now, "warnings": warnings}


def _format_effect(effect: dict, metric: str) -> str:
    b = effect["bootstrap"]
    return (
        f"without the LM terms ({', '.join(effect['lm_features'])} at weight 0, the rest as tuned): "
        f"{metric.upper()} {effect[metric]:.2f}; the LMs changed {effect['choices_changed_by_lms']} choices, "
        f"{b['delta']:+.2f}, p = {b['p_value']:.4f} (paired bootstrap)"
    )


def _run_identity(args, whole: NBestList, models, out_format: str, shard: Shard) -> dict:
    """What the shards of one run share, and ``merge`` compares: the input, the number of shards, the options that
    change the output, the models (by content). Output paths, threads and the fleet's settings are left out."""
    return {
        "list": {"path": str(args.list), **fingerprint(args.list)},
        "texts": texts_fingerprint(whole),
        "utterances": len(whole),
        "shards": shard.count,
        "options": {
            "format": args.format,
            "references": [{"path": str(p), **fingerprint(p)} for p in args.references or []],
            "weights": {"path": str(args.weights), **fingerprint(args.weights)},
            "feature_default": args.feature_default,
            "max_words": args.max_words,
            "out_format": out_format,
            "no_metrics": args.no_metrics,
        },
        "models": models.fingerprint,
    }


def run_merge(args) -> int:
    if args.caches:
        if args.reports or args.out or args.report or not args.cache:
            raise ValueError("merge --caches CACHE... --cache OUT joins tune --shard caches; give nothing else")
        check_outputs({"--cache": args.cache}, {"--caches": args.caches})
        entries = merge_caches(args.caches, args.cache)
        print(f"{len(args.caches)} shards, {entries} lists -> {args.cache}; tune with --cache {args.cache}")
        return 0
    if not args.reports or not args.out:
        raise ValueError("merge REPORT... --out OUT [--report REPORT]: give every shard's report and --out")
    shards = read_shards(args.reports)
    if args.report and shards[0][1]["shard"]["stats"] is None:
        raise ValueError(f"--report {args.report}: the shards ran with --no-metrics; there are no figures to merge")
    fmt = merged_format(shards, args.out, args.out_format)
    read = {"REPORT": args.reports}
    for path, rep in shards:
        read[f"shard {rep['shard']['index']}/{rep['shard']['count']}'s output (named by {path})"] = shard_output(
            path, rep
        )
    check_outputs(
        {"--out": args.out, "--report": args.report}, read, folders={"--out"} if fmt in FOLDER_FORMATS else ()
    )
    merged = merge(shards, args.out, fmt, OFFENDERS)
    if merged.report is None:
        print(f"{len(args.reports)} shards, {len(merged.nbest)} lists -> {args.out}")
        return 0
    if args.report:
        write_report(args.report, merged.report)
    print(format_report(merged.report))
    print(f"{len(args.reports)} shards, {len(merged.nbest)} lists -> {args.out}", file=sys.stderr)
    return 0


def _full_report(
    nbest: NBestList, chosen, metric: str, models, setup: Setup, weights: dict, leakage, stats=None
) -> dict:
    """The report (``rescoring.rescore.report``, from ``stats`` when they were computed already) with what a reader
    needs beside the figures: the weights and setup, the neural LM's normalisation and the leakage check."""
    stats = utterance_stats(nbest, chosen, metric) if stats is None else stats
    references = len(nbest.entries[0].references) if len(nbest) else 0
    rep = report_from_stats(nbest.name, metric, stats, references)
    rep["weights"] = weights
    rep["setup"] = setup_record(models, setup)
    rep["normalisation"] = getattr(models, "normalisation", None)
    if leakage:
        rep["overlap"] = leakage
    return rep


def _references(nbest: NBestList) -> tuple[list[str], list[str]]:
    """Every reference of a list, and a name for each (the entry's id, with "#k" for the k-th of several)."""
    refs, ids = [], []
    for e in nbest:
        for k, ref in enumerate(e.references):
            refs.append(ref)
            ids.append(e.id if len(e.references) == 1 else f"{e.id}#{k + 1}")
    return refs, ids


def _overlap_check(args, models, nbest: NBestList) -> dict | None:
    """The leakage guard, run automatically when the neural LM's manifest names training files that are on this
    machine: the list's references (through the LMs' text normaliser) against them; a warning above ``WARN_SHARE``."""
    scorer = getattr(models, "scorer", None)
    if args.no_overlap_check or scorer is None:
        return None
    texts = overlap.training_texts(scorer.bundle.manifest)
    refs, ids = _references(nbest)
    if not texts or not refs:
        return None
    try:
        result = overlap.measure(refs, texts, ids=ids, reference_view=models.normalizer.normalize, offenders=OFFENDERS)
    except overlap.NoReferences:  # references without a word (the metric says what it thinks of them)
        return None
    print(f"lm-rescore: {result.summary()}", file=sys.stderr)
    warning = result.warning()
    if warning:
        print(f"lm-rescore: warning: {warning}", file=sys.stderr)
    return {**result.to_dict(), "warning": warning}


def run_overlap(args) -> int:
    if args.list is None and not args.references:
        raise ValueError("overlap: give --list LIST (its references) or --references FILE...")
    check_outputs({"--json": args.json}, {"--text": args.text, "--list": args.list, "--references": args.references})
    if args.list is not None:
        nbest = read_nbest(args.list, args.format, args.references)
        refs, ids = _references(nbest)
        given, what = f"--list {args.list}", f"its {len(nbest)} entries"
    else:
        refs, ids = [], []
        for path in args.references:
            lines = split_lines(read_text(path))  # (plain or .gz, without a byte-order mark)
            refs += lines
            ids += [f"{path}:{i}" for i in range(1, len(lines) + 1)]
        given, what = f"--references {' '.join(map(str, args.references))}", f"its {len(refs)} lines"
    if not any(ref.split() for ref in refs):
        raise ValueError(
            f"{given}: no references to check ({what} hold none with a word); expected the test set's references "
            "(a list that carries them, or --references FILE, one a line)"
        )
    views = {
        name: PRESETS[preset].normalize if preset else overlap.words_of
        for name, preset in (("reference_view", args.normalize), ("text_view", args.normalize_text))
    }
    result = overlap.measure(refs, args.text, args.n, ids=ids, offenders=args.offenders, **views)
    print(result.summary())
    for o in result.offenders:
        print(
            f"  {o.covered_words}/{o.words} words, {o.windows_found} found, first at {o.first_found}: {o.id}  {o.text}"
        )
    warning = result.warning(args.threshold)
    if warning:
        print(f"lm-rescore: warning: {warning}", file=sys.stderr)
    if args.json:
        atomic_write_text(args.json, json.dumps({**result.to_dict(), "warning": warning}, indent=2) + "\n")
    return 0
