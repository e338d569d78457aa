"""Log-linear weight tuning for n-best/k-best rescoring.

Each hypothesis h has features x_h (acoustic or translation score, LM scores, length, ...); an utterance's choice is
argmax_h sum_f w_f x_hf, and the weights are tuned on a dev set to minimise corpus WER or maximise corpus BLEU of those
choices, then applied to the test set unchanged (never tuned on it; ``cross_validate`` estimates held-out quality when
the dev set is all there is).

Why it is done this way:

- The per-hypothesis metric statistics (``rescoring.metrics``: word errors and reference length, or BLEU's n-gram
  counts) are computed once; an evaluation of the objective is then a padded [utterances, hypotheses, features]
  product, an argmax and a sum, about a millisecond for a few thousand 30-best lists.
- The objective is piecewise constant in w: the choice only changes when w crosses a hyperplane where two hypotheses
  tie, so there are no gradients and large flat plateaus. Derivative-free methods that take finite steps (Powell's
  line searches, Nelder-Mead's simplex) can still walk across plateaus, but they stop at the first step that finds
  nothing better, so every method is run from several random starting points (and random directions or simplex
  shapes) and the best dev result wins. The spread of the runs' results says how rugged the surface is.
- The scale of w is free (argmax ignores it), so one weight, ``fixed`` (by default the first feature, the
  decoder's own score), stays 1 and only the others are searched. A *cost* (a name ending in ``_cost``: Kaldi's
  ``ac_cost`` and ``lm_cost``, negated log-likelihoods, lower is better) stays -1 instead, and every cost starts the
  search at -1: at +1 the starting point (the baseline that tuned weights must beat, and what the guard falls back
  to) would choose each list's worst hypothesis.
- Features differ wildly in size (an LM log-probability of -75 next to a length of 20), so the search runs on
  rescaled weights: a searched value of 1 gives feature f the same spread within a list as the fixed feature has.
  Steps and random starts are in those units.
- Ties go to the lower rank, as everywhere in ``rescoring.metrics``; the best point found is kept only when it is
  strictly better, so a search that finds nothing returns its starting weights.
- A flat surface lets many weight vectors tie on the dev set, and the best of them there is often not the best
  elsewhere (on LibriSpeech, six correlated features tuned on dev_clean made dev_other worse). Two guards keep the
  search near sensible weights: ``bounds`` (per feature, in weight units, e.g. an LM weight of at least 0) and a
  ``penalty`` α·Σu² on the rescaled weights u, added to the metric, so that of two points the dev set cannot tell
  apart the one closer to the first pass wins. Every run's weights are kept, and ``weight_spread`` says how far
  apart they are: weights that move a lot between restarts or folds are not determined by the data.
- BLEU can be bought with brevity: above a length ratio of 1 its brevity penalty is 1, so weights that shorten every
  translation a little (1.04 -> 1.01) can raise BLEU while chrF and adequacy fall. ``length_ratio`` (LOW, HIGH)
  bounds the chosen translations' length over the references' on the dev set: a choice outside it costs the search's
  objective more than BLEU can give (``LENGTH_COST``: 100 points, and 1 more per 1% outside, so that the search is
  drawn towards the bound), so the best point inside wins whenever the search finds one.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from lmserve.core.atomic import atomic_write_text
from lmserve.rescoring import metrics

METHODS = ("powell", "nelder-mead")
LENGTH_COST = 100.0  # BLEU points: a choice outside ``length_ratio`` costs this, plus this per unit of ratio outside
LENGTH_RATIO_HELP = (
    "BLEU tuning: keep the chosen translations' length over the references' on the tuning lists within LOW:HIGH "
    "(either side may be empty), e.g. 0.99:1.03, so that BLEU is not bought with brevity"
)
WEIGHTS_FORMAT = "lmserve-weights"
WEIGHTS_VERSION = 2  # 2: the model paths of "setup" are relative to the weights file (1: to wherever tune ran)
MODEL_PATHS = ("lm", "ngram")  # the fields of "setup" that name files


@dataclass(eq=False)
class TuningSet:
    """Dev-set n-best lists reduced to what tuning needs: per utterance a feature matrix [n_hyps, n_features] and the
    metric's sufficient statistics [n_hyps, n_stats] (``rescoring.metrics``). ``ids`` are the utterances' positions
    in the original set, kept through ``subset`` so a fold can be traced back."""

    name: str
    feature_names: tuple[str, ...]
    metric: str
    features: list[np.ndarray] = field(repr=False)
    stats: list[np.ndarray] = field(repr=False)
    bleu_args: dict = field(default_factory=dict)
    signature: str = ""
    ids: np.ndarray | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.metric not in metrics.METRICS:
            raise ValueError(f"{self.name}: metric must be one of {metrics.METRICS}, got {self.metric!r}")
        self.feature_names = tuple(self.feature_names)
        if len(set(self.feature_names)) != len(self.feature_names) or not self.feature_names:
            raise ValueError(f"{self.name}: feature names must be distinct and non-empty, got {self.feature_names}")
        if len(self.features) != len(self.stats) or not self.features:
            raise ValueError(f"{self.name}: {len(self.features)} feature matrices, {len(self.stats)} statistics")
        self.features = [np.asarray(x, dtype=np.float64) for x in self.features]
        self.stats = [np.asarray(s, dtype=np.int64) for s in self.stats]
        for i, (x, s) in enumerate(zip(self.features, self.stats, strict=True)):
            if x.ndim != 2 or x.shape[1] != len(self.feature_names) or len(x) == 0:
                raise ValueError(
                    f"{self.name}: utterance {i}: features {x.shape}, expected [n_hyps >= 1, {len(self.feature_names)}]"
                )
            if not np.isfinite(x).all():
                raise ValueError(f"{self.name}: utterance {i}: features must be finite")
            if s.ndim != 2 or len(s) != len(x) or s.shape[1] != self.stats[0].shape[1]:
                raise ValueError(f"{self.name}: utterance {i}: statistics {s.shape} do not fit features {x.shape}")
        self.ids = np.arange(len(self.features)) if self.ids is None else np.asarray(self.ids)
        # Padded copies for vectorised choices: padding rows can never win the argmax.
        n_hyps = max(len(x) for x in self.features)
        self._x = np.zeros((len(self), n_hyps, len(self.feature_names)))
        self._s = np.zeros((len(self), n_hyps, self.stats[0].shape[1]), dtype=np.int64)
        self._pad = np.ones((len(self), n_hyps), dtype=bool)
        for i, (x, s) in enumerate(zip(self.features, self.stats, strict=True)):
            self._x[i, : len(x)], self._s[i, : len(s)], self._pad[i, : len(x)] = x, s, False
        self._score = metrics.corpus_scorer(self.metric, **self.bleu_args)

    def __len__(self) -> int:
        return len(self.features)

    @classmethod
    def from_wer(
        cls,
        name: str,
        feature_names: Sequence[str],
        features: Sequence[np.ndarray],
        references: Sequence[str],
        nbest: Sequence[Sequence[str]],
    ) -> TuningSet:
        """Word errors of every hypothesis against its utterance's reference, aligned once with jiwer."""
        _check_nbest(name, features, nbest)
        flat_refs = [ref for ref, hyps in zip(references, nbest, strict=True) for _ in hyps]
        stats = metrics.wer_stats(flat_refs, [h for hyps in nbest for h in hyps])
        return cls(
            name,
            tuple(feature_names),
            "wer",
            list(features),
            metrics.unflatten(stats, nbest),
            signature=metrics.WER_SIGNATURE,
        )

    @classmethod
    def from_bleu(
        cls,
        name: str,
        feature_names: Sequence[str],
        features: Sequence[np.ndarray],
        references: Sequence[Sequence[str]],
        nbest: Sequence[Sequence[str]],
        **bleu_args,
    ) -> TuningSet:
        """BLEU statistics of every hypothesis; ``references`` in sacrebleu's layout (one list per reference set)."""
        _check_nbest(name, features, nbest)
        flat_refs = [[refs[i] for i, hyps in enumerate(nbest) for _ in hyps] for refs in references]
        stats = metrics.bleu_stats(flat_refs, [h for hyps in nbest for h in hyps], **bleu_args)
        signature = metrics.bleu_report(references, [hyps[0] for hyps in nbest], **bleu_args)["signature"]
        stats = metrics.unflatten(stats, nbest)
        return cls(name, tuple(feature_names), "bleu", list(features), stats, bleu_args=bleu_args, signature=signature)

    def subset(self, indices: Sequence[int], name: str | None = None) -> TuningSet:
        indices = np.asarray(indices, dtype=np.int64)
        return replace(
            self,
            name=name or self.name,
            features=[self.features[i] for i in indices],
            stats=[self.stats[i] for i in indices],
            ids=self.ids[indices],
        )

    def choose(self, weights: np.ndarray) -> np.ndarray:
        """Per utterance the index of the best hypothesis under ``weights`` (in ``feature_names`` order)."""
        scores = self._x @ np.asarray(weights, dtype=np.float64)
        scores[self._pad] = -np.inf
        return scores.argmax(axis=1)  # the first maximum: ties go to the lower rank

    def score(self, chosen: np.ndarray) -> float:
        """Corpus metric of one chosen hypothesis per utterance."""
        return self._score(self._s[np.arange(len(self)), chosen].sum(axis=0))

    def evaluate(self, weights: np.ndarray) -> float:
        return self.score(self.choose(weights))

    def length_ratio(self, chosen: np.ndarray) -> float:
        """The chosen translations' length over the references' (BLEU's: its statistics hold both lengths)."""
        if self.metric != "bleu":
            raise ValueError(f"{self.name}: a length ratio is read from BLEU statistics, not {self.metric}'s")
        totals = self._s[np.arange(len(self)), chosen].sum(axis=0)
        return float(totals[0] / max(1, totals[1]))

    def within_list_spread(self) -> np.ndarray:
        """Per feature the standard deviation around each list's mean: how much it can move a choice."""
        centred = np.where(self._pad[..., None], 0.0, self._x - _list_means(self._x, self._pad))
        return np.sqrt((centred**2).sum(axis=(0, 1)) / (~self._pad).sum())


