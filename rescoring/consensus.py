"""Minimum-Bayes-risk consensus: how much each candidate of one list agrees with the rest of the list.

A candidate that many others resemble is the likelier translation or transcript, whatever its own score says (MBR
decoding, system combination): rerankers use that agreement as a feature beside the LMs.

**Definition.** Candidate i of a list stands for ``votes`` v_i outputs (1 in ASR lists, whose repeated strings are
separate candidates; the number of systems that wrote the string in a deduplicated MT list of system outputs), each
output with weight p_i ∝ exp(log_weight_i) (the first pass's posterior, softmax of scale · score, or uniform). Its
consensus is the expected similarity of one of its outputs to the *other* outputs of the list::

    C_i = Σ_j W_ij · sim(i, j) / Σ_j W_ij,   W_ij = v_j · p_j for j ≠ i,   W_ii = (v_i − 1) · p_i

With every v = 1 that is Σ_{j≠i} p_j sim(i, j) / Σ_{j≠i} p_j; a deduplicated list with votes gets exactly the values
its expansion into repeated strings gets. The softmax's normaliser cancels in the ratio, so weights are taken in the
log domain and shifted per row (no underflow, however far apart the scores). A candidate with no other output (a
list of one output) has consensus 0.

**Similarities** ``sim(i, j)``: candidate i scored as a hypothesis against candidate j as its reference, in [0, 1].
Words are ``str.split()`` (any Unicode whitespace).

- ``bleu``: sacrebleu's ``sentence_bleu`` / 100 with its defaults (4-grams, "exp" smoothing, effective order) and
  ``tokenize="none"``: text is split on whitespace only, not by the 13a tokeniser (which also splits punctuation);
- ``chrf``: sacrebleu's ``sentence_chrf`` / 100 with its defaults: character n-grams up to 6 with whitespace
  removed, β = 2, no word n-grams, the average taken over the orders both sides have (not eps-smoothed);
- ``wer``: 1 − WER with j as the reference, max(0, 1 − word edit distance / words of j); an empty reference gives 1
  to an empty hypothesis and 0 to any other.

Clipped n-gram matches for a whole list come from count matrices [candidates, n-grams]: for the n-grams no candidate
repeats, min(a, b) = a·b, so the matches of every pair are one matrix product per order; the few repeated ones
are compared pair by pair. Edit distances come from rapidfuzz (jiwer's own engine), words
mapped to characters as jiwer does.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from rapidfuzz.distance import Levenshtein
from rapidfuzz.process import cdist

KINDS = ("bleu", "chrf", "wer")
BLEU_ORDER = 4
CHRF_ORDER = 6
CHRF_BETA = 2.0


def consensus(
    texts: Sequence[str],
    kind: str,
    log_weights: Sequence[float] | None = None,
    votes: Sequence[float] | None = None,
) -> np.ndarray:
    """Per candidate its consensus C_i (float64, shape [n]); ``log_weights``: unnormalised log posteriors (None:
    uniform); ``votes``: outputs per candidate (None: 1 each)."""
    return expected_similarity(similarity_matrix(texts, kind), log_weights, votes)


def similarity_matrix(texts: Sequence[str], kind: str) -> np.ndarray:
    """``[i, j]`` = sim(candidate i as hypothesis, candidate j as reference), float64 [n, n] in [0, 1]."""
    if kind == "bleu":
        words = [t.split() for t in texts]
        lengths = np.array([len(w) for w in words], dtype=np.int64)
        vocabulary: dict[str, int] = {}
        ids = np.array([vocabulary.setdefault(w, len(vocabulary)) for ws in words for w in ws], dtype=np.int64)
        matches, counts = _clipped_matches(ids, lengths, BLEU_ORDER)
        return _bleu(matches, counts, lengths)
    if kind == "chrf":
        chars = ["".join(t.split()) for t in texts]
        lengths = np.array([len(c) for c in chars], dtype=np.int64)
        code_points = np.frombuffer("".join(chars).encode("utf-32-le"), dtype=np.uint32)
        ids = np.unique(code_points, return_inverse=True)[1].astype(np.int64)
        matches, counts = _clipped_matches(ids, lengths, CHRF_ORDER)
        return _chrf(matches, counts)
    if kind == "wer":
        return _word_agreement(texts)
    raise ValueError(f"consensus kind {kind!r}: expected one of {', '.join(KINDS)}")


def expected_similarity(
    sim: np.ndarray, log_weights: Sequence[float] | None = None, votes: Sequence[float] | None = None
) -> np.ndarray:
    """C_i from a similarity matrix (the module docstring's definition)."""
    n = len(sim)
    log_w = np.zeros(n) if log_weights is None else np.asarray(log_weights, dtype=np.float64)
    v = np.ones(n) if votes is None else np.asarray(votes, dtype=np.float64)
    if log_w.shape != (n,) or v.shape != (n,):
        raise ValueError(f"{n} candidates but {log_w.shape} log weights and {v.shape} votes; expected one each")
    if not np.all(np.isfinite(log_w)):
        raise ValueError(f"log weights must be finite, got {log_w[~np.isfinite(log_w)][0]}")
    if not np.all(v >= 1):  # (also refuses NaN)
        raise ValueError(f"votes must be counts >= 1 (the outputs a candidate stands for), got {v[~(v >= 1)][0]}")
    with np.errstate(divide="ignore"):
        logs = np.broadcast_to(log_w + np.log(v), (n, n)).copy()
        np.fill_diagonal(logs, log_w + np.log(v - 1))  # the other outputs of the same string; -inf for none
    top = logs.max(axis=1, keepdims=True)
    top[~np.isfinite(top)] = 0.0  # a row with no other output: all weights 0, consensus 0
    w = np.exp(logs - top)
    total = w.sum(axis=1)
    return np.divide((w * sim).sum(axis=1), total, out=np.zeros(n), where=total > 0)


def _clipped_matches(ids: np.ndarray, lengths: np.ndarray, max_order: int) -> tuple[np.ndarray, np.ndarray]:
    """For the candidates' token ids (dense: 0 to V − 1), concatenated (``lengths`` each): per order o = 1..max_order the clipped
    matches Σ_g min(count_i(g), count_j(g)) of every pair, int64 [max_order, n, n], and every candidate's number of
    o-grams, int64 [max_order, n]."""
    n = len(lengths)
    owner = np.repeat(np.arange(n), lengths)
    room = np.repeat(np.cumsum(lengths), lengths) - np.arange(len(ids))  # tokens from each position to its end
    base = int(ids.max(initial=0)) + 1
    matches = np.zeros((max_order, n, n), dtype=np.int64)
    counts = np.zeros((max_order, n), dtype=np.int64)
    grams = ids
    for o in range(1, max_order + 1):
        if o > 1:  # an o-gram: the dense id of (its (o-1)-gram prefix, its last token); never overflows int64
            grams = np.unique(grams[:-1] * base + ids[o - 1 :], return_inverse=True)[1]
        valid = room[: len(grams)] >= o  # o-grams that would run into the next candidate are left out
        g, who = grams[valid], owner[: len(grams)][valid]
        width = int(g.max(initial=0)) + 1
        table = np.bincount(who * width + g, minlength=n * width).reshape(n, width)
        counts[o - 1] = table.sum(axis=1)
        repeated = table.max(axis=0) > 1
        once = table[:, ~repeated].astype(np.float64)  # 0/1: min is the product, one matrix product for all
        many = table[:, repeated]  # the few n-grams some candidate repeats: min taken pair by pair
        matches[o - 1] = np.rint(once @ once.T).astype(np.int64)
        matches[o - 1] += np.minimum(many[:, None, :], many[None, :, :]).sum(axis=2)
    return matches, counts


def _bleu(matches: np.ndarray, counts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """sacrebleu's ``BLEU.compute_bleu`` (smooth "exp", effective order) / 100, for every (hypothesis i, reference
    j): an order without matches gets precision 1 / (2^k · total), k counting such orders so far; the mean log
    precision runs over the orders the hypothesis has; no match at all gives 0."""
    order = np.arange(1, len(matches) + 1)[:, None, None]
    used = order <= lengths[None, :, None]  # effective order: min(length, 4)
    missed = np.cumsum((matches == 0) & used, axis=0)
    totals = np.maximum(counts, 1)[:, :, None]
    with np.errstate(divide="ignore"):
        log_p = np.where(matches > 0, np.log(matches / totals), -missed * np.log(2.0) - np.log(totals))
    effective = np.minimum(lengths, len(matches))[:, None]
    mean = np.where(used, log_p, 0.0).sum(axis=0) / np.maximum(effective, 1)
    hyp, ref = lengths[:, None].astype(np.float64), lengths[None, :].astype(np.float64)
    brevity = np.where(hyp >= ref, 1.0, np.exp(1.0 - ref / np.maximum(hyp, 1.0)))
    return np.where(matches.sum(axis=0) > 0, brevity * np.exp(mean), 0.0)


def _chrf(matches: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """sacrebleu's ``CHRF._compute_f_score`` (β = 2, not eps-smoothed) / 100, for every (hypothesis i, reference j):
    precision and recall averaged over the orders both have n-grams of, then their F_β."""
    hyp, ref = counts[:, :, None], counts[:, None, :]
    both = (hyp > 0) & (ref > 0)
    orders = np.maximum(both.sum(axis=0), 1)
    precision = np.where(both, matches / np.maximum(hyp, 1), 0.0).sum(axis=0) / orders
    recall = np.where(both, matches / np.maximum(ref, 1), 0.0).sum(axis=0) / orders
    factor = CHRF_BETA**2
    denominator = factor * precision + recall
    f = (1 + factor) * precision * recall
    return np.divide(f, denominator, out=np.zeros_like(f), where=denominator > 0)


def _word_agreement(texts: Sequence[str]) -> np.ndarray:
    """max(0, 1 − WER(hypothesis i, reference j)) from word edit distances: each distinct word of the list becomes
    one character (above the surrogates where there are that many), and rapidfuzz aligns the strings."""
    vocabulary: dict[str, str] = {}
    encoded = []
    for text in texts:
        letters = []
        for word in text.split():
            letter = vocabulary.get(word)
            if letter is None:
                k = len(vocabulary)
                letter = vocabulary[word] = chr(k if k < 0xD800 else k + 0x800)
            letters.append(letter)
        encoded.append("".join(letters))
    distance = cdist(encoded, encoded, scorer=Levenshtein.distance, dtype=np.int64)
    lengths = np.array([len(e) for e in encoded], dtype=np.float64)
    ref = np.broadcast_to(lengths[None, :], distance.shape)
    agreement = np.divide(distance, ref, out=np.where(distance == 0, 0.0, 1.0), where=ref > 0)
    return np.maximum(0.0, 1.0 - agreement)
