"""The features a rescoring weight vector combines, per hypothesis, as one matrix per utterance.

Names a weights file or a command line can use:

- any feature the list carries (``decoder``, ``ctc``, ``lm``, ``score`` for ESPnet; ``lm_0``, ``tm_pt_3``,
  ``WordPenalty``, ``total`` for Joshua; ...). Every hypothesis must have it: a missing score is an error, never a
  silent 0.0 (the best log score there is). Readers fill in what a format defines (Moses lists are sparse: a left-out
  feature is 0) or what ``--feature-default NAME=VALUE`` asks for (``rescoring.nbest.checks``);
- ``neural``: the neural LM's log-probability of the sentence (natural log, words and ``</s>``);
- ``neural_NAME``: the sentence score of another neural LM that the list carries as a feature (``lm-rescore
  annotate`` writes it: a backward LM, a second forward one): read from the list like any feature it carries, and
  the neural LM's as far as ``evaluate``'s baselines go (``n-gram only`` and ``no LM`` leave it out);
- ``ngram``: the n-gram's, on the same tokens, but words the n-gram knows and the neural LM does not as they are
  (``rescoring.lmscores``: ``ngram_own``);
- ``interp``: per-word linear interpolation, Σ log(λ·p_neural + (1 − λ)·p_ngram) with the one weight λ;
- ``length``: words in the hypothesis as written;
- ``oov_lm``: words outside the neural LM bundle's vocabulary (scored as ``<unk>``, or spelled by an open-vocabulary
  bundle); ``oov_ngram``: words outside the n-gram's vocabulary (the words as normalised, before the bundle's
  vocabulary maps any to ``<unk>``). Each needs its LM. ``oov`` is an alias kept for weights files written before the
  two were told apart: ``oov_lm`` when a bundle is given, else ``oov_ngram`` (so it counts another feature when the
  bundle is left out: name the one meant);
- from the list itself, no LM (these names are computed even where a list carries a feature of the same name, as
  ``length`` is): ``rank``, the first pass's 1-based rank (``Hypothesis.rank``, else the position in the list);
  ``chars``, characters without whitespace; ``nonword``, words as written with no letter or digit (a recogniser's
  stray ``.`` or ``..``: no reference of a spoken-word transcript has them, and the LMs cannot see them, since
  text normalisation drops punctuation before scoring); ``src_ratio``, words over the words of the entry's source
  sentence (MT; ``NBestEntry.source``, an empty source counting as one word; a Chinese or Japanese character is a
  source word of its own: ``core.words.source_length``);
- ``consensus_bleu``, ``consensus_chrf``, ``consensus_wer``: minimum-Bayes-risk agreement of each hypothesis with
  the others of its list, uniformly weighted (``rescoring.consensus``: sentence BLEU, chrF, 1 − WER);
  ``consensus_chrf@score`` weights the others by the first pass's posterior, the softmax of feature ``score`` over
  the list, and ``consensus_chrf@0.5*score`` by that of 0.5·score (any feature or definition of the list, scale > 0;
  a cost, lower is better, goes through a definition: ``first=-1*cost``). A hypothesis carrying ``votes`` stands for
  that many outputs (MT lists of system outputs, deduplicated); without it, for one;
- a *definition*, ``name=0.6*decoder+0.4*ctc``: a fixed linear combination of the above, e.g. ESPnet's acoustic score,
  so that the tuned weight scales the combination as a whole.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from lmserve.core.command import clip
from lmserve.core.words import source_length
from lmserve.rescoring import consensus
from lmserve.rescoring.lmscores import HypothesisScores, LMSums, concatenated, interpolate, ngram_feature, token_sums
from lmserve.rescoring.nbest import NBestEntry, NBestList

LM_FEATURES = ("neural", "ngram", "interp", "oov", "oov_lm", "oov_ngram", "length")
ANNOTATED = "neural_"  # the prefix of the neural LM scores a list carries (lm-rescore annotate)
NEEDS_LM = LM_FEATURES[:6]
# which LMs each LM feature needs: "lm" (the neural bundle), "ngram"; ``oov`` is the alias (module docstring)
NEEDS = {"neural": ("lm",), "ngram": ("ngram",), "interp": ("lm", "ngram"), "oov_lm": ("lm",), "oov_ngram": ("ngram",)}


def models_needed(name: str, definitions: Mapping[str, Mapping[str, float]], has_lm: bool) -> set[str]:
    """The LMs feature ``name`` reads ("lm": the neural bundle, "ngram"), through a definition's terms and a
    consensus feature's weighting too; ``oov`` reads the bundle's vocabulary when ``has_lm``, else the n-gram's."""
    if name in definitions:
        return set().union(*(models_needed(term, {}, has_lm) for term in definitions[name]))
    if name == "oov":
        return {"lm" if has_lm else "ngram"}
    spec = parse_consensus(name)
    if spec is not None and spec.weighting is not None:
        return models_needed(spec.weighting, definitions, has_lm)
    return set(NEEDS.get(name, ()))