@dataclass
class TuneResult:
    weights: dict[str, float]
    metric: str
    dev_metric: float
    baseline_metric: float  # of the starting weights (by default: the fixed feature alone)
    runs: list[tuple[str, int, float]]  # (method, restart, best dev metric of that run)
    spread: dict[str, float]  # min, mean, max, std of the runs' results
    fixed: str
    dev_set: str
    signature: str
    settings: dict  # methods, restarts, seed, maxfev, bounds, penalty: what reproduces the search
    run_weights: list[dict[str, float]] = field(default_factory=list)  # each run's best point, in ``runs`` order
    # what the search minimised at ``weights``: the metric (negated where higher is better) plus the penalty and the
    # length bound's cost; the measure to compare searches of the same list by (e.g. one per λ)
    objective: float = math.nan

    @property
    def weight_spread(self) -> dict[str, dict[str, float]]:
        """Per weight its spread over the runs (restarts of every method): see ``weight_spread``."""
        return weight_spread(self.run_weights)


def tune_weights(
    dev: TuningSet,
    fixed: str | None = None,
    init: Mapping[str, float] | None = None,
    methods: Sequence[str] = METHODS,
    restarts: int = 5,
    seed: int = 0,
    maxfev: int = 1000,
    bounds: Mapping[str, tuple[float | None, float | None]] | None = None,
    penalty: float = 0.0,
    length_ratio: tuple[float | None, float | None] | None = None,
) -> TuneResult:
    """Search the weights that give the best corpus metric on ``dev`` (module docstring for how and why).

    Restart 0 of each method starts from ``init`` (default: ``start_weights``, i.e. the baseline choice);
    restarts 1.. start from random rescaled weights drawn from N(0, 1), clipped into ``bounds``, with random search
    directions. ``bounds``: per feature (low, high) in weight units, None for no limit; ``penalty``: α of the
    α·Σu² term (rescaled weights u) added to the metric (in its units, e.g. WER %) that the search minimises;
    ``length_ratio``: (low, high) for BLEU, the chosen translations' length ratio the search keeps to (module
    docstring). The reported metrics are the metric alone.
    """
    names = dev.feature_names
    fixed = names[0] if fixed is None else fixed
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise ValueError(f"methods must be some of {METHODS}, got {list(methods)}")
    start = start_weights(names, fixed, init)
    k = names.index(fixed)
    free = [i for i in range(len(names)) if i != k]
    spread = dev.within_list_spread()
    spread[spread == 0] = 1.0  # a feature constant within every list cannot change a choice; any unit will do
    unit = spread[k] / spread[free]  # weight of one rescaled unit, per free feature

    def weights_of(u: np.ndarray) -> np.ndarray:
        w = np.zeros(len(names))
        w[k], w[free] = start[fixed], u * unit
        return w

    if penalty < 0 or not math.isfinite(penalty):
        raise ValueError(f"penalty must be a finite number >= 0, got {penalty}")
    low, high = _rescaled_bounds(names, fixed, bounds, unit)
    free_low, free_high = low[free], high[free]
    sign = -1.0 if metrics.HIGHER_IS_BETTER[dev.metric] else 1.0
    if length_ratio is not None and dev.metric != "bleu":
        raise ValueError(f"length_ratio bounds BLEU tuning, not {dev.metric}")
    ratio_low, ratio_high = (-math.inf, math.inf) if length_ratio is None else _limits(length_ratio)

    def objective(u: np.ndarray) -> float:
        u = np.clip(u, free_low, free_high)  # (Powell and Nelder-Mead honour bounds; a start is clipped too)
        chosen = dev.choose(weights_of(u))
        value = sign * dev.score(chosen) + penalty * float(u @ u)
        if length_ratio is not None:
            ratio = dev.length_ratio(chosen)
            outside = max(0.0, ratio_low - ratio, ratio - ratio_high)
            if outside > 0:
                value += LENGTH_COST * (1.0 + outside)
        return value

    u0 = np.clip(np.array([start[names[i]] for i in free]) / unit, free_low, free_high)
    baseline = dev.evaluate(weights_of(u0))
    best_u, best_objective = u0, objective(u0)
    runs, run_weights = [], []
    rng = np.random.default_rng(seed)
    search_bounds = list(zip(free_low, free_high, strict=True)) if bounds else None
    for method in methods:
        for restart in range(restarts + 1):
            x0 = u0 if restart == 0 else np.clip(rng.standard_normal(len(free)), free_low, free_high)
            u, value = _search(objective, x0, method, rng, maxfev, search_bounds)
            u = np.clip(u, free_low, free_high)
            runs.append((method, restart, dev.evaluate(weights_of(u))))
            run_weights.append(dict(zip(names, (float(w) for w in weights_of(u)), strict=True)))
            if value < best_objective:
                best_u, best_objective = u, value
    values = np.array([v for _, _, v in runs])
    return TuneResult(
        weights=dict(zip(names, (float(w) for w in weights_of(best_u)), strict=True)),
        metric=dev.metric,
        dev_metric=dev.evaluate(weights_of(best_u)),
        baseline_metric=baseline,
        runs=runs,
        spread={
            "min": float(values.min()),
            "mean": float(values.mean()),
            "max": float(values.max()),
            "std": float(values.std()),
        },
        fixed=fixed,
        dev_set=dev.name,
        signature=dev.signature,
        settings={
            "methods": list(methods),
            "restarts": restarts,
            "seed": seed,
            "maxfev": maxfev,
            "bounds": {f: list(b) for f, b in (bounds or {}).items()},
            "penalty": penalty,
            "length_ratio": None if length_ratio is None else list(length_ratio),
        },
        run_weights=run_weights,
        objective=float(best_objective),
    )


