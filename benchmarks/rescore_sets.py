"""Rescoring where the first pass had no LM, every figure held out -> rescore_hyporadise_{cv,transfer}.json and
rescore_atis.json

    python -m benchmarks.rescore_sets hyporadise --lm BUNDLE --ngram NGRAM --lm-text TEXT [--domain SET=NGRAM:TEXT ...]
    python -m benchmarks.rescore_sets atis --jackknife-lm PATTERN --jackknife-ngram PATTERN --jackknife-text PATTERN \\
        --test-lm BUNDLE --test-ngram NGRAM --general-lm BUNDLE --general-ngram NGRAM --lm-text TEXT...

The protocol is ``lmserve.rescoring.evaluation``'s (``lm-rescore evaluate``); this script keeps the result files'
layout and the sets' own choices: data paths, in-domain n-grams per set, ATIS's jackknifed LMs. The full commands,
the LMs they need and the figures: docs/benchmarks/rescoring.md ("Rescoring where the first pass had no LM").
WMT22's figures (``rescore_wmt22_*.json``) are ``lm-rescore evaluate``'s, command in that page.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path

from benchmarks import common
from benchmarks.common import DATA_DIR as DATA
from benchmarks.common import ROOT, write_result
from lmserve.core.textnorm import PRESETS
from lmserve.rescoring.evaluation import in_sample_ceiling, kfold, leakage, transfer, tuned_on
from lmserve.rescoring.nbest import NBestList, read_nbest
from lmserve.rescoring.rescore import LanguageModels, Setup
from lmserve.rescoring.tune import fold_indices, parse_bounds

MAX_WORDS = 1000  # the longest hypothesis read (lm-rescore evaluate --max-words)
NORMALIZE = "librispeech"  # the hypotheses in the LMs' text form (core.textnorm)
# The recipe and its ablations (LM alone, consensus alone, both): features and the one fixed at weight 1 (the
# scale), the same for every set, so that it can be judged on sets it was not made on. Lists without scores: the
# first pass's order (prior = -rank). ATIS: its first-pass score, am_score, in prior's place. ``nonword``: ASR
# references are spoken words, so a hypothesis' stray "." is an error the LMs cannot see (they score normalised text).
ASR_RECIPES = {
    "lm": ("prior,neural,ngram,oov,length,nonword", "prior"),
    "consensus": ("prior,consensus_wer,length,nonword", "prior"),
    "both": ("prior,consensus_wer,neural,ngram,oov,length,nonword", "prior"),
}
ASR_DEFINITIONS = ["prior=-1*rank"]
BOUNDS = "neural=0:,ngram=0:"  # an LM weight below 0 would reward what the LM finds unlikely
# penalty: of two weight vectors the dev folds cannot tell apart, the one nearer the base wins (rescoring.tune)
SEARCH = {"restarts": 6, "penalty": 0.01, "bounds": parse_bounds(BOUNDS)}


def list_name(path: Path) -> str:
    return path.name.split(".")[0]


def cache_name(path: Path, span: tuple[int, int] | None = None) -> str:
    """The LM score cache of the lists of ``path`` (of its entries ``span`` only, when given), under a models' folder."""
    key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:8]
    return f"{list_name(path)}-{key}{f'-{span[0]}-{span[1]}' if span else ''}.lmscores.jsonl"


def load(path: Path, models: LanguageModels, cache: Path):
    nbest = read_nbest(path, max_words=MAX_WORDS)
    return nbest, models.scores(nbest, cache / cache_name(path), progress=True)


def load_models(args, lm: Path, ngram: Path) -> tuple[LanguageModels, Path]:
    models = LanguageModels.load(lm, ngram, NORMALIZE, args.threads)
    return models, (args.cache_dir or ROOT / "var" / "cache") / f"{Path(lm).name}__{Path(ngram).stem}"


