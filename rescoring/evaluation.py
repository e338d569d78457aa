"""Will rescoring help on my data? The evaluation protocol behind ``lm-rescore evaluate``: every figure held out.

A **recipe** is features, the one fixed at weight 1 (the scale), definitions, the λ values tried for ``interp`` and
the search's settings (``rescoring.tune``). It is judged by one or more protocols, each of which tunes weights
without the entries it reports:

- **cross-validation** (``Evaluation.cross_validation``): K folds of every list, of random entries (seeded),
  contiguous runs, or whole documents (``tune.fold_indices``); fold j of several lists is the j-th fold of each, so
  that every fold holds part of every list. ``over="union"``: the weights of fold j tuned on the other folds of all
  the lists together; ``over="each"``: every list cross-validated on its own. With a guard (``guard=(G, R)``), each
  training part keeps its tuned weights only when every list in it gains on R of G folds of that part, not just
  their union (``tune.tune_guarded`` with owners: the per-list guard); otherwise that fold keeps the first pass.
- **held out** (``Evaluation.held_out``): tuned on the union of some lists, applied unchanged to others.
- **transfer** (``Evaluation.transfer``): leave one list out: each list with the weights tuned on the union of the
  other lists of a pool.

λ, where ``interp`` is used, is chosen inside each training part (the λ whose tuned weights do best there).

The recipe is compared, on the same folds and tuned the same way, with **baselines**: the first pass (``1best``,
each list's first hypothesis); ``no_lm``, the recipe without any LM feature (``neural``, ``ngram``, ``interp``, the
OOV counts, the ``neural_*`` scores a list carries); ``ngram_only``, the recipe without what needs the neural bundle
(``neural``, ``interp``, ``oov_lm``, and the other neural LMs' ``neural_*`` scores; the n-gram's scores are those computed beside the bundle, on the bundle's tokens); ``first_pass``, a feature set of
the first pass alone (e.g. AM only, ``am=0.6*decoder+0.4*ctc``), tuned the same way; and, for lists of MT systems'
outputs (``sys_*`` indicators, ``rescoring.nbest.wmt``), ``best_system``, the single system with the best corpus
metric on the list (picked with the references: a bar, not a method). **Ablations** drop one group of features
at a time (``GROUPS``); a variant that loses its fixed feature is scaled by its first remaining one. Each variant's
choices are compared with the recipe's by a paired bootstrap (``metrics.paired_bootstrap_stats``: B is the recipe).

The **in-sample ceiling** (``Evaluation.ceilings``), the recipe tuned on a list itself, has seen the references: a
diagnostic of what the features could do, never a result.

MT figures are BLEU (sacrebleu, the tuned metric) with chrF and the length ratio (hypothesis over reference length,
BLEU's) beside each; ASR figures are WER with the length ratio (hypothesis words over reference words).

"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from lmserve.rescoring import metrics
from lmserve.rescoring.features import ANNOTATED, LIST_FEATURES, VOTES, models_needed, parse_consensus
from lmserve.rescoring.nbest import NBestList
from lmserve.rescoring.rescore import Setup, references_of, tuning_set
from lmserve.rescoring.tune import (
    TuneResult,
    TuningSet,
    cross_validate,
    fold_indices,
    tune_guarded,
    tune_weights,
    weight_spread,
)

FORMAT = "lmserve-evaluation"
FORMAT_VERSION = 1
SYSTEM_PREFIX = "sys_"  # the system indicators of lists read from system outputs (``rescoring.nbest.wmt``)
SYSTEMS_WILDCARD = "sys_*"  # in a feature list: every system indicator the lists carry, in the reader's order
FOLD_MODES = ("random", "contiguous", "document")
# feature groups, for ablations and the LM baselines: what each feature is computed from
GROUPS = ("first_pass", "consensus", "systems", "surface", "neural", "ngram")
LM_GROUPS = ("neural", "ngram")
SURFACE = ("length", *[f for f in LIST_FEATURES if f != "rank"])  # length, chars, nonword, src_ratio
FIRST = "1best"
RECIPE = "recipe"


# -- recipes -------------------------------------------------------------------------------------------------------


@dataclass
class Recipe:
    """Features, the fixed one, definitions, λ values for ``interp`` and the weight search's settings."""

    features: tuple[str, ...]
    fixed: str
    definitions: dict[str, dict[str, float]] = field(default_factory=dict)
    lambdas: tuple[float, ...] = (0.5,)
    search: dict = field(default_factory=dict)  # tune_weights' restarts, penalty, bounds, methods, maxfev

    def __post_init__(self) -> None:
        self.features = tuple(self.features)
        if not self.features or len(set(self.features)) != len(self.features):
            raise ValueError(f"features: expected distinct names, got {list(self.features)}")
        if self.fixed not in self.features:
            raise ValueError(f"fixed feature {self.fixed!r} is not one of {list(self.features)}")
        if self.uses_interp and not self.lambdas:
            raise ValueError("feature 'interp' needs at least one λ")

    @property
    def uses_interp(self) -> bool:
        return Setup(list(self.features), self.definitions).uses_interp

    @property
    def lambda_keys(self) -> tuple[float | None, ...]:
        """The λ values that matter: the recipe's with ``interp``, else one None."""
        return tuple(self.lambdas) if self.uses_interp else (None,)

    def tune_args(self) -> dict:
        """``tune_weights``' keyword arguments: the fixed feature, and the search with only the bounds of this
        recipe's own tuned features (one bounds setting serves every variant)."""
        bounds = {k: v for k, v in (self.search.get("bounds") or {}).items() if k in self.features and k != self.fixed}
        return {**self.search, "bounds": bounds, "fixed": self.fixed}

    def without(self, dropped: set[str]) -> Recipe | None:
        """The recipe less ``dropped`` (None when nothing is left); the fixed feature, if dropped, becomes the first
        feature left."""
        kept = [f for f in self.features if f not in dropped]
        if not kept:
            return None
        return replace(self, features=tuple(kept), fixed=self.fixed if self.fixed in kept else kept[0])

    def record(self) -> dict:
        return {
            "features": list(self.features),
            "fixed": self.fixed,
            "definitions": self.definitions,
            "lambdas": list(self.lambda_keys) if self.uses_interp else None,
            "search": {**self.search, "bounds": {k: list(v) for k, v in self.tune_args()["bounds"].items()}},
        }