def weight_spread(weights: Sequence[Mapping[str, float]]) -> dict[str, dict[str, float]]:
    """Per feature the mean, standard deviation, min and max of its weight over ``weights`` (runs or folds), and
    ``sign_agreement``: the share of them whose weight has the sign of the mean (1.0: all agree)."""
    if not weights:
        return {}
    out = {}
    for name in weights[0]:
        w = np.array([x[name] for x in weights], dtype=np.float64)
        mean = float(w.mean())
        out[name] = {
            "mean": mean,
            "std": float(w.std()),
            "min": float(w.min()),
            "max": float(w.max()),
            "sign_agreement": float(np.mean(np.sign(w) == np.sign(mean))),
        }
    return out


def parse_bounds(text: str) -> dict[str, tuple[float | None, float | None]]:
    """``"interp=0:,length=-2:2"`` -> ``{"interp": (0.0, None), "length": (-2.0, 2.0)}`` (empty side: no limit)."""
    bounds: dict[str, tuple[float | None, float | None]] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, limits = item.partition("=")
        pair = parse_range(limits) if sep and name.strip() else None
        if pair is None:
            raise ValueError(f"bounds {item!r}: expected NAME=LOW:HIGH (either side may be empty), e.g. interp=0:")
        if pair[0] is not None and pair[1] is not None and pair[0] > pair[1]:
            raise ValueError(f"bounds {item!r}: the low limit is above the high one")
        bounds[name.strip()] = pair
    return bounds


