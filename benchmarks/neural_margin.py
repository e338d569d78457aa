"""What the neural LM adds over a tuned n-gram, on held-out folds, with the shipped model: ``lm-rescore evaluate``
per set, the same recipe for every set, and the figures of its baselines beside it.

    make ngram-english_lm ngram-books_lm ngram-mt_lm
    python -m benchmarks.neural_margin                       # every set; --sets td3 chime4 ... for some
    python -m benchmarks.neural_margin --context             # the same with document context (rescoring.context)
    python -m benchmarks.neural_margin --transfer            # leave one HyPoradise set out -> transfer_loo.json
    python -m benchmarks.neural_margin --mt                  # WMT22 zh-en and de-en -> mt_lm_margin.json
    python -m benchmarks.neural_margin --backward models/english_lm_backward --sets td3 chime4 swbd wsj atis
    python -m benchmarks.neural_margin --backward models/english_lm_backward --context --sets td3 chime4 swbd wsj

Sets and protocols (``lm-rescore evaluate``; the LMs are ``models/english_lm`` and ``var/ngrams/english_lm_4gram.bin``,
for LibriSpeech its books-domain pair ``models/books_lm`` and ``var/ngrams/books_4gram.bin``):

- HyPoradise TED-LIUM 3 (``td3``), CHiME-4, Switchboard (``swbd``) and WSJ dev: 5-fold contiguous cross-validation
  inside each set; WSJ with the tuning guard nested (``--guard 5``: a fold keeps the first pass unless every inner
  fold gains). Recipe: the first pass's order (``prior = -rank``: these lists carry no scores), ``neural``,
  ``ngram``, ``oov_lm``, ``length`` and ``nonword``; LM weights bounded at 0 from below.
- LibriSpeech, first pass without its LM (``librispeech_amonly``): the 30-best lists' ``decoder`` and ``ctc`` scores
  only (ESPnet's ``lm`` left out), tuned on dev_clean, reported on dev_other. Recipe: ``decoder`` (fixed), ``ctc``,
  ``neural``, ``ngram``, ``oov_ngram``, ``length``. ``S_folds`` is 1 (a dev/test split, not folds).

``S_wer_no_lm`` and ``S_wer_ngram_only`` are the recipe without any LM feature and without what needs the bundle,
tuned the same way on the same folds; ``S_margin_pct`` is 100 × (n-gram-only − neural) / n-gram-only; ``S_folds_not_
worse`` counts the folds where the neural recipe's held-out WER is not above the n-gram-only recipe's. With
``S_p_vs_ngram_only`` is the paired bootstrap's share of samples in which the neural recipe is not better. With
``--context`` the neural LM reads each document's earlier utterances (their first-pass 1-best) first: documents are
the list's order (TED-LIUM 3 and WSJ are in talk and session order; CHiME-4 and Switchboard lists carry no document,
so their context is the list order too) or LibriSpeech's speaker-chapter ids; the result is ``neural_margin_context``,
and ``document_context.json`` sets its TED-LIUM 3 and LibriSpeech figures beside ``neural_margin.json``'s.

For LibriSpeech the benchmark also asks where the room is: in the dev_other utterances whose list holds a
hypothesis with fewer errors than the 1-best (``librispeech_amonly_oracle_better``; the first of the fewest), how
often each LM alone gives that hypothesis a higher log-probability than the 1-best (``..._neural_prefers_oracle``,
``..._ngram_prefers_oracle``) and how often a lower one (``..._prefers_1best``; the rest are ties). The 1-best was
chosen with ESPnet's fused Transformer LM, so an LM that cannot tell its remaining errors from the fix more often than
not cannot beat it. A diagnostic read from the LM score cache of the evaluation; nothing is tuned on it.

``--backward BUNDLE``: forward + backward LMs (issue 51, item 6), the HyPoradise sets only (ATIS with the backward
LM adapted on the same half of train_atis as the forward one). Each list is first annotated with the backward LM's
sentence scores (``lm-rescore annotate --feature neural_backward``), and the recipe gains that feature, bounded at 0
from below like the others; the n-gram-only and no-LM baselines leave it out with ``neural`` (``evaluate`` counts
``neural_*`` features as the neural LM's). The result is ``neural_margin_backward``, whose ``S_wer_neural`` is the
forward + backward recipe's, beside ``neural_margin.json``'s forward one. With ``--context`` too, the forward LM
reads each document's earlier utterances first and the backward LM scores sentence by sentence (it would need the
utterances after, which a decoder has not chosen yet): ``neural_margin_context_backward``.

``--transfer``: weights that travel. Each of the four HyPoradise sets rescored with the weights tuned on the other
three (``lm-rescore evaluate --transfer`` with the per-list guard nested, ``--guard 5``: the weights are kept only
when every tuning set gains on all 5 of its folds, else the first pass stays). ``S_p_worse`` is the paired
bootstrap's share of samples in which the transfer is not worse than the 1-best (``metrics.paired_bootstrap_stats``'
``p_worse``): below 0.05, the transfer is significantly worse.

``--mt``: the WMT22 k-best lists of every system's output (zh-en, de-en), 5-fold contiguous CV inside each pair: the
consensus recipe (chrF and BLEU agreement with the other systems, votes, lengths, system indicators) with the LMs
(``neural``, ``ngram`` and the n-gram's OOV count) against the same without them (``P_*_consensus``: the no-LM
baseline), BLEU (tuned) with chrF and the length ratio beside it, and the best single system's chrF and length ratio
(picked with the references: a bar, not a method). The LMs are the cased MT pair (``models/mt_lm``: sentencepiece
pieces of text as written, and ``var/ngrams/mt_lm_4gram.bin``, the 4-gram of the same text, ``make ngram-mt_lm``),
which read the translations as they are, case and punctuation included (``P_bleu_lm``, ``P_chrf_lm``); beside them,
the same recipe with the ASR pair (``models/english_lm`` and its 4-gram, ``oov_lm``), which reads them in LibriSpeech
form and sees neither case nor punctuation (``P_bleu_lm_normalised``, ``P_chrf_lm_normalised``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from benchmarks.common import DATA_DIR, RESULTS, ROOT, write_result
from lmserve.rescoring import lmscores
from lmserve.rescoring.metrics import oracle_wer
from lmserve.rescoring.nbest import read_nbest

LM = ROOT / "models" / "english_lm"
NGRAM = ROOT / "var" / "ngrams" / "english_lm_4gram.bin"
MT_LM = ROOT / "models" / "mt_lm"
MT_NGRAM = ROOT / "var" / "ngrams" / "mt_lm_4gram.bin"
BOOKS_LM = ROOT / "models" / "books_lm"
BOOKS_NGRAM = ROOT / "var" / "ngrams" / "books_4gram.bin"
HYPORADISE = {
    "td3": DATA_DIR / "hyporadise" / "test_td3.json.gz",
    "chime4": DATA_DIR / "hyporadise" / "test_chime4.json.gz",
    "swbd": DATA_DIR / "hyporadise" / "test_swbd.json.gz",
    "wsj": DATA_DIR / "wsj-nbest" / "dev.json",
}
HYPORADISE_RECIPE = [
    "--features", "prior,neural,ngram,oov_lm,length,nonword", "--define", "prior=-1*rank", "--fixed", "prior",
]  # fmt: skip
LIBRISPEECH_RECIPE = ["--features", "decoder,ctc,neural,ngram,oov_ngram,length", "--fixed", "decoder"]
SEARCH = ["--bounds", "neural=0:,ngram=0:", "--restarts", "6", "--penalty", "0.01"]
SETS = (*HYPORADISE, "librispeech_amonly", "atis")
BACKWARD = "neural_backward"  # the backward LM's feature (--backward)
ATIS_RECIPE = ["--features", "am_score,neural,ngram,oov_lm,length,nonword", "--fixed", "am_score"]


def run(command: list[str]) -> None:
    print("$", " ".join(command), file=sys.stderr, flush=True)
    subprocess.run(command, check=True, cwd=ROOT)


def adapted_atis(args: argparse.Namespace, work: Path) -> tuple[Path, Path, Path, Path | None]:
    """The ATIS-adapted bundle and n-gram mixture, from the first half of train_atis, the second half's lists, and
    with ``--backward`` the backward LM adapted the same way."""
    atis = work / "atis"
    atis.mkdir(exist_ok=True)
    lists = json.loads(gzip.decompress((DATA_DIR / "hyporadise" / "train_atis.json.gz").read_bytes()))
    half = len(lists) // 2
    for part, items in (("adapt", lists[:half]), ("tune", lists[half:])):
        (atis / f"{part}.json.gz").write_bytes(gzip.compress(json.dumps(items).encode()))
    bin_ = Path(sys.executable).parent
    run([str(bin_ / "lm-rescore"), "references", str(atis / "adapt.json.gz"), "--normalize", "librispeech",
         "--out", str(atis / "adapt.txt")])  # fmt: skip

    def adapt(lm: Path, name: str) -> tuple[Path, Path]:
        run_dir, bundle = atis / f"{name}run", atis / f"{name}bundle"
        shutil.rmtree(run_dir, ignore_errors=True)
        run([str(bin_ / "lm-train"), "fit", "configs/adapt_atis.toml", "--init-from", str(lm), "--out", str(run_dir),
             "--set", f'data.train="{atis / "adapt.txt"}"', "--set", f'data.test="{atis / "adapt.txt"}"',
             "--set", "train.epochs=6", "--set", "train.early_stop_patience=1", "--set", "train.threads=1"])  # fmt: skip
        run([str(bin_ / "lm-train"), "export", "--checkpoint", str(run_dir), "--out", str(bundle), "--weights", "fp16"])
        return run_dir, bundle

    run_dir, bundle = adapt(args.lm, "")
    backward = adapt(args.backward, "backward_")[1] if args.backward else None  # (it reads backwards: --init-from)
    carved = run_dir / "carved"
    run([str(bin_ / "lm-rescore"), "ngram", "build", "--order", "4", "--text", str(carved / "train.txt"),
         "--like", str(args.lm), "--discount-fallback", "--out", str(atis / "atis_4gram")])  # fmt: skip
    mixture = atis / "mix.json"
    run([str(bin_ / "lm-rescore"), "ngram", "mix", "--ngram", f"{args.ngram},{atis / 'atis_4gram.bin'}",
         "--heldout", str(carved / "valid.txt"), "--like", str(args.lm), "--out", str(mixture)])  # fmt: skip
    return bundle, mixture, atis / "tune.json.gz", backward


def annotated(name: str, listed: Path, backward: Path, args: argparse.Namespace, work: Path) -> Path:
    """``listed`` with the backward LM's scores (``--backward``), as ``lm-rescore annotate`` writes it."""
    out = work / "annotated" / f"{name}.jsonl"
    out.parent.mkdir(exist_ok=True)
    out.unlink(missing_ok=True)
    run([str(Path(sys.executable).parent / "lm-rescore"), "annotate", str(listed), "--lm", str(backward),
         "--feature", BACKWARD, "--normalize", "librispeech", "--threads", str(args.threads), "--out", str(out)])  # fmt: skip
    return out