def feature_groups(name: str, definitions: Mapping[str, Mapping[str, float]], has_lm: bool) -> set[str]:
    """The groups (``GROUPS``) feature ``name`` belongs to: the LMs it needs (``neural``, ``ngram``; ``interp``
    both), else ``consensus``, ``systems`` (votes, sys_*), ``surface`` (length, chars, nonword, src_ratio) or
    ``first_pass`` (rank and every score the list carries); a definition, the groups of its terms."""
    if name in definitions:
        return set().union(*(feature_groups(t, {}, has_lm) for t in definitions[name]))
    needed = models_needed(name, definitions, has_lm)
    if needed:
        return {"neural" if m == "lm" else "ngram" for m in needed}
    if name.startswith(ANNOTATED):  # another neural LM's scores, carried by the list
        return {"neural"}
    if parse_consensus(name) is not None:
        return {"consensus"}
    if name == VOTES or name.startswith(SYSTEM_PREFIX):
        return {"systems"}
    if name in SURFACE:
        return {"surface"}
    return {"first_pass"}


@dataclass
class Variant:
    """A system the recipe is compared with (or the recipe): its own recipe, or None for a fixed choice."""

    name: str
    role: str  # recipe, baseline, ablation
    recipe: Recipe | None
    dropped: tuple[str, ...] = ()
    about: str = ""

    def record(self) -> dict:
        out = {"role": self.role, "about": self.about}
        if self.recipe is not None:
            out |= {"features": list(self.recipe.features), "fixed": self.recipe.fixed}
        if self.dropped:
            out["dropped"] = list(self.dropped)
        return out


def variants(
    recipe: Recipe,
    has_lm: bool,
    has_ngram: bool,
    first_pass: Recipe | None = None,
    ablate: Sequence[str] | None = None,
) -> tuple[dict[str, Variant], dict[str, str]]:
    """The recipe, its baselines and ablations (module docstring), by name, and the ones left out with why.
    ``ablate``: the groups to ablate (default: every group of the recipe but the LMs', whose removal the
    baselines ``no_lm`` and ``ngram_only`` measure, and ``without_ngram`` where there is a neural LM too)."""
    groups = {f: feature_groups(f, recipe.definitions, has_lm) for f in recipe.features}
    out = {RECIPE: Variant(RECIPE, "recipe", recipe, about="the recipe")}
    skipped: dict[str, str] = {}
    seen = {recipe.features: RECIPE}

    def add(name: str, role: str, drop_groups: set[str], about: str) -> None:
        dropped = tuple(f for f in recipe.features if groups[f] & drop_groups)
        if not dropped:
            skipped[name] = f"the recipe has no feature of {', '.join(sorted(drop_groups))}"
            return
        smaller = recipe.without(set(dropped))
        if smaller is None:
            skipped[name] = "nothing would be left: the same as 1best"
            return
        if smaller.features in seen:
            skipped[name] = f"the same features as {seen[smaller.features]}"
            return
        seen[smaller.features] = name
        out[name] = Variant(name, role, smaller, dropped, about)

    lm_groups = {g for f in recipe.features for g in groups[f] if g in LM_GROUPS}
    if lm_groups:
        add("no_lm", "baseline", set(LM_GROUPS), "the recipe without any LM feature")
    else:
        skipped["no_lm"] = "the recipe has no LM feature: it is the no-LM system"
    if "neural" in lm_groups and has_ngram:
        add("ngram_only", "baseline", {"neural"}, "the recipe without what needs the neural bundle")
    else:
        skipped["ngram_only"] = (
            "the recipe has no feature of the neural bundle" if "neural" not in lm_groups else "no n-gram"
        )
    if first_pass is not None:
        name = "first_pass"
        if first_pass.features in seen:
            skipped[name] = f"the same features as {seen[first_pass.features]}"
        else:
            seen[first_pass.features] = name
            out[name] = Variant(name, "baseline", first_pass, about="the first pass's own features, tuned alike")
    present = [g for g in GROUPS if any(g in groups[f] for f in recipe.features)]
    if ablate is None:
        ablate = [g for g in present if g not in LM_GROUPS] + (["ngram"] if {"neural", "ngram"} <= lm_groups else [])
    for group in ablate:
        if group not in GROUPS:
            raise ValueError(f"ablation group {group!r}: expected some of {', '.join(GROUPS)}")
        add(f"without_{group}", "ablation", {group}, f"the recipe without its {group} features")
    return out, skipped