def ablated(run, recipes: dict[str, tuple[str, str]]) -> tuple[dict, dict]:
    """``run(features, fixed)`` for every recipe: the figures and details of "both", with every recipe's figures
    under ``details["ablation"]``."""
    results = {name: run(features, fixed) for name, (features, fixed) in recipes.items()}
    figures, details = results["both"]
    details["ablation"] = {name: fig for name, (fig, _) in results.items()}
    return figures, details


def ceiling(nbest, scores, recipes: dict[str, tuple[str, str]], metric: str, definitions=()) -> float:
    """The reported recipe's (``both``'s) ``in_sample_ceiling`` on one set."""
    features, fixed = recipes["both"]
    return in_sample_ceiling(nbest, scores, Setup.parse(features, definitions), metric, fixed, SEARCH)


def recipe_text(recipes: dict[str, tuple[str, str]]) -> str:
    features, fixed = recipes["both"]
    return f"features {features} ({fixed} fixed at 1; bounds {BOUNDS}, penalty {SEARCH['penalty']})"


HYPORADISE = {
    "chime4": DATA / "hyporadise" / "test_chime4.json.gz",
    "td3": DATA / "hyporadise" / "test_td3.json.gz",
    "swbd": DATA / "hyporadise" / "test_swbd.json.gz",
    "wsj": DATA / "wsj-nbest" / "dev.json",
}
GUARD = 5  # the guarded figure's folds, all of which must gain (docs/rescoring-asr.md: "--cv 5 --require-folds 5")


def hyporadise_sets(extra: list[str]) -> dict[str, Path]:
    """The four sets of the issue, then every further HyPoradise test list in the data folder (``test_NAME.json.gz``,
    ATIS aside: it has its own protocol) and every ``--extra NAME=PATH`` list, by name."""
    sets = dict(HYPORADISE)
    for path in sorted((DATA / "hyporadise").glob("test_*.json.gz")):
        name = list_name(path).removeprefix("test_")
        if name != "atis" and name not in sets:
            sets[name] = path
    for pair in extra:
        name, _, path = pair.partition("=")
        if not name or not path or name in sets:
            raise SystemExit(f"--extra {pair!r}: expected NAME=PATH with a NAME not among {', '.join(sets)}")
        sets[name] = Path(path)
    return sets


def domain_choices(pairs: list[str], sets: dict[str, Path]) -> dict[str, tuple[Path, Path]]:
    """``SET=NGRAM:TEXT`` arguments -> {set: (the set's in-domain n-gram, the text behind it)}."""
    out = {}
    for pair in pairs:
        name, _, rest = pair.partition("=")
        ngram, _, text = rest.partition(":")
        if name not in sets or not ngram or not text:
            raise SystemExit(f"--domain {pair!r}: expected SET=NGRAM:TEXT with SET one of {', '.join(sets)}")
        out[name] = (Path(ngram), Path(text))
    return out


def scored_sets(args, sets: dict[str, Path], ngrams: dict[str, Path]) -> tuple[dict[str, tuple], object]:
    """Every set's list and LM scores, each set's n-gram ``ngrams[set]`` beside the neural LM."""
    lists, normalizer = {}, None
    for ngram in dict.fromkeys(ngrams.values()):
        models, cache = load_models(args, args.lm, ngram)
        normalizer = models.normalizer
        lists |= {name: load(path, models, cache) for name, path in sets.items() if ngrams[name] == ngram}
    return {name: lists[name] for name in sets}, normalizer