def check_models(names: Sequence[str], definitions: Mapping[str, Mapping[str, float]], has_lm: bool, has_ngram: bool):
    """Before any model runs: every LM feature among ``names`` has its LM."""
    given = {"lm"} if has_lm else set()
    given |= {"ngram"} if has_ngram else set()
    flags = {"lm": "a neural LM bundle (--lm)", "ngram": "an n-gram (--ngram)"}
    for name in names:
        missing = sorted(models_needed(name, definitions, has_lm) - given)
        if missing and (has_lm or has_ngram):
            raise ValueError(f"feature {name!r} needs {' and '.join(flags[m] for m in missing)}")


LIST_FEATURES = ("rank", "chars", "nonword", "src_ratio")
VOTES = "votes"  # the feature that says how many outputs a hypothesis stands for (consensus weights)
_NUMBER = r"(?:\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+)"
_NAME = r"[A-Za-z_][\w.-]*"
_CONSENSUS = re.compile(rf"consensus_({'|'.join(consensus.KINDS)})(?:@(?:({_NUMBER})\*)?({_NAME}))?")
_TERM = re.compile(rf"\s*([+-]?)\s*(?:({_NUMBER})\s*\*\s*)?({_NAME}(?:@(?:{_NUMBER}\*)?{_NAME})?)\s*")
CONSENSUS_SYNTAX = f"consensus_KIND or consensus_KIND@[SCALE*]FEATURE, KIND one of {', '.join(consensus.KINDS)}"


@dataclass(frozen=True)
class Consensus:
    """A consensus feature's name, read: ``consensus_chrf@0.5*score`` -> ``Consensus("chrf", "score", 0.5)``."""

    kind: str
    weighting: str | None = None  # the feature whose softmax (times ``scale``) weights the other hypotheses
    scale: float = 1.0


def parse_consensus(name: str) -> Consensus | None:
    """The consensus feature ``name`` asks for, None when it is not one (a ValueError for a scale of 0)."""
    match = _CONSENSUS.fullmatch(name)
    if match is None:
        return None
    kind, scale, weighting = match.groups()
    if scale is not None and not float(scale) > 0:
        raise ValueError(f"feature {name!r}: the scale of the posterior must be > 0, got {scale}")
    return Consensus(kind, weighting, 1.0 if scale is None else float(scale))


def parse_definition(text: str) -> tuple[str, dict[str, float]]:
    """``"am=0.6*decoder+0.4*ctc"`` -> ``("am", {"decoder": 0.6, "ctc": 0.4})``."""
    name, sep, expression = text.partition("=")
    name = name.strip()
    if not sep or not re.fullmatch(r"[A-Za-z_][\w.-]*", name):
        raise ValueError(f"feature definition {text!r}: expected NAME=EXPRESSION, e.g. am=0.6*decoder+0.4*ctc")
    terms: dict[str, float] = {}
    position = 0
    while position < len(expression):
        match = _TERM.match(expression, position)
        if not match or match.end() == position or (terms and not match.group(1)):
            raise ValueError(
                f"feature definition {text!r}: cannot read {expression[position:]!r}; "
                "expected terms like 0.6*decoder joined by + or -"
            )
        sign = -1.0 if match.group(1) == "-" else 1.0
        coefficient = float(match.group(2)) if match.group(2) else 1.0
        terms[match.group(3)] = terms.get(match.group(3), 0.0) + sign * coefficient
        position = match.end()
    if not terms:
        raise ValueError(f"feature definition {text!r}: the expression is empty")
    return name, terms