# -- the lists -------------------------------------------------------------------------------------------------------


@dataclass
class ListData:
    """One list under evaluation: its entries, LM scores (None without models) and documents (for document folds)."""

    name: str
    nbest: NBestList
    scores: object = None
    documents: Sequence[str] | None = None

    def __len__(self) -> int:
        return len(self.nbest)


def system_names(nbest: NBestList) -> list[str]:
    """The systems whose indicators a list carries, in the order the reader wrote them."""
    return [f.removeprefix(SYSTEM_PREFIX) for f in nbest.feature_names() if f.startswith(SYSTEM_PREFIX)]


def system_choice(nbest: NBestList, system: str) -> np.ndarray:
    """Per entry the candidate that ``system`` produced: that system's own output as a choice."""
    feature = SYSTEM_PREFIX + system
    return np.array([next(k for k, h in enumerate(e.hypotheses) if h.features[feature]) for e in nbest])


def expand_systems(features: Sequence[str], lists: Sequence[NBestList]) -> list[str]:
    """``features`` with ``sys_*`` replaced by the system indicators the lists carry (all of them the same ones)."""
    if SYSTEMS_WILDCARD not in features:
        return list(features)
    indicators = None
    for nbest in lists:
        mine = [SYSTEM_PREFIX + s for s in system_names(nbest)]
        if not mine:
            raise ValueError(f"{nbest.name}: feature {SYSTEMS_WILDCARD!r}: the list carries no system indicators")
        if indicators is not None and set(mine) != set(indicators):
            raise ValueError(
                f"feature {SYSTEMS_WILDCARD!r}: {nbest.name} has other systems than {lists[0].name} "
                "(weights tuned on one set of systems cannot weigh another): evaluate such lists one by one"
            )
        indicators = indicators or mine
    k = list(features).index(SYSTEMS_WILDCARD)
    return [*features[:k], *indicators, *features[k + 1 :]]


def document_ids(nbest: NBestList, pattern: str) -> list[str]:
    """Each entry's document: the first group of ``pattern`` (a regular expression) searched in the entry's id, or
    its whole match when it has no group."""
    import re

    regex = re.compile(pattern)
    out = []
    for entry in nbest:
        match = regex.search(entry.id)
        if match is None:
            raise ValueError(
                f"{nbest.name}: entry id {entry.id!r}: --document-id {pattern!r} does not match it; expected every "
                "id to name its document"
            )
        out.append(match.group(1) if regex.groups else match.group(0))
    return out


# -- fitting -------------------------------------------------------------------------------------------------------


@dataclass
class Fit:
    """Weights tuned on one training part: at the λ that did best there, kept or not by the guard."""

    weights: dict[str, float]
    lam: float | None
    result: TuneResult
    adopted: bool = True
    by_lambda: dict = field(default_factory=dict)
    guard: dict | None = None

    def record(self) -> dict:
        out = {"weights": self.weights, "lambda": self.lam, "adopted": self.adopted}
        out |= {"tune_before": self.result.baseline_metric, "tune_after": self.result.dev_metric}
        if len(self.by_lambda) > 1:
            out["tune_by_lambda"] = {str(k): v for k, v in self.by_lambda.items()}
        if self.guard is not None:
            out["guard"] = self.guard
        return out


def fit(
    sets: Mapping[float | None, TuningSet],
    recipe: Recipe,
    seed: int = 0,
    guard: tuple[int, int] | None = None,
    owners: Sequence | None = None,
    groups: Sequence | None = None,
) -> Fit:
    """The recipe's weights on ``sets`` (one per λ, the same entries): tuned at each λ, the best search objective
    kept (ties to the first: the metric with the penalty and the length bound, which the metric alone would let a
    λ evade); with ``guard`` (folds, required), kept only when the per-list guard says so (``owners``: each entry's
    list; ``groups``: its document, kept whole in the guard's folds)."""
    args = recipe.tune_args()
    best: tuple[float | None, TuneResult] | None = None
    by_lambda = {}
    for lam, data in sets.items():
        result = tune_weights(data, seed=seed, **args)
        by_lambda[lam] = result.dev_metric
        if best is None or result.objective < best[1].objective:
            best = (lam, result)
    lam, result = best
    if not guard:
        return Fit(result.weights, lam, result, True, by_lambda)
    folds, require = guard
    guarded = tune_guarded(sets[lam], folds, require, seed=seed, result=result, owners=owners, groups=groups, **args)
    info = {"folds": folds, "required": require, "folds_improved": guarded.cross_validation.folds_improved}
    if guarded.per_list is not None:
        info["per_list"] = {str(k): v for k, v in guarded.per_list.items()}
    return Fit(guarded.result.weights, lam, guarded.result, guarded.adopted, by_lambda, info)