def parse_range(text: str) -> tuple[float | None, float | None] | None:
    """``"LOW:HIGH"`` (either side may be empty: no limit) -> (low, high); None when it is not that."""
    low, colon, high = text.partition(":")
    try:
        pair = tuple(None if not x.strip() else float(x) for x in (low, high))
    except ValueError:
        return None
    if not colon or any(x is not None and not math.isfinite(x) for x in pair):
        return None
    return pair


def parse_length_ratio(text: str | None, metric: str) -> tuple[float | None, float | None] | None:
    """``--length-ratio LOW:HIGH`` (e.g. ``0.99:1.03``, either side may be empty) -> (low, high), or None; refused
    for a metric other than BLEU, whose statistics alone hold the lengths."""
    if text is None:
        return None
    pair = parse_range(text)
    if pair is None or pair == (None, None) or any(x is not None and x <= 0 for x in pair):
        raise ValueError(f"--length-ratio {text!r}: expected LOW:HIGH, positive ratios, e.g. 0.99:1.03")
    if pair[0] is not None and pair[1] is not None and pair[0] > pair[1]:
        raise ValueError(f"--length-ratio {text!r}: the low limit is above the high one")
    if metric != "bleu":
        raise ValueError(f"--length-ratio bounds BLEU tuning (MT lists), not --metric {metric}")
    return pair


def _limits(pair: tuple[float | None, float | None]) -> tuple[float, float]:
    return (-math.inf if pair[0] is None else pair[0], math.inf if pair[1] is None else pair[1])