def check_features(
    nbest: NBestList,
    names: Sequence[str],
    definitions: Mapping[str, Mapping[str, float]],
    lam: float | None,
    have_lm_scores: bool,
) -> None:
    """Fail early, before any model runs, on a name nothing provides, a hypothesis without a feature the weights use,
    an LM feature without its LM, or a list feature without what it is computed from (a source, votes)."""
    carried = set().union(*(h.features for entry in nbest for h in entry.hypotheses))  # (no order needed: a set union)
    wanted = [*names, *(t for d in definitions.values() for t in d)]
    used, uses_consensus = [], False
    for name in wanted:  # (grows: a consensus feature wants the feature it is weighted by, checked in turn)
        spec = None if name in definitions else parse_consensus(name)
        uses_consensus |= spec is not None
        if spec is not None and spec.weighting is not None:
            wanted += _weighting(name, spec.weighting, carried, definitions)
        elif spec is None and not _known(name, carried, definitions):
            if name.startswith("consensus_") or "@" in name:
                raise ValueError(f"feature {name!r}: expected {CONSENSUS_SYNTAX}, e.g. consensus_chrf@0.5*score")
            raise ValueError(
                f"{nbest.name or 'n-best list'}: unknown feature {clip(name)}; the list carries {_names(carried)}, "
                f"the LMs give {list(LM_FEATURES)}, the list itself {[*LIST_FEATURES, CONSENSUS_SYNTAX]}, "
                f"definitions give {sorted(definitions)}"
            )
        if name in NEEDS_LM and not have_lm_scores:
            raise ValueError(f"feature {name!r} needs LM scores (a neural LM bundle and/or an n-gram)")
        computed = name in definitions or name in LM_FEATURES or name in LIST_FEATURES or spec is not None
        if name in carried and not computed:
            used.append(name)
    for i, entry in enumerate(nbest):
        where = f"{nbest.name or 'lists'}[{i}] (id {clip(entry.id)})"
        if "src_ratio" in wanted and entry.source is None:
            raise ValueError(
                f"{entry.origin or where}: feature 'src_ratio' needs the source sentence (NBestEntry.source, the "
                "jsonl field 'source'); this entry has none"
            )
        for k, hyp in enumerate(entry.hypotheses):
            if missing := [name for name in used if name not in hyp.features]:
                raise ValueError(
                    f"{hyp.origin or f'{where}.hypotheses[{k}]'}: no feature {clip(missing[0])}, which the weights use "
                    f"and other hypotheses have; expected every hypothesis to carry it (lm-rescore: "
                    f"--feature-default {missing[0]}=VALUE)"
                )
            if uses_consensus and not hyp.features.get(VOTES, 1.0) >= 1:
                raise ValueError(
                    f"{hyp.origin or f'{where}.hypotheses[{k}]'}: feature {VOTES!r} = {hyp.features[VOTES]}; "
                    "expected a count >= 1 (the outputs this hypothesis stands for)"
                )
    if "interp" in wanted and lam is None:
        raise ValueError("feature 'interp' needs the interpolation weight λ")


def _names(names: set[str], most: int = 20) -> str:
    """The features a list carries, as a message lists them: clipped, and at most ``most`` of them."""
    shown = [clip(name) for name in sorted(names)[:most]]
    return "[" + ", ".join(shown) + (f", ... ({len(names)} in all)" if len(names) > most else "") + "]"


def _known(name: str, carried: set[str], definitions: Mapping[str, Mapping[str, float]]) -> bool:
    return name in carried or name in LM_FEATURES or name in LIST_FEATURES or name in definitions


def _weighting(
    name: str, weighting: str, carried: set[str], definitions: Mapping[str, Mapping[str, float]]
) -> list[str]:
    """The names consensus feature ``name`` is computed from (its weighting feature and, for a definition, its
    terms), once they are known and none of them is a consensus feature (a posterior cannot need itself)."""
    needs = [weighting, *definitions.get(weighting, ())]
    if any(parse_consensus(n) for n in needs if n not in definitions):
        raise ValueError(f"feature {name!r}: a consensus feature cannot be weighted by consensus ({weighting!r})")
    if not _known(weighting, carried, definitions):
        raise ValueError(
            f"feature {clip(name)}: no feature {clip(weighting)} to weight by; the list carries {_names(carried)}, "
            f"the LMs give {list(LM_FEATURES)}, the list itself {list(LIST_FEATURES)}, "
            f"definitions give {sorted(definitions)}"
        )
    return needs


def feature_matrices(
    nbest: NBestList,
    names: Sequence[str],
    lm_scores: Sequence[Sequence[HypothesisScores] | LMSums] | None = None,
    definitions: Mapping[str, Mapping[str, float]] | None = None,
    lam: float | None = None,
) -> list[np.ndarray]:
    """Per utterance a float64 matrix [hypotheses, len(names)], built a column at a time. A list's LM scores are its
    hypotheses' token scores, whose LM features are sums over one concatenation of them (a server call reranked a
    30-best list in a fifth of the time it took hypothesis by hypothesis), or those sums already taken
    (:class:`~rescoring.lmscores.LMSums`, interp at ``lam``)."""
    definitions = dict(definitions or {})
    check_features(nbest, names, definitions, lam, lm_scores is not None)
    matrices = []
    for i, entry in enumerate(nbest):
        columns = _Columns(entry, lm_scores[i] if lm_scores is not None else None, lam, definitions)
        matrix = np.empty((len(entry.hypotheses), len(names)), dtype=np.float64)
        for j, name in enumerate(names):
            matrix[:, j] = columns.feature(name)
        matrices.append(matrix)
    return matrices