def chosen_by(data: TuningSet, weights: Mapping[str, float]) -> np.ndarray:
    return data.choose(np.array([weights[f] for f in data.feature_names]))


def pooled(parts: Sequence[TuningSet]) -> TuningSet:
    """Several lists' tuning sets as one (their entries one after the other)."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    return TuningSet(
        "+".join(p.name for p in parts),
        first.feature_names,
        first.metric,
        [x for p in parts for x in p.features],
        [s for p in parts for s in p.stats],
        bleu_args=first.bleu_args,
        signature=first.signature,
    )


def partition(sizes: Sequence[int], k: int, mode: str, seed: int = 0, documents=None) -> list[np.ndarray]:
    """K folds of lists of ``sizes`` entries laid end to end: fold j is the j-th fold of every list (``mode``:
    random, contiguous or document; ``documents``: per list its entries' documents)."""
    if mode not in FOLD_MODES:
        raise ValueError(f"fold mode {mode!r}: expected one of {', '.join(FOLD_MODES)}")
    folds: list[list[np.ndarray]] = [[] for _ in range(k)]
    start = 0
    for i, n in enumerate(sizes):
        groups = None if mode != "document" else documents[i]
        for j, fold in enumerate(fold_indices(n, k, seed, contiguous=mode == "contiguous", groups=groups)):
            folds[j].append(fold + start)
        start += n
    return [np.sort(np.concatenate(f)) for f in folds]


# -- the evaluation ------------------------------------------------------------------------------------------------


class Evaluation:
    """A recipe, its variants and the lists they are judged on; each protocol returns its JSON section."""

    def __init__(
        self,
        lists: Sequence[ListData],
        metric: str,
        recipe: Recipe,
        has_lm: bool,
        has_ngram: bool,
        first_pass: Recipe | None = None,
        ablate: Sequence[str] | None = None,
        seed: int = 0,
        bootstrap_samples: int = 1000,
    ):
        if metric not in metrics.METRICS:
            raise ValueError(f"metric must be one of {metrics.METRICS}, got {metric!r}")
        names = [x.name for x in lists]
        if len(set(names)) != len(names):
            raise ValueError(f"lists: every list needs its own name, got {names}")
        self.lists = {x.name: x for x in lists}
        self.metric = metric
        self.recipe = recipe
        self.seed = seed
        self.samples = bootstrap_samples
        self.variants, self.skipped = variants(recipe, has_lm, has_ngram, first_pass, ablate)
        self.features = list(dict.fromkeys(f for v in self.variants.values() for f in v.recipe.features))
        self.definitions = {**(first_pass.definitions if first_pass else {}), **recipe.definitions}
        self._sets: dict[str, dict[float | None, TuningSet]] = {}
        self._words: dict[str, np.ndarray] = {}

    # tuning sets: every feature once per list (and λ), each variant's columns taken from them

    def _all(self, name: str) -> dict[float | None, TuningSet]:
        if name not in self._sets:
            data = self.lists[name]
            lams = self.recipe.lambda_keys
            setup = Setup(self.features, self.definitions, lams[0])
            base = tuning_set(data.nbest, setup, data.scores, self.metric)
            sets = {lams[0]: base}
            interp = [f for f in self.features if Setup([f], self.definitions).uses_interp]
            for lam in lams[1:]:
                columns = Setup(interp, self.definitions, lam).matrices(data.nbest, data.scores)
                where = [self.features.index(f) for f in interp]
                features = []
                for x, y in zip(base.features, columns, strict=True):
                    x = x.copy()
                    x[:, where] = y
                    features.append(x)
                sets[lam] = replace(base, features=features)
            self._sets[name] = sets
        return self._sets[name]

    def sets(self, names: Sequence[str], variant: Variant) -> dict[float | None, TuningSet]:
        """The variant's tuning sets of ``names`` pooled, one per λ it uses."""
        recipe = variant.recipe
        where = [self.features.index(f) for f in recipe.features]
        out = {}
        for lam in recipe.lambda_keys:
            parts = []
            for name in names:
                full = self._all(name)
                base = full[lam if lam in full else next(iter(full))]
                parts.append(
                    replace(base, feature_names=recipe.features, features=[x[:, where] for x in base.features])
                )
            out[lam] = pooled(parts)
        return out

    def base(self, name: str) -> TuningSet:
        """A tuning set of the list (its metric statistics are what figures are computed from)."""
        return next(iter(self._all(name).values()))

    # fixed choices

    def fixed_choices(self, name: str) -> dict[str, np.ndarray]:
        """The choices needing no tuning: the first pass, and the best single system of a list of systems."""
        data, nbest = self.base(name), self.lists[name].nbest
        choices = {FIRST: np.zeros(len(nbest), dtype=np.int64)}
        systems = system_names(nbest)
        if systems:
            sign = 1 if metrics.HIGHER_IS_BETTER[self.metric] else -1
            by_system = {s: system_choice(nbest, s) for s in systems}
            best = max(systems, key=lambda s: sign * data.score(by_system[s]))
            choices["best_system"] = by_system[best]
        return choices

    def best_system_name(self, name: str) -> str | None:
        nbest = self.lists[name].nbest
        systems = system_names(nbest)
        if not systems:
            return None
        chosen = self.fixed_choices(name)["best_system"]
        return next(s for s in systems if np.array_equal(system_choice(nbest, s), chosen))

    # protocols

    def cross_validation(
        self,
        k: int,
        mode: str = "contiguous",
        over: str = "union",
        guard: tuple[int, int] | None = None,
        names: Sequence[str] | None = None,
    ) -> dict:
        """K-fold cross-validation of every variant on the same folds (module docstring), of ``names`` (default:
        every list)."""
        if over not in ("union", "each"):
            raise ValueError(f"over {over!r}: expected union or each")
        names = list(self.lists) if names is None else list(names)
        groups = [names] if over == "union" else [[n] for n in names]
        per_list, union = {}, None
        for group in groups:
            sizes = [len(self.lists[n]) for n in group]
            docs = [self._documents(n) for n in group] if mode == "document" else None
            parts = partition(sizes, k, mode, self.seed, docs)
            owners = np.repeat(np.array(group, dtype=object), sizes)  # each entry's list, for the guard
            flat_docs = None if docs is None else [f"{i}\0{d}" for i, ds in enumerate(docs) for d in ds]
            choices, fits = {}, {}
            for key, variant in self.variants.items():
                choices[key], fits[key] = self.fold_choices(group, variant, parts, guard, owners, flat_docs)
            starts = np.cumsum([0, *sizes])
            for i, name in enumerate(group):
                mine = {key: c[starts[i] : starts[i + 1]] for key, c in choices.items()}
                report = self._report(name, mine)
                report["per_fold"], report["folds_improved"], beating = self._per_fold(
                    name, parts, starts[i], starts[i + 1], {**self.fixed_choices(name), **mine}, fits[RECIPE]
                )
                if beating is not None:
                    report["folds_beating_best"] = beating
                report["weight_spread"] = weight_spread([f.weights for f in fits[RECIPE]])
                per_list[name] = report
            if over == "union" and len(group) > 1:
                union = self._union_report(group, choices)
        return {
            "protocol": f"{k}-fold cross-validation ({mode} folds) "
            + ("over the union of the lists" if over == "union" and len(names) > 1 else "of each list on its own")
            + (
                f"; guard nested: every list must gain on {guard[1]} of {guard[0]} folds of each training part"
                if guard
                else "; no guard"
            ),
            "folds": k,
            "mode": mode,
            "over": over,
            "guard": None if not guard else {"folds": guard[0], "required": guard[1], "per_list": True},
            "seed": self.seed,
            "lists": per_list,
            **({"union": union} if union is not None else {}),
        }

    def _documents(self, name: str) -> Sequence[str]:
        docs = self.lists[name].documents
        if docs is None:
            raise ValueError(f"{name}: document folds need each entry's document (--document-id)")
        return docs

    def fold_choices(self, names, variant: Variant, parts, guard, owners, docs) -> tuple[np.ndarray, list[Fit]]:
        """The variant's held-out choices over the pooled lists ``names``: fold j (``parts``, positions in the
        pool) chosen by weights fitted on the other folds (``fit``: seed + j; ``owners``/``docs``: each pooled
        entry's list and document, for the guard)."""
        sets = self.sets(names, variant)
        first = next(iter(sets.values()))
        n = len(first)
        chosen = np.zeros(n, dtype=np.int64)
        fits = []
        for j, heldout in enumerate(parts):
            train = np.setdiff1d(np.arange(n), heldout)
            part_sets = {lam: s.subset(train, f"{s.name}[not fold {j}]") for lam, s in sets.items()}
            f = fit(
                part_sets,
                variant.recipe,
                self.seed + j,
                guard,
                owners[train],
                None if docs is None else [docs[i] for i in train],
            )
            chosen[heldout] = chosen_by(sets[f.lam].subset(heldout, f"{first.name}[fold {j}]"), f.weights)
            fits.append(f)
        return chosen, fits

    def _per_fold(self, name, parts, start, stop, choices, fits) -> tuple[list[dict], int, int | None]:
        data = self.base(name)
        sign = 1 if metrics.HIGHER_IS_BETTER[self.metric] else -1
        rows, improved, beating = [], 0, None if "best_system" not in choices else 0
        for fold, f in zip(parts, fits, strict=True):
            mine = fold[(fold >= start) & (fold < stop)] - start
            row = {"entries": len(mine), **f.record()}
            if len(mine):
                part = data.subset(mine)
                row |= {key: part.score(c[mine]) for key, c in choices.items()}
                improved += sign * (row[RECIPE] - row[FIRST]) > 0
                if beating is not None:
                    beating += row[RECIPE] >= row["best_system"]
            rows.append(row)
        return rows, improved, beating

    def held_out(self, tune: Sequence[str], report: Sequence[str], guard: tuple[int, int] | None = None) -> dict:
        """Every variant tuned on the union of ``tune`` lists, applied unchanged to each ``report`` list."""
        if overlap_ := set(tune) & set(report):
            raise ValueError(f"list {sorted(overlap_)[0]!r} is both tuned on and reported: report other lists")
        owners = np.repeat(np.array(tune, dtype=object), [len(self.lists[n]) for n in tune])
        fits = {key: fit(self.sets(tune, v), v.recipe, self.seed, guard, owners) for key, v in self.variants.items()}
        lists = {}
        for name in report:
            choices = {
                key: chosen_by(self.sets([name], v)[fits[key].lam], fits[key].weights)
                for key, v in self.variants.items()
            }
            lists[name] = self._report(name, choices)
        return {
            "protocol": f"tuned on {' ∪ '.join(tune)}, applied unchanged to each reported list"
            + (f"; guard: every tune list must gain on {guard[1]} of {guard[0]} folds" if guard else ""),
            "tuned_on": list(tune),
            "fits": {key: f.record() for key, f in fits.items()},
            "lists": lists,
        }

    def transfer(
        self,
        pool: Sequence[str] | None = None,
        guard: tuple[int, int] | None = None,
        names: Sequence[str] | None = None,
    ) -> dict:
        """Leave one list out: every list of ``names`` (default: all) with each variant tuned on the union of the
        other lists of ``pool`` (default: ``names``); one tuning serves every list that leaves out the same ones."""
        names = list(self.lists) if names is None else list(names)
        pool = names if pool is None else list(pool)
        if unknown := [p for p in pool if p not in self.lists]:
            raise ValueError(f"transfer pool: no list named {unknown[0]!r}; the lists are {', '.join(self.lists)}")

        @functools.cache
        def tuned(others: tuple[str, ...], key: str) -> Fit:
            owners = np.repeat(np.array(others, dtype=object), [len(self.lists[n]) for n in others])
            return fit(self.sets(list(others), self.variants[key]), self.variants[key].recipe, self.seed, guard, owners)

        lists = {}
        for name in names:
            others = tuple(p for p in pool if p != name)
            if not others:
                raise ValueError(f"transfer: no other list to tune {name!r} on")
            fits = {key: tuned(others, key) for key in self.variants}
            choices = {
                key: chosen_by(self.sets([name], v)[fits[key].lam], fits[key].weights)
                for key, v in self.variants.items()
            }
            lists[name] = {"tuned_on": list(others), **self._report(name, choices)}
            lists[name]["fits"] = {key: f.record() for key, f in fits.items()}
        return {
            "protocol": "leave one list out: each list with the weights tuned on the union of the other lists"
            + (f" of {', '.join(pool)}" if set(pool) != set(names) else ""),
            "pool": pool,
            "lists": lists,
        }

    def ceilings(self, names: Sequence[str] | None = None) -> dict:
        """Per list the recipe tuned on that list itself: a diagnostic, never a result."""
        out = {}
        for name in self.lists if names is None else names:
            sets = self.sets([name], self.variants[RECIPE])
            f = fit(sets, self.recipe, self.seed)
            out[name] = self._figures(name, chosen_by(sets[f.lam], f.weights))
        return {
            "diagnostic": "the recipe tuned on each list itself, references seen: what its features could do at most "
            "with one weight vector, never a result",
            "lists": out,
        }

    # figures

    def _figures(self, name: str, chosen: np.ndarray) -> dict:
        data, nbest = self.base(name), self.lists[name].nbest
        stats = _stats(data, chosen)
        out = {self.metric: data.score(chosen)}
        if self.metric == "bleu":
            refs = references_of(nbest, "bleu")
            texts = [[h.text for h in e.hypotheses] for e in nbest]
            out["chrf"] = metrics.chrf_report(refs, metrics.pick(texts, chosen))["chrf"]
            totals = stats.sum(0)
            out["length_ratio"] = float(totals[0] / max(1, totals[1]))
        else:
            words = self._hypothesis_words(name)
            chosen_words = sum(int(w[k]) for w, k in zip(words, chosen, strict=True))
            out["length_ratio"] = chosen_words / max(1, int(stats[:, 1].sum()))
        out["changed_choices"] = int(np.count_nonzero(chosen))
        return out

    def _hypothesis_words(self, name: str) -> list[np.ndarray]:
        if name not in self._words:
            self._words[name] = [
                np.array([len(h.text.split()) for h in e.hypotheses], dtype=np.int64) for e in self.lists[name].nbest
            ]
        return self._words[name]

    def _bootstrap(self, data: TuningSet, chosen: Mapping[str, np.ndarray]) -> dict:
        ours = _stats(data, chosen[RECIPE])
        return {
            f"{RECIPE}_vs_{key}": metrics.paired_bootstrap_stats(
                self.metric, _stats(data, c), ours, self.samples, signature=data.signature
            )
            for key, c in chosen.items()
            if key != RECIPE
        }

    def _report(self, name: str, choices: Mapping[str, np.ndarray]) -> dict:
        """A list's figures under every variant and fixed choice, the bootstraps of the recipe against each."""
        data = self.base(name)
        chosen = {**self.fixed_choices(name), **choices}
        out = {"entries": len(data), "systems": {key: self._figures(name, c) for key, c in chosen.items()}}
        if self.metric == "wer":
            out["oracle"] = data.score(np.array([int(np.argmin(s[:, 0])) for s in data.stats]))
        if "best_system" in chosen:
            out["best_system"] = self.best_system_name(name)
        out["bootstrap"] = self._bootstrap(data, chosen)
        return out

    def _union_report(self, names: Sequence[str], choices: Mapping[str, np.ndarray]) -> dict:
        data = pooled([self.base(n) for n in names])
        chosen = {FIRST: np.zeros(len(data), dtype=np.int64), **choices}
        return {
            "entries": len(data),
            "systems": {key: {self.metric: data.score(c)} for key, c in chosen.items()},
            "bootstrap": self._bootstrap(data, chosen),
        }

    def record(self) -> dict:
        """What the protocols share: metric, signature, recipe and variants."""
        name = next(iter(self.lists))
        out = {
            "metric": self.metric,
            "signature": self.base(name).signature,
            "recipe": self.recipe.record(),
            "variants": {key: v.record() for key, v in self.variants.items()},
            "skipped": self.skipped,
        }
        if self.metric == "bleu":
            nbest = self.lists[name].nbest
            refs = references_of(nbest, "bleu")
            out["chrf_signature"] = metrics.chrf_report(refs, [e.hypotheses[0].text for e in nbest])["signature"]
        return out


def _stats(data: TuningSet, chosen: np.ndarray) -> np.ndarray:
    return np.stack([data.stats[i][k] for i, k in enumerate(chosen)])


# -- the table -----------------------------------------------------------------------------------------------------


def format_table(result: Mapping) -> str:
    """The one table ``lm-rescore evaluate`` prints: per protocol and list, every system's figures, the recipe's
    difference from each with its bootstrap p-value, and the in-sample ceiling marked as a diagnostic."""
    metric = result["metric"]
    label = {"wer": "WER", "bleu": "BLEU"}[metric]
    columns = [label, *(["chrF"] if metric == "bleu" else []), "len"]
    lines = []
    for section in ("cross_validation", "held_out", "transfer"):
        part = result.get(section)
        if not part:
            continue
        lines += [f"{section.replace('_', ' ')}: {part['protocol']}"]
        head = f"  {'':24}" + "".join(f"{c:>8}" for c in columns) + f"{'Δ recipe':>10}{'p':>7}"
        for name, rep in part["lists"].items():
            about = f"{name} ({rep['entries']} entries)"
            if "tuned_on" in rep:
                about += f", tuned on {' ∪ '.join(rep['tuned_on'])}"
            lines += [f" {about}", head]
            recipe = rep["systems"][RECIPE][metric]
            for key, fig in rep["systems"].items():
                row = f"  {key:24}" + f"{fig[metric]:8.2f}"
                row += f"{fig['chrf']:8.2f}" if metric == "bleu" else ""
                row += f"{fig['length_ratio']:8.3f}"
                boot = rep["bootstrap"].get(f"{RECIPE}_vs_{key}")
                if boot is not None:
                    row += f"{recipe - fig[metric]:+10.2f}{boot['p_value']:7.3f}"
                elif key == RECIPE:
                    gained = rep.get("folds_improved")
                    row += f"{'':17}" + (f"  {gained}/{len(rep['per_fold'])} folds gain" if gained is not None else "")
                lines.append(row)
            if "oracle" in rep:
                lines.append(f"  {'oracle':24}{rep['oracle']:8.2f}")
            ceiling = (result.get("in_sample_ceiling") or {}).get("lists", {}).get(name)
            if ceiling is not None and section == "cross_validation":
                lines.append(
                    f"  {'ceiling (in-sample)':24}{ceiling[metric]:8.2f}  diagnostic: tuned on the list itself"
                )
        if "union" in part:
            u = part["union"]
            lines += [f" union of the lists ({u['entries']} entries)"]
            recipe = u["systems"][RECIPE][metric]
            for key, fig in u["systems"].items():
                boot = u["bootstrap"].get(f"{RECIPE}_vs_{key}")
                extra = "" if boot is None else f"{recipe - fig[metric]:+10.2f}{boot['p_value']:7.3f}"
                lines.append(f"  {key:24}{fig[metric]:8.2f}{extra}")
        lines.append("")
    if result.get("skipped"):
        lines.append("not run: " + "; ".join(f"{k} ({v})" for k, v in result["skipped"].items()))
    lines.append(
        f"Δ recipe: the recipe's {label} minus the system's; p: paired bootstrap, the share of samples in "
        "which the recipe is not better"
    )
    lines.append(result["signature"])
    return "\n".join(lines)


# -- what the LMs added: lm-rescore tune and nbest ----------------------------------------------------------------


def lms_added(
    data: TuningSet,
    setup: Setup,
    fixed: str,
    has_lm: bool,
    has_ngram: bool,
    tune_args: Mapping,
    folds: int = 0,
    recipe_heldout: Sequence[int] | None = None,
    recipe_dev: float | None = None,
    samples: int = 1000,
) -> dict | None:
    """``lm-rescore tune``'s comparison with the recipe less its LMs (``no_lm``) and less its neural LM
    (``ngram_only``), tuned the same way on ``data`` (the recipe's tuning set at its λ): in-sample, and with
    ``folds`` the same cross-validation folds as the recipe's (``recipe_heldout``: its held-out choices) with a
    paired bootstrap of the held-out choices. None when the recipe reads no LM."""
    recipe = Recipe(tuple(setup.features), fixed, setup.definitions, (setup.lam or 0.5,), dict(tune_args))
    found, _ = variants(recipe, has_lm, has_ngram, ablate=())
    found.pop(RECIPE)
    if not found:
        return None
    out: dict = {
        "protocol": "each baseline tuned as the recipe was, on the same list"
        + (
            f", and cross-validated on the same {folds} folds (the bootstrap compares held-out choices)"
            if folds
            else ""
        )
    }
    recipe_stats = None if recipe_heldout is None else _stats(data, np.asarray(recipe_heldout))
    out[RECIPE] = {"dev_metric": recipe_dev}
    if recipe_heldout is not None:
        out[RECIPE]["heldout_metric"] = data.score(np.asarray(recipe_heldout))
    for key, variant in found.items():
        base = variant.recipe
        where = [data.feature_names.index(f) for f in base.features]
        part = replace(data, feature_names=base.features, features=[x[:, where] for x in data.features])
        args = base.tune_args()
        row = {"features": list(base.features), "fixed": base.fixed, "dropped": list(variant.dropped)}
        row["dev_metric"] = tune_weights(part, **args).dev_metric
        if folds and recipe_stats is not None:
            cv = cross_validate(part, k=folds, **args)
            row["heldout_metric"] = cv.heldout_metric
            row["bootstrap"] = metrics.paired_bootstrap_stats(
                data.metric, _stats(part, cv.chosen), recipe_stats, samples, signature=data.signature
            )
        out[key] = row
    return out


def format_lms_added(added: Mapping, metric: str) -> str:
    """The lines ``lm-rescore tune`` prints about ``lms_added``."""
    label = {"wer": "WER", "bleu": "BLEU"}[metric]
    heldout = "heldout_metric" in added[RECIPE]
    which = "held out" if heldout else "on the dev list (in-sample; --cv K for held-out figures and a bootstrap)"
    ours = added[RECIPE]["heldout_metric" if heldout else "dev_metric"]
    lines = [f"what the LMs added ({label} {which}): recipe {ours:.2f}"]
    for key, row in added.items():
        if key in (RECIPE, "protocol"):
            continue
        line = (
            f"  {key} (without {', '.join(row['dropped'])}): {row['heldout_metric' if heldout else 'dev_metric']:.2f}"
        )
        if "bootstrap" in row:
            b = row["bootstrap"]
            line += f", recipe {b['delta']:+.2f}, p = {b['p_value']:.3f} (paired bootstrap)"
        lines.append(line)
    return "\n".join(lines)


def lm_terms_stats(
    nbest: NBestList, setup: Setup, lm_scores, metric: str, has_lm: bool
) -> tuple[list[str], np.ndarray] | None:
    """``lm-rescore nbest``'s view of what the LMs did on this list: the same weights with every LM feature's term
    left out (weight 0, the others unchanged; not a re-tuned system). Per utterance an int64 row: whether the LM
    terms changed its choice, then the metric's statistics of the choice with them and of the one without; with the
    LM features' names. Rows of shards joined give the whole list's (``lm_terms_report``). None when the weights
    read no LM."""
    lm_names = [f for f in setup.features if models_needed(f, setup.definitions, has_lm)]
    if not lm_names or setup.weights is None:
        return None
    matrices = setup.matrices(nbest, lm_scores)
    texts = [[h.text for h in e.hypotheses] for e in nbest]
    refs = references_of(nbest, metric)
    if metric == "wer":
        data = TuningSet.from_wer(nbest.name, setup.features, matrices, refs, texts)
    else:
        data = TuningSet.from_bleu(nbest.name, setup.features, matrices, refs, texts)
    ours = chosen_by(data, setup.weights)
    without = chosen_by(data, {f: 0.0 if f in lm_names else w for f, w in setup.weights.items()})
    rows = np.column_stack([ours != without, _stats(data, ours), _stats(data, without)]).astype(np.int64)
    return lm_names, rows


def lm_terms_report(lm_names: Sequence[str], rows: np.ndarray, metric: str, signature: str, samples: int = 1000):
    """The figures of ``lm_terms_stats``' rows: the metric without the LM terms, the choices they changed, and a
    paired bootstrap of the weights as tuned (B) against the same weights without their LM terms (A)."""
    rows = np.asarray(rows, dtype=np.int64)
    k = (rows.shape[1] - 1) // 2
    ours, without = rows[:, 1 : 1 + k], rows[:, 1 + k :]
    return {
        "about": "the same weights with the LM features' terms at 0 (not re-tuned): what the LM terms changed",
        "lm_features": list(lm_names),
        metric: metrics.corpus_scorer(metric)(without.sum(0)),
        "choices_changed_by_lms": int(rows[:, 0].sum()),
        "bootstrap": metrics.paired_bootstrap_stats(metric, without, ours, samples, signature=signature),
    }