def with_backward(arguments: list[str]) -> list[str]:
    """A recipe's or a search's arguments with the backward LM's feature after ``neural`` (in ``--features``, and
    bounded at 0 from below in ``--bounds``)."""
    out = list(arguments)
    for flag, old, new in (
        ("--features", "neural", f"neural,{BACKWARD}"),
        ("--bounds", "neural=0:", f"neural=0:,{BACKWARD}=0:"),
    ):
        if flag in out:
            at = out.index(flag) + 1
            out[at] = out[at].replace(old, new, 1)
    return out


def evaluate(name: str, args: argparse.Namespace, out: Path) -> dict:
    """One ``lm-rescore evaluate`` run (its JSON), its LM scores cached in ``var/neural_margin/cache``."""
    lm, ngram = (args.books_lm, args.books_ngram) if name == "librispeech_amonly" else (args.lm, args.ngram)
    if name == "atis":
        lm, ngram, tune_list, backward = adapted_atis(args, out.parent)
    search = with_backward(SEARCH) if args.backward else SEARCH
    common = ["--metric", "wer", "--lm", str(lm), "--ngram", str(ngram), "--normalize", "librispeech"]
    common += [*search, "--threads", str(args.threads), "--no-overlap-check", "--quiet", "--out", str(out)]
    common += ["--cache-dir", str(out.parent / "cache")]
    if name == "atis":
        test_list, recipe = DATA_DIR / "hyporadise" / "test_atis.json.gz", ATIS_RECIPE
        if backward is not None:
            test_list, recipe = annotated("atis", test_list, backward, args, out.parent), with_backward(recipe)
            tune_list = annotated("train_b", tune_list, backward, args, out.parent)
        command = [f"atis={test_list}", "--tune", f"train_b={tune_list}", *recipe]
    elif name == "librispeech_amonly":
        lists = DATA_DIR / "librispeech-nbest"
        context = ["--context", "id"] if args.context else []
        command = [f"dev_other={lists / 'dev_other.tar.gz'}", "--tune", f"dev_clean={lists / 'dev_clean.tar.gz'}"]
        command += [*LIBRISPEECH_RECIPE, *context]
    else:
        context = ["--context", "order"] if args.context else []
        guard = ["--guard", "5"] if name == "wsj" else []
        listed, recipe = HYPORADISE[name], HYPORADISE_RECIPE
        if args.backward:
            listed, recipe = annotated(name, listed, args.backward, args, out.parent), with_backward(recipe)
        command = [f"{name}={listed}", "--cv", "5", *recipe, *guard, *context]
    run([sys.executable, "-m", "lmserve.rescoring", "evaluate", *command, *common])
    return json.loads(out.read_text())