def evaluated_sets(args, lists: dict[str, tuple]) -> tuple[dict, dict, dict, dict]:
    """K-fold CV inside each set (and the same with the tuning guard nested), and each set with the weights tuned
    on the union of the issue's sets (``HYPORADISE``) other than itself: figures and details."""
    cv, cv_details, moved, moved_details = {}, {}, {}, {}

    @functools.cache
    def tuned(others: tuple[str, ...], features: str, fixed: str):  # the further sets all take the four's weights
        setup = Setup.parse(features, ASR_DEFINITIONS)
        return tuned_on([lists[o][0] for o in others], [lists[o][1] for o in others], setup, "wer", fixed, SEARCH)

    for name, (nbest, scores) in lists.items():
        figures, cv_details[name] = ablated(
            lambda f, fixed, nbest=nbest, scores=scores: kfold(
                nbest, scores, Setup.parse(f, ASR_DEFINITIONS), "wer", args.folds, fixed, SEARCH
            ),
            ASR_RECIPES,
        )
        cv_details[name]["in_sample_ceiling"] = ceiling(nbest, scores, ASR_RECIPES, "wer", definitions=ASR_DEFINITIONS)
        for key in ("wer_1best", "wer_rescored", "folds", "folds_improved"):
            cv[f"{name}_{key}"] = figures[key]
        features, fixed = ASR_RECIPES["both"]
        guarded, details = kfold(
            nbest, scores, Setup.parse(features, ASR_DEFINITIONS), "wer", args.folds, fixed, SEARCH, guard=GUARD
        )
        cv_details[name]["guarded"] = {**guarded, **details}
        cv[f"{name}_wer_rescored_guarded"] = guarded["wer_rescored"]
        others = tuple(o for o in HYPORADISE if o != name)
        figures, moved_details[name] = ablated(
            lambda f, fixed, others=others, nbest=nbest, scores=scores: transfer(
                tuned(others, f, fixed), nbest, scores, Setup.parse(f, ASR_DEFINITIONS), "wer"
            ),
            ASR_RECIPES,
        )
        moved.update({f"{name}_wer_1best": figures["wer_1best"], f"{name}_wer_rescored": figures["wer_rescored"]})
    return cv, cv_details, moved, moved_details


def run_hyporadise(args) -> None:
    """Every set (``hyporadise_sets``) scored by the neural LM and the general n-gram (``--ngram``), and, where
    ``--domain`` gives one, by the neural LM and the set's in-domain n-gram (the headline figures; the general ones
    are the ablation without adaptation, ``S_wer_rescored_general``)."""
    sets = hyporadise_sets(args.extra or [])
    domains = domain_choices(args.domain or [], sets)
    kinds = {"general": {name: args.ngram for name in sets}}
    if domains:
        kinds["adapted"] = {name: domains[name][0] if name in domains else args.ngram for name in sets}
    results, leaks = {}, {}
    for kind, ngrams in kinds.items():
        lists, normalizer = scored_sets(args, sets, ngrams)
        results[kind] = evaluated_sets(args, lists)
        leaks[kind] = guarded(
            [
                (name, nbest, (*args.lm_text, *([domains[name][1]] if kind == "adapted" and name in domains else [])))
                for name, (nbest, _) in lists.items()
            ],
            normalizer,
        )
    headline = "adapted" if domains else "general"
    cv, cv_details, moved, moved_details = results[headline]
    if domains:
        general_cv, _, general_moved, _ = results["general"]
        cv |= {f"{name}_wer_rescored_general": general_cv[f"{name}_wer_rescored"] for name in sets}
        moved |= {f"{name}_wer_rescored_general": general_moved[f"{name}_wer_rescored"] for name in sets}
    adaptation = (
        "; in-domain n-grams (the set's n-gram: " + ", ".join(f"{n} {d[0].name}" for n, d in domains.items()) + ")"
        if domains
        else ""
    )
    details = {kind: {"cv": r[1], "transfer": r[3]} for kind, r in results.items()}
    further = [name for name in sets if name not in HYPORADISE]
    write_result(
        "rescore_hyporadise_cv",
        cv,
        protocol=f"{args.folds}-fold cross-validation over contiguous utterances of each set; "
        f"{recipe_text(ASR_RECIPES)} with {ASR_DEFINITIONS[0]}, WER tuned{adaptation}; S_wer_rescored_guarded: "
        f"the same with the tuning guard ({GUARD} of {GUARD} folds of each training part must gain) nested",
        details={kind: d["cv"] for kind, d in details.items()},
        leakage=leaks,
        sets={name: str(path) for name, path in sets.items()},
    )
    write_result(
        "rescore_hyporadise_transfer",
        moved,
        protocol=f"each of {', '.join(HYPORADISE)} rescored with weights tuned on the union of the other three"
        + (f", each of {', '.join(further)} with weights tuned on the union of all four" if further else "")
        + f"; {recipe_text(ASR_RECIPES)}{adaptation}",
        details={kind: d["transfer"] for kind, d in details.items()},
        leakage=leaks,
        sets={name: str(path) for name, path in sets.items()},
    )