class _Columns:
    """The base features of one list's hypotheses, each computed once, as a vector over the hypotheses."""

    def __init__(
        self,
        entry: NBestEntry,
        scores: Sequence[HypothesisScores] | LMSums | None,
        lam: float | None,
        definitions: Mapping[str, Mapping[str, float]],
    ):
        self.entry = entry
        self.hypotheses = entry.hypotheses
        self.scores = scores
        self.lam = lam
        self.definitions = definitions
        self.cache: dict[str, np.ndarray] = {}
        self.tokens: dict[str, tuple[np.ndarray | None, np.ndarray]] = {}
        self.similarities: dict[str, np.ndarray] = {}  # per consensus kind, shared by its weightings

    def feature(self, name: str) -> np.ndarray:
        """A definition's combination of base features, or the base feature ``name``."""
        if name in self.definitions:
            return sum(c * self.get(term) for term, c in self.definitions[name].items())
        return self.get(name)

    def get(self, name: str) -> np.ndarray:
        column = self.cache.get(name)
        if column is None:
            column = self.cache[name] = self._compute(name)
        return column

    def _compute(self, name: str) -> np.ndarray:
        if isinstance(self.scores, LMSums) and name in NEEDS_LM:
            return self.scores.column(name, self.lam)
        if name in ("neural", "ngram"):
            flat, lengths = self._tokens(name)
            if flat is None:
                raise ValueError(f"feature {name!r}: that LM was not given")
            sums = token_sums(flat, lengths)
            return ngram_feature(sums, self.scores) if name == "ngram" else sums
        if name == "interp":
            (neural, lengths), (ngram, _) = self._tokens("neural"), self._tokens("ngram")
            return token_sums(interpolate(neural, ngram, self.lam), lengths)
        if name == "length":
            return np.array([len(h.text.split()) for h in self.hypotheses], dtype=np.float64)
        if name == "oov":
            return np.array([s.oov for s in self.scores], dtype=np.float64)
        if name in ("oov_lm", "oov_ngram"):
            counts = [getattr(s, name) for s in self.scores]
            if any(c is None for c in counts):
                raise ValueError(
                    f"feature {name!r}: no {'neural LM bundle' if name == 'oov_lm' else 'n-gram'} scored these lists"
                    + ("" if name == "oov_lm" else " (or its score cache predates oov_ngram: delete the cache)")
                )
            return np.array(counts, dtype=np.float64)
        if name == "rank":
            return np.array([k + 1 if h.rank is None else h.rank for k, h in enumerate(self.hypotheses)], np.float64)
        if name == "chars":
            return np.array([len("".join(h.text.split())) for h in self.hypotheses], dtype=np.float64)
        if name == "nonword":
            return np.array(
                [sum(not any(c.isalnum() for c in w) for w in h.text.split()) for h in self.hypotheses], np.float64
            )
        if name == "src_ratio":  # check_features: the entry has a source
            return self.get("length") / max(source_length(self.entry.source), 1)
        if (spec := parse_consensus(name)) is not None:
            return self._consensus(name, spec)
        return np.array([h.features[name] for h in self.hypotheses], dtype=np.float64)  # check_features: all have it

    def _consensus(self, name: str, spec: Consensus) -> np.ndarray:
        if spec.kind not in self.similarities:
            texts = [h.text for h in self.hypotheses]
            self.similarities[spec.kind] = consensus.similarity_matrix(texts, spec.kind)
        log_weights = None
        if spec.weighting is not None:
            log_weights = spec.scale * self.feature(spec.weighting)
            if not np.all(np.isfinite(log_weights)):
                raise ValueError(
                    f"list {clip(self.entry.id)}: feature {name!r}: {spec.weighting!r} has values that are not finite "
                    f"({log_weights[~np.isfinite(log_weights)][0] / spec.scale}); expected finite scores to weight by"
                )
        votes = [h.features.get(VOTES, 1.0) for h in self.hypotheses]
        return consensus.expected_similarity(self.similarities[spec.kind], log_weights, votes)

    def _tokens(self, name: str) -> tuple[np.ndarray | None, np.ndarray]:
        """Every hypothesis' token scores under one LM, concatenated (None without that LM), and their counts."""
        if name not in self.tokens:
            arrays = [getattr(s, name) for s in self.scores]
            lengths = np.array([0 if a is None else len(a) for a in arrays], dtype=np.int64)
            self.tokens[name] = (concatenated(arrays), lengths)
        return self.tokens[name]