def figures(name: str, result: dict) -> dict:
    if name in ("librispeech_amonly", "atis"):
        listed = result["held_out"]["lists"]["dev_other" if name != "atis" else "atis"]
        systems = listed["systems"]
        folds = [{v: systems[v]["wer"] for v in ("recipe", "ngram_only")}]
    else:
        listed = result["cross_validation"]["lists"][name]
        systems, folds = listed["systems"], listed["per_fold"]
    neural, ngram_only = systems["recipe"]["wer"], systems["ngram_only"]["wer"]
    return {
        f"{name}_wer_1best": systems["1best"]["wer"],
        f"{name}_wer_no_lm": systems["no_lm"]["wer"],
        f"{name}_wer_ngram_only": ngram_only,
        f"{name}_wer_neural": neural,
        f"{name}_margin_pct": 100 * (ngram_only - neural) / ngram_only,
        f"{name}_folds": len(folds),
        f"{name}_folds_not_worse": sum(f["recipe"] <= f["ngram_only"] for f in folds),
        f"{name}_p_vs_ngram_only": listed["bootstrap"]["recipe_vs_ngram_only"]["p_value"],
    }


def transfer(args: argparse.Namespace, work: Path) -> dict:
    """``transfer_loo.json``'s figures: each HyPoradise set with the weights of the other three."""
    out = work / "transfer.json"
    lists = [f"{name}={path}" for name, path in HYPORADISE.items()]
    run([sys.executable, "-m", "lmserve.rescoring", "evaluate", *lists, "--transfer", "--guard", "5",
         *HYPORADISE_RECIPE, "--metric", "wer", "--lm", str(args.lm), "--ngram", str(args.ngram),
         "--normalize", "librispeech", *SEARCH, "--threads", str(args.threads), "--no-overlap-check", "--quiet",
         "--out", str(out), "--cache-dir", str(work / "cache")])  # fmt: skip
    result = json.loads(out.read_text())["transfer"]["lists"]
    metrics = {}
    for name, listed in result.items():
        metrics[f"{name}_wer_1best"] = listed["systems"]["1best"]["wer"]
        metrics[f"{name}_wer_transfer"] = listed["systems"]["recipe"]["wer"]
        metrics[f"{name}_p_worse"] = listed["bootstrap"]["recipe_vs_1best"]["p_worse"]
    return metrics