def check_bounds(
    bounds: dict[str, tuple[float | None, float | None]], names: Sequence[str], fixed: str
) -> dict[str, tuple[float | None, float | None]]:
    """``bounds`` when each names a tuned feature (one of ``names`` other than ``fixed``); else a ValueError."""
    for name in bounds:
        if name not in names or name == fixed:
            raise ValueError(
                f"bounds name {name!r}: expected one of the tuned features {[n for n in names if n != fixed]}"
            )
    return bounds


def format_stability(result: TuneResult, cross_validation: Mapping | None = None) -> str:
    """The weights' spread over the search's runs (and over cross-validation folds), one line per weight, for
    ``lm-rescore tune``: a weight whose spread is as large as itself, or whose sign changes, is not determined by
    the dev list."""
    sources = [("runs", len(result.run_weights), result.weight_spread)]
    if cross_validation:
        sources.append(("folds", cross_validation["folds"], cross_validation["weight_spread"]))
    lines = ["weight stability (mean ± std [min, max], share with the mean's sign):"]
    for name in result.weights:
        if name == result.fixed:
            continue
        parts = [
            f"{label} ({n}): {s[name]['mean']:+.4g} ± {s[name]['std']:.3g} [{s[name]['min']:+.4g}, {s[name]['max']:+.4g}]"
            f" {s[name]['sign_agreement']:.0%}"
            for label, n, s in sources
        ]
        lines.append(f"  {name}: " + "; ".join(parts))
    if cross_validation:
        cv = cross_validation
        gains = ", ".join(f"{g:+.3f}" for g in cv["fold_gains"])
        lines.append(
            f"  held-out gain per fold (baseline - tuned): {gains}; {cv['folds_improved']}/{cv['folds']} improved"
        )
    return "\n".join(lines)


