"""Rescoring where users need it: WMT22 k-best lists and ASR lists whose first pass had no LM, every figure held out.

    python -m benchmarks.rescore_sets wmt22 --lm var/bundles/english_lm --ngram var/ngrams/english_4gram.bin
    python -m benchmarks.rescore_sets hyporadise --lm ... --ngram ...
    python -m benchmarks.rescore_sets atis --lm ... --ngram ... --atis-ngram-dir var/atis

The protocol (``benchmarks.rescore_protocol``'s, generalised to MT and to sets without a dev list):

- **K-fold cross-validation inside a set** (``wmt22``, ``hyporadise``): folds of contiguous entries (MT: a document's
  segments stay together), the weights of fold j tuned on the other folds only; the pooled held-out choices give
  the set's figure, and every fold's gain is reported.
- **Transfer**: weights tuned on one set (or the union of several) applied unchanged to another (``wmt22``: zh-en
  to de-en without the system indicators, whose systems differ; ``hyporadise``: each set with the weights of the
  other three).
- **Dev/test** (``atis``): tuned on held-out lists of ``train_atis`` (``run_atis``), reported on ``test_atis``.

MT figures are BLEU (the tuned metric) and chrF with sacrebleu's signatures, against the first pass (the first
system in name order: the lists have no decoder order) and against the best single system (the highest corpus BLEU
on the whole set, as if chosen with the references; per fold that system's BLEU on the fold), each with a paired
bootstrap. One recipe per task, the same for every set of it, so that it can be judged on sets it was not made on.
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

from benchmarks.common import DATA_DIR as DATA
from benchmarks.common import ROOT, write_result
from benchmarks.rescore_protocol import kfold, leakage, system_names, transfer
from lmserve.rescoring.nbest import NBestList, read_nbest
from lmserve.rescoring.rescore import LanguageModels, Setup
from lmserve.rescoring.tune import parse_bounds

MAX_WORDS = 1000  # zh-en segment 926 holds 248-word translations
# Each task's recipe and its ablations (LM alone, consensus alone, both): features and the one fixed at weight 1
# (the scale), the same recipe for every set of a task, so that it can be judged on sets it was not made on. MT: the
# system indicators are added inside a pair (their systems differ between pairs); consensus_chrf is the base where it
# is used (chrF-MBR over the systems), else votes, how many systems gave the candidate. ASR lists without scores:
# the first pass's order (prior = -rank). ATIS: its first-pass score, am_score, in prior's place.
MT_RECIPES = {
    "lm": ("votes,neural,ngram,oov,length,chars,src_ratio", "votes"),
    "consensus": ("consensus_chrf,consensus_bleu,votes,length,chars,src_ratio", "consensus_chrf"),
    "both": ("consensus_chrf,consensus_bleu,votes,neural,ngram,oov,length,chars,src_ratio", "consensus_chrf"),
}
ASR_RECIPES = {
    "lm": ("prior,neural,ngram,oov,length", "prior"),
    "consensus": ("prior,consensus_wer,length", "prior"),
    "both": ("prior,consensus_wer,neural,ngram,oov,length", "prior"),
}
ASR_DEFINITIONS = ["prior=-1*rank"]
BOUNDS = "neural=0:,ngram=0:"  # an LM weight below 0 would reward what the LM finds unlikely
# penalty: of two weight vectors the dev folds cannot tell apart, the one nearer the base wins (rescoring.tune)
SEARCH = {"restarts": 6, "penalty": 0.01, "bounds": parse_bounds(BOUNDS)}


def load(path: Path, models: LanguageModels, cache: Path):
    nbest = read_nbest(path, max_words=MAX_WORDS)
    key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:8]
    return nbest, models.scores(nbest, cache / f"{path.name.split('.')[0]}-{key}.lmscores.jsonl", progress=True)


def load_models(args, lm: Path, ngram: Path) -> tuple[LanguageModels, Path]:
    models = LanguageModels.load(lm, ngram, "librispeech", args.threads)
    return models, (args.cache_dir or ROOT / "var" / "cache") / f"{Path(lm).name}__{Path(ngram).stem}"


def models_and_cache(args) -> tuple[LanguageModels, Path]:
    return load_models(args, args.lm, args.ngram)


def ablated(run, recipes: dict[str, tuple[str, str]]) -> tuple[dict, dict]:
    """``run(features, fixed)`` for every recipe: the figures and details of "both", with every recipe's figures
    under ``details["ablation"]``."""
    results = {name: run(features, fixed) for name, (features, fixed) in recipes.items()}
    figures, details = results["both"]
    details["ablation"] = {name: fig for name, (fig, _) in results.items()}
    return figures, details


def recipe_text(recipes: dict[str, tuple[str, str]]) -> str:
    features, fixed = recipes["both"]
    return f"features {features} ({fixed} fixed at 1; bounds {BOUNDS}, penalty {SEARCH['penalty']})"


def run_wmt22(args) -> None:
    models, cache = models_and_cache(args)
    lists = {pair: load(DATA / "wmt22-en" / pair, models, cache) for pair in ("zh-en", "de-en")}
    leaks = leakage({pair: nbest for pair, (nbest, _) in lists.items()}, args.lm_text, models.normalizer)
    for pair, (nbest, scores) in lists.items():
        indicators = "," + ",".join(f"sys_{s}" for s in system_names(nbest))
        figures, details = ablated(
            lambda f, fixed, nbest=nbest, scores=scores, ind=indicators: kfold(
                nbest, scores, Setup.parse(f + ind), "bleu", args.folds, fixed, SEARCH
            ),
            MT_RECIPES,
        )
        write_result(
            f"rescore_wmt22_{pair.replace('-', '_')}",
            figures,
            protocol=f"{args.folds}-fold cross-validation over contiguous segments of WMT22 {pair}; "
            f"{recipe_text(MT_RECIPES)} and the system indicators, BLEU tuned; each k-best list is the distinct "
            "outputs of the primary systems for the segment",
            details=details,
            leakage=leaks[pair],
        )
    (zh, zh_scores), (de, de_scores) = lists["zh-en"], lists["de-en"]
    figures, details = ablated(
        lambda f, fixed: transfer(zh, zh_scores, de, de_scores, Setup.parse(f), "bleu", fixed, SEARCH), MT_RECIPES
    )
    write_result(
        "rescore_wmt22_transfer",
        figures,
        protocol=f"weights tuned on all of WMT22 zh-en ({recipe_text(MT_RECIPES)}, no system indicators) applied "
        "unchanged to de-en",
        details=details,
        leakage=leaks["de-en"],
    )


HYPORADISE = {
    "chime4": DATA / "hyporadise" / "test_chime4.json.gz",
    "td3": DATA / "hyporadise" / "test_td3.json.gz",
    "swbd": DATA / "hyporadise" / "test_swbd.json.gz",
    "wsj": DATA / "wsj-nbest" / "dev.json",
}


def run_hyporadise(args) -> None:
    models, cache = models_and_cache(args)
    lists = {name: load(path, models, cache) for name, path in HYPORADISE.items()}
    leaks = leakage({name: nbest for name, (nbest, _) in lists.items()}, args.lm_text, models.normalizer)
    cv, cv_details, moved, moved_details = {}, {}, {}, {}
    for name, (nbest, scores) in lists.items():
        figures, cv_details[name] = ablated(
            lambda f, fixed, nbest=nbest, scores=scores: kfold(
                nbest, scores, Setup.parse(f, ASR_DEFINITIONS), "wer", args.folds, fixed, SEARCH
            ),
            ASR_RECIPES,
        )
        for key in ("wer_1best", "wer_rescored", "folds", "folds_improved"):
            cv[f"{name}_{key}"] = figures[key]
        others = [lists[o] for o in lists if o != name]
        tune_lists, tune_scores = [n for n, _ in others], [s for _, s in others]
        figures, moved_details[name] = ablated(
            lambda f, fixed, tl=tune_lists, ts=tune_scores, nbest=nbest, scores=scores: transfer(
                tl, ts, nbest, scores, Setup.parse(f, ASR_DEFINITIONS), "wer", fixed, SEARCH
            ),
            ASR_RECIPES,
        )
        moved.update({f"{name}_wer_1best": figures["wer_1best"], f"{name}_wer_rescored": figures["wer_rescored"]})
    write_result(
        "rescore_hyporadise_cv",
        cv,
        protocol=f"{args.folds}-fold cross-validation over contiguous utterances of each set; "
        f"{recipe_text(ASR_RECIPES)} with {ASR_DEFINITIONS[0]}, WER tuned",
        details=cv_details,
        leakage=leaks,
    )
    write_result(
        "rescore_hyporadise_transfer",
        moved,
        protocol=f"each set rescored with weights tuned on the union of the other three; {recipe_text(ASR_RECIPES)}",
        details=moved_details,
        leakage=leaks,
    )


ATIS_TUNE_FROM = 3171  # train_atis: the tuning LMs adapt on entries before it (80%), the weights tune on the rest
ATIS_RECIPES = {name: (f.replace("prior", "am_score"), "am_score") for name, (f, _) in ASR_RECIPES.items()}


def run_atis(args) -> None:
    """Weights tuned on the lists of train_atis[ATIS_TUNE_FROM:] with LMs adapted on the references before it
    (``--lm``, ``--ngram``: the tuning lists' references unseen, so that the LM weights are not tuned on text the LMs
    know), then applied to test_atis scored by LMs adapted on all of train_atis's references (``--test-lm``,
    ``--test-ngram``; by default the tuning LMs), as a user adapts on all the in-domain text there is. The general LMs
    (``--general-lm``, ``--general-ngram``) are the ablation without adaptation."""
    kinds = {
        "general": ((args.general_lm, args.general_ngram),) * 2,
        "adapted": ((args.lm, args.ngram), (args.test_lm or args.lm, args.test_ngram or args.ngram)),
    }
    details = {}
    for kind, ((lm, ngram), (test_lm, test_ngram)) in kinds.items():
        models, cache = load_models(args, lm, ngram)
        train, train_scores = load(DATA / "hyporadise" / "train_atis.json.gz", models, cache)
        dev = NBestList(train.entries[ATIS_TUNE_FROM:], f"{train.name}[{ATIS_TUNE_FROM}:]")
        test_models, test_cache = load_models(args, test_lm, test_ngram)
        test, test_scores = load(DATA / "hyporadise" / "test_atis.json.gz", test_models, test_cache)
        data = (dev, train_scores[ATIS_TUNE_FROM:], test, test_scores)
        fig, det = ablated(lambda f, fixed, d=data: transfer(*d, Setup.parse(f), "wer", fixed, SEARCH), ATIS_RECIPES)
        det.update({"models": models.paths, "test_models": test_models.paths})
        det["leakage"] = leakage({"train_atis_tune": dev, "test_atis": test}, args.lm_text, models.normalizer)
        details[kind] = det
    adapted = details["adapted"]
    figures = {k: adapted["ablation"]["both"][k] for k in ("wer_1best", "wer_rescored")}
    figures["p_value"] = adapted["report"]["p_value"]
    figures["wer_rescored_general_lms"] = details["general"]["ablation"]["both"]["wer_rescored"]
    write_result(
        "rescore_atis",
        figures,
        protocol=f"weights ({recipe_text(ATIS_RECIPES)}) tuned on the lists of train_atis[{ATIS_TUNE_FROM}:] with LMs "
        f"adapted on the references of train_atis[:{ATIS_TUNE_FROM}], applied unchanged to test_atis scored by LMs "
        "adapted on all of train_atis's references",
        details=details,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("task", choices=("wmt22", "hyporadise", "atis"))
    parser.add_argument("--lm", type=Path, required=True)
    parser.add_argument("--ngram", type=Path, required=True)
    parser.add_argument("--general-lm", type=Path, help="atis: the general LM bundle, for the ablation")
    parser.add_argument("--general-ngram", type=Path, help="atis: the general n-gram, for the ablation")
    parser.add_argument("--test-lm", type=Path, help="atis: the LM bundle adapted on all of train_atis")
    parser.add_argument("--test-ngram", type=Path, help="atis: the n-gram adapted on all of train_atis")
    parser.add_argument(
        "--lm-text", type=Path, nargs="+", required=True, help="every text behind the LMs, for the leakage guard"
    )
    parser.add_argument("--folds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--cache-dir", type=Path, help="where LM score caches go, in BUNDLE__NGRAM/ (default: var/cache)"
    )
    args = parser.parse_args()
    {"wmt22": run_wmt22, "hyporadise": run_hyporadise, "atis": run_atis}[args.task](args)


if __name__ == "__main__":
    main()