ATIS_RECIPES = {name: (f.replace("prior", "am_score"), "am_score") for name, (f, _) in ASR_RECIPES.items()}


def atis_folds(n: int, k: int) -> list[tuple[int, int]]:
    """The jackknife's folds of train_atis: ``k`` contiguous spans [a, b) of its ``n`` lists."""
    return [(int(f[0]), int(f[-1]) + 1) for f in fold_indices(n, k, contiguous=True)]


def write_folds(text: str | Path, k: int, out: str | Path) -> None:
    """``OUT/k{j}_train.txt`` (the lines of ``text`` outside fold j: what fold j's LMs adapt on) and
    ``OUT/k{j}_heldout.txt`` (fold j's lines), for the ``k`` folds of ``atis_folds`` (one line per list)."""
    lines = Path(text).read_text(encoding="utf-8").splitlines(keepends=True)
    Path(out).mkdir(parents=True, exist_ok=True)
    for j, (a, b) in enumerate(atis_folds(len(lines), k)):
        Path(out, f"k{j}_train.txt").write_text("".join(lines[:a] + lines[b:]), encoding="utf-8")
        Path(out, f"k{j}_heldout.txt").write_text("".join(lines[a:b]), encoding="utf-8")


@dataclass
class Part:
    """Lists of a set, the LMs that score them, and every text behind those LMs (the leakage guard's)."""

    nbest: NBestList
    cache: str  # the LM score cache's file name (``cache_name``)
    lm: Path
    ngram: Path
    texts: tuple[Path, ...]


def atis_parts(args, train_path: Path, test_path: Path) -> dict[str, tuple[list[Part], Part]]:
    """Per kind of LMs (general, adapted): the parts of train_atis the weights tune on, each with its own LMs, and
    test_atis with its LMs. Adapted (``--jackknife-lm/-ngram/-text``, ``{k}`` in each: the fold): every list of
    train_atis, fold k of ``--folds`` contiguous folds scored by LMs adapted on the references of the other folds."""
    train = read_nbest(train_path, max_words=MAX_WORDS)
    test = NBestList(read_nbest(test_path, max_words=MAX_WORDS).entries, list_name(test_path))
    general_text = tuple(args.general_text or args.lm_text)
    spans = atis_folds(len(train), args.folds)
    adapted = [
        (
            Path(args.jackknife_lm.format(k=k)),
            Path(args.jackknife_ngram.format(k=k)),
            (*general_text, Path(args.jackknife_text.format(k=k))),
        )
        for k in range(len(spans))
    ]
    general = (args.general_lm, args.general_ngram, general_text)

    def parts(models: list[tuple[Path, Path, tuple[Path, ...]]]) -> list[Part]:
        return [
            Part(NBestList(train.entries[a:b], f"{list_name(train_path)}[{a}:{b}]"), cache_name(train_path, (a, b)), *m)
            for (a, b), m in zip(spans, models, strict=True)
        ]

    test_lms = (args.test_lm, args.test_ngram, tuple(args.lm_text))
    return {
        "general": (parts([general] * len(spans)), Part(test, cache_name(test_path), *general)),
        "adapted": (parts(adapted), Part(test, cache_name(test_path), *test_lms)),
    }