def _rescaled_bounds(
    names: Sequence[str], fixed: str, bounds: Mapping[str, tuple[float | None, float | None]] | None, unit: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Per feature (fixed included, unbounded) the low and high limits of its rescaled weight."""
    low, high = np.full(len(names), -np.inf), np.full(len(names), np.inf)
    free = [i for i, name in enumerate(names) if name != fixed]
    for name, (lo, hi) in (bounds or {}).items():
        if name not in names or name == fixed:
            raise ValueError(f"bounds name {name!r}: expected one of the tuned features {[names[i] for i in free]}")
        j = names.index(name)
        scale = unit[free.index(j)]
        low[j] = -np.inf if lo is None else lo / scale
        high[j] = np.inf if hi is None else hi / scale
    return low, high


def _search(
    objective, x0: np.ndarray, method: str, rng: np.random.Generator, maxfev: int, bounds: list | None = None
) -> tuple[np.ndarray, float]:
    """One scipy run; returns the best point it *evaluated* (kept only when strictly better than the start).

    Steps are one rescaled unit along random orthonormal directions: big enough to leave a plateau. Tolerances are
    coarse because the objective has no slope to refine on.
    """
    best = [x0, objective(x0)]

    def tracked(u: np.ndarray) -> float:
        value = objective(u)
        if value < best[1]:
            best[0], best[1] = np.array(u), value
        return value

    n = len(x0)
    directions = np.linalg.qr(rng.standard_normal((n, n)))[0] if n else np.zeros((0, 0))
    if method == "powell":
        options = {"direc": directions, "xtol": 1e-3, "ftol": 1e-6, "maxfev": maxfev}
    else:
        options = {"initial_simplex": np.vstack([x0, x0 + directions]), "xatol": 1e-3, "fatol": 1e-6, "maxfev": maxfev}
    if n:
        # imported here: half a second, which lm-rescore's validation errors need not wait for
        from scipy.optimize import minimize

        minimize(tracked, x0, method=method, options=options, bounds=bounds)
    return best[0], best[1]


@dataclass
class Fold:
    heldout: np.ndarray  # utterance positions held out (never seen by that fold's tuning)
    weights: dict[str, float]
    dev_metric: float  # on the other folds, where the weights were tuned
    heldout_metric: float
    heldout_baseline: float  # the starting weights on the held-out fold: what the tuned weights must beat


@dataclass
class CrossValidation:
    metric: str
    heldout_metric: float  # pooled: every utterance chosen by weights tuned without it
    baseline_metric: float  # the starting weights on the whole set, for comparison
    chosen: np.ndarray  # per utterance the held-out choice
    folds: list[Fold]

    @property
    def folds_improved(self) -> int:
        """Folds whose held-out part the tuned weights made strictly better than the starting weights did."""
        better = (lambda a, b: a > b) if metrics.HIGHER_IS_BETTER[self.metric] else (lambda a, b: a < b)
        return sum(better(f.heldout_metric, f.heldout_baseline) for f in self.folds)

    @property
    def weight_spread(self) -> dict[str, dict[str, float]]:
        """Per weight its spread over the folds' tunings (``weight_spread``)."""
        return weight_spread([f.weights for f in self.folds])

    def summary(self) -> dict:
        """The figures a weights file or a benchmark records (per fold: held-out metric, its baseline, weights)."""
        return {
            "folds": len(self.folds),
            "heldout_metric": self.heldout_metric,
            "baseline_metric": self.baseline_metric,
            "folds_improved": self.folds_improved,
            "fold_metrics": [f.heldout_metric for f in self.folds],
            "fold_baselines": [f.heldout_baseline for f in self.folds],
            "fold_gains": [f.heldout_baseline - f.heldout_metric for f in self.folds],
            "fold_weights": [f.weights for f in self.folds],
            "weight_spread": self.weight_spread,
        }


def fold_indices(
    n: int, k: int, seed: int = 0, contiguous: bool = False, groups: Sequence | None = None
) -> list[np.ndarray]:
    """A partition of range(n) into k folds of near-equal size (each sorted): seeded random, or ``contiguous`` runs
    of consecutive entries. Contiguous folds keep a document's segments (MT) or a speaker's utterances together, so a
    held-out fold is new text rather than the neighbours of what the weights were tuned on. ``groups`` (a label per
    entry, e.g. its document) keeps every group whole wherever its entries lie: the groups in order of first
    appearance, cut into k runs of near-equal entries (a group goes to the run its middle entry falls in)."""
    if not 2 <= k <= n:
        raise ValueError(f"need 2 <= k <= {n} folds, got {k}")
    if groups is not None:
        return _group_folds(n, k, groups)
    order = np.arange(n) if contiguous else np.random.default_rng(seed).permutation(n)
    return [np.sort(f) for f in np.array_split(order, k)]


def _group_folds(n: int, k: int, groups: Sequence) -> list[np.ndarray]:
    if len(groups) != n:
        raise ValueError(f"{len(groups)} group labels for {n} entries")
    members: dict = {}
    for i, label in enumerate(groups):
        members.setdefault(label, []).append(i)
    folds: list[list[int]] = [[] for _ in range(k)]
    start = 0
    for entries in members.values():
        folds[min(k - 1, int(k * (start + len(entries) / 2) / n))] += entries
        start += len(entries)
    if not all(folds):
        raise ValueError(
            f"cannot cut {len(members)} documents of {n} entries into {k} folds of whole documents with entries in "
            "each: use fewer folds, or folds of entries"
        )
    return [np.sort(np.array(f, dtype=np.int64)) for f in folds]


def cross_validate(
    data: TuningSet,
    k: int = 5,
    seed: int = 0,
    tuner=None,
    contiguous: bool = False,
    partition: Sequence[np.ndarray] | None = None,
    **tune_args,
) -> CrossValidation:
    """k-fold cross-validation over utterances: for small sets where a separate dev set would leave too little.

    Fold j's weights are tuned on the other k-1 folds only and choose the hypotheses of fold j; the pooled
    held-out metric over all utterances estimates what tuned weights do on unseen data (the dev metric of
    ``tune_weights`` on the whole set is optimistic). ``tune_args`` go to ``tune_weights``; fold j searches with
    seed ``seed + j``; ``contiguous`` folds are runs of consecutive utterances (``fold_indices``); ``partition``, when
    given, is the folds themselves (k is then their number). ``tuner`` (default ``tune_weights``) takes the same
    arguments and returns a ``TuneResult``: e.g. ``guarded_tuner``, to cross-validate a recipe that includes its own
    guard."""
    tuner = tuner or tune_weights
    start = start_weights(data.feature_names, tune_args.get("fixed") or data.feature_names[0], tune_args.get("init"))
    start_vector = np.array([start[f] for f in data.feature_names])
    chosen = np.zeros(len(data), dtype=np.int64)
    folds = []
    for j, heldout in enumerate(fold_indices(len(data), k, seed, contiguous) if partition is None else partition):
        train = np.setdiff1d(np.arange(len(data)), heldout)
        result = tuner(data.subset(train, f"{data.name}[not fold {j}]"), seed=seed + j, **tune_args)
        test = data.subset(heldout, f"{data.name}[fold {j}]")
        chosen[heldout] = test.choose(np.array([result.weights[f] for f in data.feature_names]))
        fold = Fold(
            heldout, result.weights, result.dev_metric, test.score(chosen[heldout]), test.evaluate(start_vector)
        )
        folds.append(fold)
    return CrossValidation(data.metric, data.score(chosen), data.evaluate(start_vector), chosen, folds)


@dataclass
class Guarded:
    result: TuneResult  # weights tuned on the whole set, or the starting weights when not adopted
    cross_validation: CrossValidation
    adopted: bool
    per_list: dict | None = None  # with ``owners``: per list its held-out folds and how many of them gained


def tune_guarded(
    data: TuningSet,
    folds: int = 5,
    require_folds: int = 5,
    seed: int = 0,
    result: TuneResult | None = None,
    owners: Sequence | None = None,
    groups: Sequence | None = None,
    **tune_args,
) -> Guarded:
    """``tune_weights`` on the whole set (or ``result``, a search of it already run), kept only when k-fold
    cross-validation of the same search beats the starting weights on at least ``require_folds`` held-out folds;
    otherwise the starting weights (the first pass alone): a gain that does not hold across parts of the dev list
    does not hold on other lists either.

    ``owners`` (a label per utterance: the list it comes from, when the set pools several) makes the guard per list:
    every list must gain on ``require_folds`` of its held-out parts (on all of them where it lies in fewer folds), not
    just the union, which one large list could carry while another gets worse. ``groups`` (a label per utterance, its
    document) keeps documents whole in the guard's folds (``fold_indices``); without, the folds are seeded random."""
    if not 0 <= require_folds <= folds:
        raise ValueError(f"require_folds {require_folds}: expected 0 to the number of folds ({folds})")
    result = result or tune_weights(data, seed=seed, **tune_args)
    partition = None if groups is None else fold_indices(len(data), folds, groups=groups)
    cv = cross_validate(data, k=folds, seed=seed, partition=partition, **tune_args)
    per_list = None
    if owners is None:
        adopted = cv.folds_improved >= require_folds
    else:
        per_list = _folds_gained_per_list(data, cv, np.asarray(owners), tune_args.get("fixed"), tune_args.get("init"))
        adopted = all(p["improved"] >= min(require_folds, p["folds"]) for p in per_list.values())
    if not adopted:
        start = start_weights(data.feature_names, result.fixed, tune_args.get("init"))
        result = replace(result, weights=start, dev_metric=result.baseline_metric)
    return Guarded(result, cv, adopted, per_list)


def _folds_gained_per_list(data: TuningSet, cv: CrossValidation, owners: np.ndarray, fixed, init) -> dict:
    """Per list (``owners``' labels, in order of first appearance): the held-out folds it has utterances in, and in
    how many of them the tuned weights beat the starting ones on its utterances."""
    start = start_weights(data.feature_names, fixed or data.feature_names[0], init)
    start_vector = np.array([start[f] for f in data.feature_names])
    better = (lambda a, b: a > b) if metrics.HIGHER_IS_BETTER[data.metric] else (lambda a, b: a < b)
    out: dict = {}
    for label in dict.fromkeys(owners.tolist()):
        present = improved = 0
        for fold in cv.folds:
            mine = fold.heldout[owners[fold.heldout] == label]
            if len(mine):
                part = data.subset(mine)
                present += 1
                improved += better(part.score(cv.chosen[mine]), part.evaluate(start_vector))
        out[label] = {"folds": present, "improved": improved}
    return out


def guarded_tuner(folds: int = 5, require_folds: int = 5, owners: Sequence | None = None):
    """``tune_guarded`` as a ``tuner`` for ``cross_validate`` (nested cross-validation of a guarded recipe).
    ``owners``: a list label per utterance of the set being cross-validated (the per-list guard); each training part
    gets its own utterances' labels (``TuningSet.ids``)."""
    labels = None if owners is None else np.asarray(owners)
    return lambda data, **tune_args: (
        tune_guarded(
            data, folds, require_folds, owners=None if labels is None else labels[data.ids], **tune_args
        ).result
    )


def apply_weights(
    features: Sequence[np.ndarray], feature_names: Sequence[str], weights: Mapping[str, float]
) -> np.ndarray:
    """Per utterance the chosen hypothesis index (ties to the lower rank), e.g. for a test set with tuned weights."""
    if set(weights) != set(feature_names):
        raise ValueError(f"weights name {sorted(weights)}, the features are {sorted(feature_names)}")
    w = np.array([weights[f] for f in feature_names], dtype=np.float64)
    return metrics.choose([np.asarray(x, dtype=np.float64) @ w for x in features])


# -- weights file ------------------------------------------------------------------------------------------------


def write_weights(path: str | Path, result: TuneResult, setup: Mapping | None = None, **extra) -> None:
    """Save tuned weights as JSON, atomically (a reader never sees half a file). ``setup``: what else a rescoring run
    needs to reproduce the choice (models, definitions, λ: ``rescoring.rescore.setup_record``); ``extra``: more
    fields for the record (cross-validation results, ...). Model paths are stored relative to the weights file (absolute
    where there is no such path, e.g. on another drive), so the file works from any directory and moves with them;
    ``setup["fingerprints"]`` says which models they were by content (``core.fingerprints``)."""
    path = Path(path)
    setup = dict(setup or {})
    for key in MODEL_PATHS:
        if setup.get(key):
            model = Path(setup[key]).absolute()
            try:
                setup[key] = os.path.relpath(model, path.absolute().parent)
            except ValueError:
                setup[key] = str(model)
    record = {
        "format": WEIGHTS_FORMAT,
        "format_version": WEIGHTS_VERSION,
        "features": list(result.weights),
        "weights": result.weights,
        "fixed": result.fixed,
        "metric": result.metric,
        "dev_set": result.dev_set,
        "dev_metric": result.dev_metric,
        "baseline_metric": result.baseline_metric,
        "signature": result.signature,
        "spread": result.spread,
        "weight_spread": result.weight_spread,  # per weight, over the search's runs
        "settings": result.settings,
        "setup": setup,
        **extra,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    atomic_write_text(path, json.dumps(record, indent=2) + "\n")


def read_weights(path: str | Path) -> dict:
    """Load a weights file, checking the fields a rescoring run relies on; model paths come back usable from here
    (resolved against the weights file's folder)."""
    path = Path(path)
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read weights JSON: {e}") from e
    if not isinstance(record, dict) or record.get("format") != WEIGHTS_FORMAT:
        raise ValueError(f"{path}: field 'format' must be {WEIGHTS_FORMAT!r}")
    if record.get("format_version") not in (1, WEIGHTS_VERSION):
        raise ValueError(
            f"{path}: field 'format_version' must be 1 or {WEIGHTS_VERSION}, got {record.get('format_version')}"
        )
    for key in ("features", "weights", "metric", "dev_set", "date"):
        if key not in record:
            raise ValueError(f"{path}: missing field {key!r}")
    weights = record["weights"]
    if not isinstance(weights, dict) or list(weights) != record["features"]:
        raise ValueError(f"{path}: field 'weights' must map exactly the names in 'features', in that order")
    bad = [name for name, w in weights.items() if not isinstance(w, int | float) or not math.isfinite(w)]
    if bad:
        raise ValueError(f"{path}: field 'weights': not finite numbers for {bad}")
    if record["metric"] not in metrics.METRICS:
        raise ValueError(f"{path}: field 'metric' must be one of {metrics.METRICS}, got {record['metric']!r}")
    setup = record.get("setup", {})
    if not isinstance(setup, dict):
        raise ValueError(f"{path}: field 'setup' must be an object, got {setup!r:.60}")
    recorded = setup.get("fingerprints", {})
    if not isinstance(recorded, dict) or not all(isinstance(v, dict) for v in recorded.values()):
        raise ValueError(f"{path}: field 'setup.fingerprints' must map model fields to objects, got {recorded!r:.60}")
    for key in MODEL_PATHS:
        value = setup.get(key)
        if value is not None and not isinstance(value, str):
            raise ValueError(f"{path}: field 'setup.{key}' must be a path, got {value!r:.60}")
        if value and record["format_version"] >= 2:
            setup[key] = str(path.parent / value)  # (an absolute value stays as it is)
    return record


# -- helpers -----------------------------------------------------------------------------------------------------


def _check_nbest(name: str, features: Sequence[np.ndarray], nbest: Sequence[Sequence[str]]) -> None:
    if len(features) != len(nbest):
        raise ValueError(f"{name}: {len(features)} feature matrices but {len(nbest)} n-best lists")
    for i, (x, hyps) in enumerate(zip(features, nbest, strict=True)):
        if not hyps:
            raise ValueError(f"{name}: utterance {i}: empty n-best list")
        if len(x) != len(hyps):
            raise ValueError(f"{name}: utterance {i}: {len(x)} feature rows but {len(hyps)} hypotheses")


COST_SUFFIX = "_cost"  # a feature named so is a cost: lower is better (module docstring)


def is_cost(name: str) -> bool:
    return name.endswith(COST_SUFFIX)


def start_weights(names: Sequence[str], fixed: str, init: Mapping[str, float] | None) -> dict[str, float]:
    """The search's starting point: ``fixed`` = 1, every cost (``is_cost``, the fixed one too) -1, the rest 0,
    overridden by ``init`` (which keeps ``fixed`` where it is)."""
    if fixed not in names:
        raise ValueError(f"fixed feature {fixed!r} is not one of {tuple(names)}")
    start = {name: -1.0 if is_cost(name) else 1.0 if name == fixed else 0.0 for name in names} | dict(init or {})
    if set(start) != set(names) or start[fixed] != (-1.0 if is_cost(fixed) else 1.0):
        raise ValueError(
            f"init must name features of {tuple(names)} and keep {fixed!r} at {-1 if is_cost(fixed) else 1}, got "
            f"{dict(init or {})}"
        )
    return start


def _list_means(x: np.ndarray, pad: np.ndarray) -> np.ndarray:
    """Per list and feature the mean over real hypotheses, shaped to broadcast against x."""
    real = (~pad)[..., None]
    return ((x * real).sum(axis=1) / real.sum(axis=1))[:, None, :]