MT_FEATURES = "consensus_chrf,consensus_bleu,votes,neural,ngram,{oov},length,chars,src_ratio,sys_*"


def mt(args: argparse.Namespace, work: Path) -> dict:
    """``mt_lm_margin.json``'s figures: per WMT22 pair, the LM recipe (the cased MT pair) against consensus alone and
    the best system, and the same recipe with the ASR pair (``_normalised``)."""
    metrics = {}
    # suffix -> the LM score cache (a list's cache file holds one pair's scores), the LMs and how they read the text
    pairs = {
        "": ("cache_mt_lm", ["--lm", str(args.mt_lm), "--ngram", str(args.mt_ngram),
                             "--features", MT_FEATURES.format(oov="oov_ngram")]),
        "_normalised": ("cache", ["--lm", str(args.lm), "--ngram", str(args.ngram), "--normalize", "librispeech",
                                  "--features", MT_FEATURES.format(oov="oov_lm")]),
    }  # fmt: skip
    for pair in ("zh-en", "de-en"):
        key = pair.replace("-", "_")
        for suffix, (cache, lms) in pairs.items():
            out = work / f"mt_{pair}{suffix}.json"
            run([sys.executable, "-m", "lmserve.rescoring", "evaluate", f"{key}={DATA_DIR / 'wmt22-en' / pair}",
                 "--cv", "5", "--metric", "bleu", *lms, "--fixed", "consensus_chrf", "--max-words", "1000", *SEARCH,
                 "--threads", str(args.threads), "--no-overlap-check", "--quiet", "--out", str(out),
                 "--cache-dir", str(work / cache)])  # fmt: skip
            systems = json.loads(out.read_text())["cross_validation"]["lists"][key]["systems"]
            metrics[f"{key}_bleu_lm{suffix}"] = systems["recipe"]["bleu"]
            metrics[f"{key}_chrf_lm{suffix}"] = systems["recipe"]["chrf"]
            metrics[f"{key}_length_ratio{suffix}"] = systems["recipe"]["length_ratio"]
        metrics[f"{key}_bleu_consensus"] = systems["no_lm"]["bleu"]
        metrics[f"{key}_chrf_consensus"] = systems["no_lm"]["chrf"]
        metrics[f"{key}_chrf_best_system"] = systems["best_system"]["chrf"]
        metrics[f"{key}_length_ratio_best_system"] = systems["best_system"]["length_ratio"]
        metrics[f"{key}_bleu_best_system"] = systems["best_system"]["bleu"]
    return metrics