def scored(args, parts: list[Part]) -> list[tuple[list, dict]]:
    """Each part's LM scores (cached per part and models) and what scored it: the models' paths and the bundle's
    own held-out perplexity (``lm-train export --heldout``); consecutive parts with the same LMs load them once."""
    out, models, cache, loaded = [], None, None, None
    for part in parts:
        if loaded != (part.lm, part.ngram):
            models, cache = load_models(args, part.lm, part.ngram)
            loaded = (part.lm, part.ngram)
        heldout = models.scorer.bundle.manifest.get("heldout") or {}
        about = {**models.paths, "bundle_heldout": {k: heldout.get(k) for k in ("file", "sentences", "ppl")}}
        out.append((models.scores(part.nbest, cache / part.cache, progress=True), about))
    return out


def guarded(lists: list[tuple[str, NBestList, tuple[Path, ...]]], normalizer) -> dict[str, dict]:
    """The leakage guard of each (name, list, the texts behind its LMs), one pass over each distinct set of texts
    (a pass over the general LM's text takes minutes)."""
    by_texts: dict[tuple[Path, ...], dict[str, NBestList]] = {}
    for name, nbest, texts in lists:
        by_texts.setdefault(texts, {})[name] = nbest
    result = {}
    for texts, named in by_texts.items():
        result.update(leakage(named, list(texts), normalizer))
    return result


