"""The rescoring job: language models + hypothesis lists -> features -> tuned weights -> reranked lists and a report.

``lm-rescore tune`` and ``lm-rescore nbest`` are thin over this module, and so are the benchmarks; the gRPC service
uses the same ``LanguageModels`` and ``rerank``.

A *setup* is everything that turns a list into a choice besides the list itself: which LMs, how their input text is
normalised, which features with which definitions, the interpolation weight λ and the weights. ``tune`` produces one
(saved as a weights file), ``rerank`` applies one; a weights file therefore reproduces a rescoring run exactly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from lmserve.core.command import clip
from lmserve.core.fingerprints import fingerprints
from lmserve.core.textnorm import PRESETS, TextNormalizer
from lmserve.rescoring import metrics
from lmserve.rescoring.context import document_keys, fingerprint, first_pass_history, states_before
from lmserve.rescoring.features import feature_matrices, parse_definition
from lmserve.rescoring.lmscores import cache_key, compute, load_or_compute, models_key
from lmserve.rescoring.nbest import Hypothesis, NBestEntry, NBestList
from lmserve.rescoring.ngram import NgramLM
from lmserve.rescoring.ngram_mix import NgramMixture, load_ngram
from lmserve.rescoring.scorer import Scorer
from lmserve.rescoring.tune import TuneResult, TuningSet, tune_guarded, tune_weights

MAX_UNKNOWN_SHARE = 0.5  # ``LanguageModels.check_vocabulary``: more of a list set's words unknown is an error
VOCABULARY_SAMPLE = 2000  # hypotheses it reads (about 30 ms)
# ``check_vocabulary``, list by list: more than MAX_UNKNOWN_SHARE of a list's words (its first hypothesis, when it
# has at least LIST_WORDS of them) unknown makes the list one in another form; more than MAX_UNKNOWN_LISTS of the
# lists in another form is an error (a few short lists of names are not)
LIST_WORDS = 3
MAX_UNKNOWN_LISTS = 0.05
LIST_SAMPLE = 10_000  # lists it reads, spread over the set (about 0.2 s)
RESCORE_FEATURE = "rescore"  # the combined score, added to every hypothesis of a reranked list


@dataclass
class LanguageModels:
    """A neural LM bundle and/or an n-gram (one KenLM model or a mixture of them, ``rescoring.ngram_mix``), loaded
    once, and the text normaliser that turns hypotheses into their tokens."""

    scorer: Scorer | None
    ngram: NgramLM | NgramMixture | None
    normalizer: TextNormalizer
    paths: dict[str, str | None] = field(default_factory=dict)
    context: str | None = None  # where documents come from (``rescoring.context``); None: sentence by sentence

    @classmethod
    def load(
        cls,
        lm: str | Path | None,
        ngram: str | Path | None,
        normalize: str | None = None,
        threads: int = 0,
        open_vocab: bool = False,
        device: str = "cpu",
        precision: str = "fp32",
        context: str | None = None,
    ) -> LanguageModels:
        """``normalize``: a preset of ``core.textnorm.PRESETS``; by default the bundle's own text settings.
        ``open_vocab``: the bundle scores unknown words from their spelling; ``device`` and ``precision``: where and
        how it runs (``Scorer``); ``context``: the neural LM reads each document's earlier utterances first
        (``rescoring.context``; needs a bundle)."""
        if context is not None:
            if lm is None:
                raise ValueError("--context carries the neural LM's state across utterances: give a bundle (--lm)")
            document_keys(NBestList([]), context)  # an unknown kind fails here, before any model is loaded
        if normalize is not None and normalize not in PRESETS:
            raise ValueError(f"unknown text normalisation {normalize!r}; expected one of {sorted(PRESETS)}")
        scorer = None
        if lm is not None:
            scorer = Scorer(
                lm,
                threads=threads,
                device=device,
                normalizer=PRESETS[normalize] if normalize else None,
                open_vocab=open_vocab,
                precision=precision,
            )
            scorer.check_forward("give rescoring's LM features (--lm)")
        normalizer = scorer.normalizer if scorer is not None else PRESETS[normalize or "none"]
        return cls(
            scorer,
            load_ngram(ngram) if ngram is not None else None,
            normalizer,
            {
                "lm": None if lm is None else str(lm),
                "ngram": None if ngram is None else str(ngram),
                "normalize": normalize,
                **({"context": context} if context else {}),
            },
            context,
        )

    @property
    def available(self) -> bool:
        return self.scorer is not None or self.ngram is not None

    @property
    def normalisation(self) -> str | None:
        """The neural LM's measured normalisation (``core.bundle``), None without one."""
        return None if self.scorer is None else self.scorer.normalisation

    @property
    def fingerprint(self) -> dict[str, str | None]:
        """What their scores depend on (``lmscores.models_key``): part of a sharded run's identity."""
        return models_key(self.scorer, self.ngram, self.normalizer)

    def scores(
        self, nbest: NBestList, cache: Path | None = None, progress: bool = False, history: list[str] | None = None
    ):
        """Per-token scores of every hypothesis (``rescoring.lmscores``), None without models. The rescoring job
        asks nothing else of its LMs, which is what lets ``lm-rescore --server`` put a running lm-serve in their
        place (``rescoring.commands.remote.RemoteLanguageModels``: ``available``, ``scores`` and ``paths`` alike).
        With ``context``, ``history`` is what each utterance leaves to the later ones of its document (default: the
        first pass's 1-best)."""
        if not self.available:
            return None
        self.check_vocabulary(nbest)
        context = self.documents(nbest, history)
        return load_or_compute(
            cache,
            self.cache_key(nbest, context),
            nbest,
            lambda: compute(
                nbest,
                self.scorer,
                self.ngram,
                self.normalizer,
                progress=progress,
                start=None if context is None else lambda scorer: states_before(scorer, *context),
            ),
        )

    def documents(self, nbest: NBestList, history: list[str] | None = None) -> tuple[list[str], list[str]] | None:
        """Each entry's document and history (``rescoring.context``), None when scoring sentence by sentence."""
        if self.context is None:
            return None
        return document_keys(nbest, self.context), history or first_pass_history(nbest)

    def cache_key(self, nbest: NBestList, context: tuple[list[str], list[str]] | None = None) -> dict[str, str | None]:
        key = cache_key(nbest, self.scorer, self.ngram, self.normalizer)
        return key if context is None else key | {"context": f"{self.context} {fingerprint(*context)}"}

    def check_vocabulary(self, nbest: NBestList, max_share: float = MAX_UNKNOWN_SHARE) -> float:
        """The largest share of the lists' words (of at most ``VOCABULARY_SAMPLE`` hypotheses spread over them)
        unknown to one of the LMs as normalised here; a ValueError, before any scoring, above ``max_share``: text
        in another form than the LM's (upper case for a lower-case model) makes every word <unk>, and reranking on
        such scores is noise that no figure would show. dev_other's words: 4.9% unknown to a 50k vocabulary of
        English, 100% in the wrong case.

        Then list by list (the first hypothesis of each, of at most ``LIST_SAMPLE`` lists spread over the set): a set
        of which a third is in another form has less than half of its words unknown in all, yet those lists would be
        scored entirely as <unk>; more than ``MAX_UNKNOWN_LISTS`` of the lists mostly unknown is the same error,
        naming some of them."""
        texts = [h.text for entry in nbest for h in entry.hypotheses]
        memo: dict = {}
        sample = texts[:: max(1, len(texts) // VOCABULARY_SAMPLE)]
        words = [w for text in sample for w in self.normalizer.normalize(text, memo)]
        models = (
            [("neural LM", self.paths.get("lm"), lambda w: w not in self.scorer.known_words)] if self.scorer else []
        )
        if self.ngram is not None:
            models.append(("n-gram", self.paths.get("ngram"), lambda w: self.ngram.oov([w]) > 0))
        worst = 0.0
        for what, path, unknown in models:
            missing = [w for w in words if unknown(w)]
            worst = max(worst, len(missing) / max(1, len(words)))
            if words and len(missing) > max_share * len(words):
                form = f"--normalize {self.paths['normalize']}" if self.paths.get("normalize") else "its own text form"
                examples = ", ".join(clip(w, quote=False) for w in sorted(set(missing))[:3])
                raise ValueError(
                    f"{nbest.name}: {len(missing) / len(words):.0%} of the words of {len(sample)} hypotheses are "
                    f"unknown to the {what} {path} as read with {form} (e.g. {examples}): "
                    f"every one would be scored as <unk>. Give --normalize the form of the LM's training text (one "
                    f"of {', '.join(sorted(PRESETS))}), or an LM of the lists' language"
                )
        sampled = nbest.entries[:: max(1, len(nbest.entries) // LIST_SAMPLE)]
        firsts = [(entry.id, self.normalizer.normalize(entry.hypotheses[0].text, memo)) for entry in sampled]
        firsts = [(entry_id, words) for entry_id, words in firsts if len(words) >= LIST_WORDS]
        for what, path, unknown in models:
            other = [
                (entry_id, words) for entry_id, words in firsts if sum(map(unknown, words)) > max_share * len(words)
            ]
            if len(other) > MAX_UNKNOWN_LISTS * len(firsts):
                form = f"--normalize {self.paths['normalize']}" if self.paths.get("normalize") else "its own text form"
                lists = ", ".join(clip(entry_id) for entry_id, _ in other[:3])
                unknown_words = sorted({w for _, ws in other for w in ws if unknown(w)})[:3]
                examples = ", ".join(clip(w, quote=False) for w in unknown_words)
                raise ValueError(
                    f"{nbest.name}: {len(other)} of its {len(firsts)} lists of {LIST_WORDS} words or more (e.g. "
                    f"{lists}) have most of their first hypothesis's words unknown to the {what} {path} as read "
                    f"with {form} (e.g. {examples}): those lists would be scored entirely as <unk>. Are they in "
                    f"another form than the others (case, punctuation)? Give every list the form of the LM's "
                    f"training text (--normalize one of {', '.join(sorted(PRESETS))})"
                )
        return worst


@dataclass
class Setup:
    features: list[str]
    definitions: dict[str, dict[str, float]] = field(default_factory=dict)
    lam: float | None = None
    weights: dict[str, float] | None = None

    @classmethod
    def parse(cls, features: str | Sequence[str], definitions: Sequence[str] = (), lam: float | None = None) -> Setup:
        names = [f.strip() for f in features.split(",")] if isinstance(features, str) else list(features)
        if not names or not all(names):
            raise ValueError(f"--features: expected comma-separated feature names, got {features!r}")
        return cls(names, dict(parse_definition(d) for d in definitions), lam)

    @property
    def uses_interp(self) -> bool:
        return "interp" in self.features or any("interp" in d for d in self.definitions.values())

    def matrices(self, nbest: NBestList, lm_scores) -> list[np.ndarray]:
        return feature_matrices(nbest, self.features, lm_scores, self.definitions, self.lam)

    def combine(self, matrices: list[np.ndarray]) -> list[np.ndarray]:
        """Every hypothesis' combined score, from ``matrices``."""
        if self.weights is None:
            raise ValueError("this setup has no weights: tune it first")
        w = np.array([self.weights[f] for f in self.features])
        return [x @ w for x in matrices]

    def choose(self, nbest: NBestList, lm_scores) -> np.ndarray:
        """Per utterance the chosen hypothesis (ties to the lower rank)."""
        return metrics.choose(self.combine(self.matrices(nbest, lm_scores)))


def check_normalisation(normalisation: str | None, setup: Setup, allow_unnormalised: bool = False) -> None:
    """Per-word interpolation mixes the neural LM's probabilities with the n-gram's: scores whose held-out log Z is
    far from 0 (an "unnormalised" bundle) are not probabilities, and the mix would mean nothing. As a log-linear
    feature (``neural``) such scores are fine, so only ``interp`` is refused, unless the caller insists."""
    if setup.uses_interp and normalisation == "unnormalised" and not allow_unnormalised:
        raise ValueError(
            "feature 'interp' mixes probabilities word by word, but the neural LM's scores are unnormalised (its "
            "held-out log Z is far from 0; see its manifest): use 'neural' as a feature instead, or pass "
            "--allow-unnormalised"
        )


# -- evaluation ----------------------------------------------------------------------------------------------------


def references_of(nbest: NBestList, metric: str) -> list[str] | list[list[str]]:
    """WER: one reference per utterance. BLEU: sacrebleu's layout, one list per reference set."""
    missing = [e.id for e in nbest if not e.references]
    if missing:
        raise ValueError(
            f"{nbest.name}: {len(missing)} entries have no reference (first: {clip(missing[0])}); give --references"
        )
    if metric == "wer":
        many = [e.id for e in nbest if len(e.references) != 1]
        if many:
            raise ValueError(f"{nbest.name}: WER needs one reference per utterance; {clip(many[0])} has several")
        return [e.references[0] for e in nbest]
    count = len(nbest.entries[0].references)
    uneven = [e.id for e in nbest if len(e.references) != count]
    if uneven:
        raise ValueError(f"{nbest.name}: every sentence needs {count} references; {clip(uneven[0])} differs")
    return [[e.references[k] for e in nbest] for k in range(count)]


def tuning_set(nbest: NBestList, setup: Setup, lm_scores, metric: str) -> TuningSet:
    texts = [[h.text for h in e.hypotheses] for e in nbest]
    matrices = setup.matrices(nbest, lm_scores)
    refs = references_of(nbest, metric)
    if metric == "wer":
        return TuningSet.from_wer(nbest.name, setup.features, matrices, refs, texts)
    return TuningSet.from_bleu(nbest.name, setup.features, matrices, refs, texts)


@dataclass
class Tuned:
    setup: Setup
    result: TuneResult  # of the chosen λ
    by_lambda: dict[float | None, float]  # dev metric per λ tried
    cross_validation: dict | None = None
    data: TuningSet | None = field(default=None, repr=False)  # the dev set at the chosen λ (for plots around it)
    adopted: bool = True  # False: cross-validation did not improve enough folds, the weights are the starting ones


def tune(
    nbest: NBestList,
    setup: Setup,
    lm_scores,
    metric: str,
    fixed: str | None = None,
    lambdas: Sequence[float] = (0.5,),
    folds: int = 0,
    require_folds: int = 0,
    owners: Sequence | None = None,
    **tune_args,
) -> Tuned:
    """Tune weights on ``nbest`` (a dev set: never the test set), trying each λ when ``interp`` is used.

    With ``folds`` > 1 the reported held-out figure comes from k-fold cross-validation (weights tuned without the fold
    they choose for); the returned weights are then tuned on the whole set, for use on other data. With
    ``require_folds`` > 0 they are used only when the tuned weights beat the starting ones on at least that many
    held-out folds; otherwise the starting weights (the first pass alone) are returned, ``adopted`` False: gains that
    do not hold across parts of the dev list do not hold on other lists either (BENCHMARKS.md, "Tuning that
    transfers"), and rescoring that changes nothing is better than rescoring that makes a list worse. ``owners``
    (a label per entry: the list it came from, when ``nbest`` joins several) makes that guard per list
    (``tune.tune_guarded``).
    """
    best = None
    by_lambda = {}
    aligned = None  # the metric statistics (jiwer alignments, BLEU counts) do not depend on λ: computed once
    for lam in lambdas if setup.uses_interp else [None]:
        trial = Setup(setup.features, setup.definitions, lam)
        if aligned is None:
            data = aligned = tuning_set(nbest, trial, lm_scores, metric)
        else:
            data = replace(aligned, features=trial.matrices(nbest, lm_scores))
        result = tune_weights(data, fixed=fixed, **tune_args)
        by_lambda[lam] = result.dev_metric
        if best is None or result.objective < best[1].objective:  # (the penalty and length bound count too)
            best = (trial, result, data)
    trial, result, data = best
    cv = None
    adopted = True
    if folds > 1:
        guarded = tune_guarded(data, folds, require_folds, result=result, fixed=fixed, owners=owners, **tune_args)
        result, adopted = guarded.result, guarded.adopted
        cv = {**guarded.cross_validation.summary(), "required_folds": require_folds}
        if guarded.per_list is not None:
            cv["per_list"] = guarded.per_list
        cv["chosen"] = guarded.cross_validation.chosen.tolist()
    trial.weights = result.weights
    return Tuned(trial, result, by_lambda, cv, data, adopted)


REPORT_SYSTEMS = ("1best", "rescored", "oracle")


def report(nbest: NBestList, chosen: Sequence[int], metric: str, bootstrap_samples: int = 1000) -> dict:
    """1-best (the decoder's first), rescored and oracle side by side, and a paired bootstrap of rescored vs 1-best.
    Every figure is a function of per-utterance statistics (:func:`utterance_stats`), so the shards of a list,
    merged, give the report of the whole list (``rescoring.commands.shards``)."""
    references = len(nbest.entries[0].references) if len(nbest) else 0
    stats = utterance_stats(nbest, chosen, metric)
    return report_from_stats(nbest.name, metric, stats, references, bootstrap_samples)


def utterance_stats(nbest: NBestList, chosen: Sequence[int], metric: str) -> np.ndarray:
    """Per utterance an int64 row: its number of hypotheses, the chosen and the oracle hypothesis' index, then the
    metric's statistics of the 1-best, the chosen and the oracle hypothesis (WER: ``metrics.WER_COUNTS``; BLEU:
    sacrebleu's, ``metrics.bleu_stats``), in the order of ``REPORT_SYSTEMS``."""
    refs = references_of(nbest, metric)
    texts = [[h.text for h in e.hypotheses] for e in nbest]
    sizes = np.array([len(t) for t in texts], dtype=np.int64)
    chosen = np.asarray(chosen, dtype=np.int64)
    first = np.zeros(len(texts), dtype=np.int64)
    if metric == "wer":
        flat_refs = [ref for ref, hyps in zip(refs, texts, strict=True) for _ in hyps]
        counts = metrics.wer_counts(flat_refs, [h for hyps in texts for h in hyps])  # every hypothesis, once
        oracle = metrics.choose(metrics.unflatten(-metrics.errors_and_words(counts)[:, 0], texts))
        starts = np.cumsum(sizes) - sizes
        systems = [counts[starts + k] for k in (first, chosen, oracle)]
    else:
        oracle = metrics.oracle_bleu(refs, texts)
        systems = [metrics.bleu_stats(refs, metrics.pick(texts, k)) for k in (first, chosen, oracle)]
    return np.column_stack([sizes, chosen, oracle, *systems]).astype(np.int64)


def report_from_stats(
    name: str, metric: str, stats: np.ndarray, references: int = 1, bootstrap_samples: int = 1000
) -> dict:
    """:func:`report` from :func:`utterance_stats` rows (``references``: per sentence, for BLEU's signature):
    corpus figures from summed counts, never from averaged rates."""
    systems = dict(zip(REPORT_SYSTEMS, np.split(stats[:, 3:], 3, axis=1), strict=True))
    if metric == "wer":
        rows = {system: metrics.wer_report_from_counts(s.sum(0), len(stats)) for system, s in systems.items()}
        first, rescored = (metrics.errors_and_words(systems[k]) for k in ("1best", "rescored"))
    else:
        rows = {k: metrics.bleu_report_from_stats(s.sum(0), len(stats), references) for k, s in systems.items()}
        first, rescored = systems["1best"], systems["rescored"]
    signature = rows["1best"]["signature"]
    bootstrap = metrics.paired_bootstrap_stats(metric, first, rescored, bootstrap_samples, signature=signature)
    return {
        "list": name,
        "metric": metric,
        "utterances": len(stats),
        "hypotheses": int(stats[:, 0].sum()),
        "changed_choices": int(np.count_nonzero(stats[:, 1])),
        **rows,
        "bootstrap": bootstrap,
    }


def format_report(rep: dict) -> str:
    """The human-readable table printed by ``lm-rescore nbest``."""
    metric = rep["metric"]
    key = metric
    lines = [f"{rep['list']}: {rep['utterances']} utterances, {rep['hypotheses']} hypotheses", ""]
    if metric == "wer":
        lines.append(f"{'':10} {'WER %':>7} {'sub':>6} {'del':>6} {'ins':>6}")
        for name in ("1best", "rescored", "oracle"):
            r = rep[name]
            lines.append(f"{name:10} {r[key]:7.2f} {r['substitutions']:6d} {r['deletions']:6d} {r['insertions']:6d}")
    else:
        lines.append(f"{'':10} {'BLEU':>7}")
        for name in ("1best", "rescored", "oracle"):
            lines.append(f"{name:10} {rep[name][key]:7.2f}")
    b = rep["bootstrap"]
    lines += [
        "",
        f"rescored vs 1-best: {b['delta']:+.2f}, 95% interval [{b['delta_ci95'][0]:+.2f}, {b['delta_ci95'][1]:+.2f}], "
        f"p = {b['p_value']:.4f} (paired bootstrap, {b['samples']} samples); {rep['changed_choices']} choices changed",
        rep["1best"]["signature"],
    ]
    return "\n".join(lines)


def reranked(nbest: NBestList, setup: Setup, lm_scores) -> tuple[NBestList, np.ndarray]:
    """The lists with our features added and each list sorted by the combined score (stable: ties keep rank), and
    per utterance the index of the chosen hypothesis in the original list (for reports)."""
    matrices = setup.matrices(nbest, lm_scores)
    combined = setup.combine(matrices)
    entries = []
    for entry, x, scores in zip(nbest, matrices, combined, strict=True):
        rows, totals = x.tolist(), scores.tolist()  # Python floats at once, not one numpy scalar at a time
        hyps = []
        for k in np.argsort(-scores, kind="stable").tolist():
            h = entry.hypotheses[k]
            added = dict(zip(setup.features, rows[k], strict=True))
            hyps.append(Hypothesis(h.text, {**h.features, **added, RESCORE_FEATURE: totals[k]}, h.rank or k + 1))
        entries.append(NBestEntry(entry.id, hyps, list(entry.references), entry.source, entry.document))
    return NBestList(entries, nbest.name), metrics.choose(combined)


def setup_record(models: LanguageModels, setup: Setup) -> dict:
    """What a weights file stores besides the weights, so that ``lm-rescore nbest`` can rebuild the setup: the models
    by path and by content (``core.fingerprints``), definitions and λ."""
    return {
        **models.paths,
        "fingerprints": fingerprints(models.paths),
        "definitions": setup.definitions,
        "lambda": setup.lam,
    }


def setup_from_record(record: Mapping) -> Setup:
    rescoring = record.get("setup", {})
    return Setup(
        list(record["features"]),
        {k: dict(v) for k, v in rescoring.get("definitions", {}).items()},
        rescoring.get("lambda"),
        dict(record["weights"]),
    )
