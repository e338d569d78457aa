"""The features a rescoring weight vector combines, per hypothesis, as one matrix per utterance.

Names a weights file or a command line can use:

- any feature the list carries (``decoder``, ``ctc``, ``lm``, ``score`` for ESPnet; ``lm_0``, ``tm_pt_3``,
  ``WordPenalty``, ``total`` for Joshua; ...). Every hypothesis must have it: a missing score is an error, never a
  silent 0.0 (the best log score there is). Readers fill in what a format defines (Moses lists are sparse: a left-out
  feature is 0) or what ``--feature-default NAME=VALUE`` asks for (``rescoring.nbest.checks``);
- ``neural``: the neural LM's log-probability of the sentence (natural log, words and ``</s>``);
- ``ngram``: the n-gram's, on the same tokens;
- ``interp``: per-word linear interpolation, Σ log(λ·p_neural + (1 − λ)·p_ngram) with the one weight λ;
- ``length``: words in the hypothesis as written; ``oov``: words the LM did not know;
- a *definition*, ``name=0.6*decoder+0.4*ctc``: a fixed linear combination of the above, e.g. ESPnet's acoustic score,
  so that the tuned weight scales the combination as a whole.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import numpy as np

from lmserve.rescoring.lmscores import HypothesisScores, LMSums, concatenated, interpolate, token_sums
from lmserve.rescoring.nbest import NBestList

LM_FEATURES = ("neural", "ngram", "interp", "oov", "length")
NEEDS_LM = LM_FEATURES[:4]
_TERM = re.compile(r"\s*([+-]?)\s*(?:(\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+)\s*\*\s*)?([A-Za-z_][\w.-]*)\s*")


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
    or an LM feature without its LM."""
    carried = set().union(*(h.features for entry in nbest for h in entry.hypotheses))  # (no order needed: a set union)
    used = []
    for name in [*names, *(t for d in definitions.values() for t in d)]:
        if name not in carried and name not in LM_FEATURES and name not in definitions:
            raise ValueError(
                f"{nbest.name or 'n-best list'}: unknown feature {name!r}; the list carries {sorted(carried)}, "
                f"the LMs give {list(LM_FEATURES)}, definitions give {sorted(definitions)}"
            )
        if name in NEEDS_LM and not have_lm_scores:
            raise ValueError(f"feature {name!r} needs LM scores (a neural LM bundle and/or an n-gram)")
        if name in carried and name not in definitions:
            used.append(name)
    for i, entry in enumerate(nbest):
        for k, hyp in enumerate(entry.hypotheses):
            if missing := [name for name in used if name not in hyp.features]:
                where = hyp.origin or f"{nbest.name or 'lists'}[{i}] (id {entry.id!r}).hypotheses[{k}]"
                raise ValueError(
                    f"{where}: no feature {missing[0]!r}, which the weights use and other hypotheses have; "
                    f"expected every hypothesis to carry it (lm-rescore: --feature-default {missing[0]}=VALUE)"
                )
    if ("interp" in names or any("interp" in d for d in definitions.values())) and lam is None:
        raise ValueError("feature 'interp' needs the interpolation weight λ")


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
        columns = _Columns(entry.hypotheses, lm_scores[i] if lm_scores is not None else None, lam)
        matrix = np.empty((len(entry.hypotheses), len(names)), dtype=np.float64)
        for j, name in enumerate(names):
            if name in definitions:
                matrix[:, j] = sum(c * columns.get(term) for term, c in definitions[name].items())
            else:
                matrix[:, j] = columns.get(name)
        matrices.append(matrix)
    return matrices


class _Columns:
    """The base features of one list's hypotheses, each computed once, as a vector over the hypotheses."""

    def __init__(self, hypotheses, scores: Sequence[HypothesisScores] | LMSums | None, lam: float | None):
        self.hypotheses = hypotheses
        self.scores = scores
        self.lam = lam
        self.cache: dict[str, np.ndarray] = {}
        self.tokens: dict[str, tuple[np.ndarray | None, np.ndarray]] = {}

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
            return token_sums(flat, lengths)
        if name == "interp":
            (neural, lengths), (ngram, _) = self._tokens("neural"), self._tokens("ngram")
            return token_sums(interpolate(neural, ngram, self.lam), lengths)
        if name == "length":
            return np.array([len(h.text.split()) for h in self.hypotheses], dtype=np.float64)
        if name == "oov":
            return np.array([s.oov for s in self.scores], dtype=np.float64)
        return np.array([h.features[name] for h in self.hypotheses], dtype=np.float64)  # check_features: all have it

    def _tokens(self, name: str) -> tuple[np.ndarray | None, np.ndarray]:
        """Every hypothesis' token scores under one LM, concatenated (None without that LM), and their counts."""
        if name not in self.tokens:
            arrays = [getattr(s, name) for s in self.scores]
            lengths = np.array([0 if a is None else len(a) for a in arrays], dtype=np.int64)
            self.tokens[name] = (concatenated(arrays), lengths)
        return self.tokens[name]