def run_atis(args) -> None:
    """Weights tuned on train_atis's lists scored by LMs that never saw those lists' references, then applied to
    test_atis scored by LMs adapted on all of train_atis's references (``--test-lm``, ``--test-ngram``), as a user
    adapts on all the in-domain text there is. The tuning lists (``atis_parts``): all of train_atis, fold k scored by
    LMs adapted on the other folds' references (``--jackknife-*``). The general LMs (``--general-lm``,
    ``--general-ngram``) are the ablation without adaptation. Besides the figures on test_atis, each recipe's
    ``--folds``-fold cross-validation over the tuning lists (contiguous folds): a choice between recipes is made
    there, never on test_atis."""
    train_path, test_path = DATA / "hyporadise" / "train_atis.json.gz", DATA / "hyporadise" / "test_atis.json.gz"
    details = {}
    for kind, (parts, test_part) in atis_parts(args, train_path, test_path).items():
        *tune_scores, (test_scores, test_about) = scored(args, [*parts, test_part])
        tune_lists, scores = [p.nbest for p in parts], [s for s, _ in tune_scores]
        fig, det = ablated(
            lambda f, fixed, tl=tune_lists, ts=scores, test=test_part.nbest, test_scores=test_scores: transfer(
                tuned_on(tl, ts, Setup.parse(f), "wer", fixed, SEARCH), test, test_scores, Setup.parse(f), "wer"
            ),
            ATIS_RECIPES,
        )
        pooled = NBestList([e for p in parts for e in p.nbest.entries], "+".join(p.nbest.name for p in parts))
        pooled_scores = [s for part_scores in scores for s in part_scores]
        _, cv = ablated(
            lambda f, fixed, d=(pooled, pooled_scores): kfold(*d, Setup.parse(f), "wer", args.folds, fixed, SEARCH),
            ATIS_RECIPES,
        )
        det["cv_tune_lists"] = {"folds": args.folds, "ablation": cv["ablation"], "per_fold": cv["per_fold"]}
        det["in_sample_ceiling"] = ceiling(test_part.nbest, test_scores, ATIS_RECIPES, "wer")
        det["tune_models"] = {p.nbest.name: about for p, (_, about) in zip(parts, tune_scores, strict=True)}
        det["test_models"] = test_about
        det["leakage"] = guarded([(p.nbest.name, p.nbest, p.texts) for p in [*parts, test_part]], PRESETS[NORMALIZE])
        details[kind] = det
    adapted = details["adapted"]
    figures = {k: adapted["ablation"]["both"][k] for k in ("wer_1best", "wer_rescored")}
    figures["p_value"] = adapted["report"]["p_value"]
    figures["wer_rescored_general_lms"] = details["general"]["ablation"]["both"]["wer_rescored"]
    tuning = (
        f"all {sum(len(p.nbest) for p in parts)} lists of train_atis, fold k of {args.folds} contiguous folds "
        f"scored by LMs adapted on the references of the other {args.folds - 1} folds (jackknife)"
    )
    write_result(
        "rescore_atis",
        figures,
        protocol=f"weights ({recipe_text(ATIS_RECIPES)}) tuned on {tuning}, applied unchanged to test_atis scored by "
        "LMs adapted on all of train_atis's references",
        details=details,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("task", choices=("hyporadise", "atis"))
    parser.add_argument("--lm", type=Path, help="hyporadise: the LM bundle")
    parser.add_argument("--ngram", type=Path, help="hyporadise: the general n-gram")
    parser.add_argument("--general-lm", type=Path, help="atis: the general LM bundle, for the ablation")
    parser.add_argument("--general-ngram", type=Path, help="atis: the general n-gram, for the ablation")
    parser.add_argument("--test-lm", type=Path, help="atis: the LM bundle adapted on all of train_atis")
    parser.add_argument("--test-ngram", type=Path, help="atis: the n-gram adapted on all of train_atis")
    parser.add_argument(
        "--lm-text", type=Path, nargs="+", required=True, help="every text behind the LMs, for the leakage guard"
    )
    parser.add_argument(
        "--general-text", type=Path, nargs="+", help="atis: the text behind the general LMs (default: --lm-text)"
    )
    parser.add_argument(
        "--jackknife-lm",
        metavar="PATTERN",
        help="atis: fold k's LM bundle, adapted on the references of train_atis outside fold k of --folds contiguous "
        "folds ({k} in the pattern: 0 .. folds-1), which scores fold k's lists",
    )
    parser.add_argument("--jackknife-ngram", metavar="PATTERN", help="atis: fold k's n-gram (or mixture)")
    parser.add_argument(
        "--jackknife-text",
        metavar="PATTERN",
        help="atis: the in-domain text fold k's LMs adapted on, for the leakage guard (beside --general-text)",
    )
    parser.add_argument(
        "--domain",
        nargs="+",
        metavar="SET=NGRAM:TEXT",
        help="hyporadise: a set's in-domain n-gram (or mixture) and the text behind it, e.g. td3=var/ngrams/ted_mix.json:"
        "var/english-text-ted/train.txt.gz; the sets given are also scored with it (the headline figures)",
    )
    parser.add_argument(
        "--extra",
        nargs="+",
        metavar="NAME=PATH",
        help="hyporadise: further lists (any format lm-rescore reads), each cross-validated and rescored with the "
        "weights of the union of the four sets (further HyPoradise test_*.json.gz in the data folder are added "
        "without this)",
    )
    parser.add_argument("--folds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--cache-dir", type=Path, help="where LM score caches go, in BUNDLE__NGRAM/ (default: var/cache)"
    )
    common.add_results_option(parser)
    args = parser.parse_args()
    atis = [args.jackknife_lm, args.jackknife_ngram, args.jackknife_text, args.test_lm, args.test_ngram]
    if args.task == "hyporadise" and not (args.lm and args.ngram):
        parser.error("hyporadise needs --lm and --ngram")
    if args.task == "atis" and not all([*atis, args.general_lm, args.general_ngram]):
        parser.error(
            "atis needs --jackknife-lm, --jackknife-ngram, --jackknife-text, --test-lm, --test-ngram, "
            "--general-lm and --general-ngram (the ablation without adaptation)"
        )
    common.use_results(args.results)
    {"hyporadise": run_hyporadise, "atis": run_atis}[args.task](args)


if __name__ == "__main__":
    main()