def lm_preferences(name: str, listed: Path, cache: Path) -> dict:
    """Where an LM could help: ``name``'s utterances whose list holds a better hypothesis than the 1-best, and which
    of the two each LM alone scores higher (module docstring)."""
    nbest = read_nbest(listed)
    with cache.open(encoding="utf-8") as f:
        key = json.loads(f.readline())["key"]  # the evaluation just wrote it for these lists and models
    rows = lmscores.read_cache(cache, key)
    counts = dict.fromkeys(("oracle_better", "neural_prefers_oracle", "neural_prefers_1best"), 0)
    counts |= dict.fromkeys(("ngram_prefers_oracle", "ngram_prefers_1best"), 0)
    texts = [[h.text for h in entry.hypotheses] for entry in nbest]
    oracles = oracle_wer([entry.references[0] for entry in nbest], texts)  # ties to the lower rank: > 0 is better
    for best, hyps in zip(oracles, rows, strict=True):
        if best == 0:
            continue
        counts["oracle_better"] += 1
        neural = np.array([h.neural.sum() for h in (hyps[0], hyps[best])])
        ngram = lmscores.ngram_feature(np.array([h.ngram.sum() for h in (hyps[0], hyps[best])]), [hyps[0], hyps[best]])
        for lm, (first, oracle) in (("neural", neural), ("ngram", ngram)):
            counts[f"{lm}_prefers_oracle"] += int(oracle > first)
            counts[f"{lm}_prefers_1best"] += int(first > oracle)
    return {f"{name}_{k}": v for k, v in counts.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sets", nargs="+", choices=SETS, default=list(SETS))
    parser.add_argument("--lm", type=Path, default=LM)
    parser.add_argument("--ngram", type=Path, default=NGRAM)
    parser.add_argument("--books-lm", type=Path, default=BOOKS_LM, help="LibriSpeech's neural LM")
    parser.add_argument("--books-ngram", type=Path, default=BOOKS_NGRAM, help="LibriSpeech's n-gram")
    parser.add_argument("--context", action="store_true", help="document context (rescoring.context)")
    parser.add_argument("--transfer", action="store_true", help="leave one HyPoradise set out (transfer_loo.json)")
    parser.add_argument("--mt", action="store_true", help="WMT22 zh-en and de-en (mt_lm_margin.json)")
    parser.add_argument("--mt-lm", type=Path, default=MT_LM, help="the cased MT LM (--mt)")
    parser.add_argument("--mt-ngram", type=Path, default=MT_NGRAM, help="its n-gram (--mt)")
    parser.add_argument("--backward", type=Path, help="a backward LM bundle: forward + backward (HyPoradise sets)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    backward_sets = {*HYPORADISE, "atis"}
    if args.backward and (args.mt or args.transfer or not set(args.sets) <= backward_sets):
        parser.error(f"--backward: the HyPoradise sets only ({' '.join(sorted(backward_sets))})")
    if args.mt:
        work = ROOT / "var" / "neural_margin"
        work.mkdir(parents=True, exist_ok=True)
        models = {
            "mt_lm": str(args.mt_lm),
            "mt_ngram": str(args.mt_ngram),
            "lm": str(args.lm),
            "ngram": str(args.ngram),
        }
        write_result("mt_lm_margin", mt(args, work), **models)
        return
    if args.transfer:
        work = ROOT / "var" / "neural_margin"
        work.mkdir(parents=True, exist_ok=True)
        write_result("transfer_loo", transfer(args, work), lm=str(args.lm), ngram=str(args.ngram))
        return
    name = "neural_margin" + ("_context" if args.context else "") + ("_backward" if args.backward else "")
    work = ROOT / "var" / name
    work.mkdir(parents=True, exist_ok=True)
    metrics: dict = {}
    for s in args.sets:
        metrics |= figures(s, evaluate(s, args, work / f"{s}.json"))
        if s == "librispeech_amonly":
            listed = DATA_DIR / "librispeech-nbest" / "dev_other.tar.gz"
            metrics |= lm_preferences(s, listed, work / "cache" / "dev_other.lmscores.jsonl")
    models = {"lm": str(args.lm), "ngram": str(args.ngram), "books_lm": str(args.books_lm)}
    if args.backward:
        models["backward"] = str(args.backward)
    write_result(name, metrics, **models, books_ngram=str(args.books_ngram), context=args.context)
    if args.context and not args.backward:  # the same sets sentence by sentence: neural_margin.json, at this commit
        sentence = json.loads((RESULTS / "neural_margin.json").read_text())
        compared = {
            f"{s}_wer_{mode}": source.get(f"{s}_wer_neural")
            for s in ("td3", "librispeech_amonly")
            for mode, source in (("sentence", sentence["metrics"]), ("context", metrics))
        }
        write_result("document_context", compared, sentence_commit=sentence["commit"])


if __name__ == "__main__":
    main()
