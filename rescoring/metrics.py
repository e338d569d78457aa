"""Corpus WER and BLEU, oracle choices and paired bootstrap tests for n-best/k-best rescoring.

Thin over jiwer and sacrebleu, so numbers match what others get from the same libraries. Every report carries a
``signature`` (sacrebleu's for BLEU, an equivalent one for WER) so a figure can be reproduced. Text is scored as
given, but for what separates words: any Unicode whitespace (``core.words``, the LMs' definition; the signatures
say ``words:unicode-whitespace``), so jiwer and sacrebleu get each text's words joined by single spaces. WER uses no
text normalisation, BLEU sacrebleu's settings (13a by default).

Per-utterance *sufficient statistics* are the currency shared with tuning and significance tests: corpus metrics are
functions of their sums, so a resampled corpus or a new choice of hypotheses costs a sum, not a re-alignment.

- WER: ``[errors, reference_words]`` per utterance (errors = substitutions + deletions + insertions).
- BLEU: sacrebleu's ``[sys_len, ref_len, correct_1..4, total_1..4]`` per sentence.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from importlib.metadata import version

import jiwer
import numpy as np
import sacrebleu
from sacrebleu.metrics import BLEU

from lmserve.core.words import WORDS, spaced

METRICS = ("wer", "bleu")
HIGHER_IS_BETTER = {"wer": False, "bleu": True}
WER_SIGNATURE = f"wer|{WORDS}|norm:none|jiwer:{version('jiwer')}"
WER_COUNTS = ("substitutions", "deletions", "insertions", "hits")  # per utterance: ``wer_counts``

# -- WER ---------------------------------------------------------------------------------------------------------


def wer_report(references: Sequence[str], hypotheses: Sequence[str]) -> dict:
    """Corpus WER (%) with its error counts.

    Empty hypotheses and empty references are allowed (jiwer >= 4 aligns them; older jiwer refused empty
    references): an empty reference adds its hypothesis' words as insertions. jiwer's own ``wer`` is the insertion
    *count* when no reference has a word, so the rate is computed here from the counts: 0 when nothing is wrong,
    ``inf`` when there are errors but no reference words to divide them by.
    """
    return wer_report_from_counts(wer_counts(references, hypotheses).sum(0), len(references))


def wer_report_from_counts(totals: np.ndarray, sentences: int) -> dict:
    """``wer_report`` from summed ``wer_counts``: what lets the shards of a list be reported as one list."""
    substitutions, deletions, insertions, hits = (int(x) for x in totals)
    ref_words = hits + substitutions + deletions
    errors = substitutions + deletions + insertions
    return {
        "wer": wer_from_stats(np.array([errors, ref_words])),
        "substitutions": substitutions,
        "deletions": deletions,
        "insertions": insertions,
        "hits": hits,
        "reference_words": ref_words,
        "sentences": sentences,
        "signature": WER_SIGNATURE,
    }


def wer_counts(references: Sequence[str], hypotheses: Sequence[str]) -> np.ndarray:
    """Per utterance ``WER_COUNTS`` (int64, shape [n, 4]), from one jiwer alignment of all pairs. jiwer aligns each
    pair on its own and sums, so these rows sum to its corpus counts for any subset of the pairs."""
    _same_length(references, hypotheses)
    if not references:
        return np.zeros((0, 4), dtype=np.int64)
    column = {"substitute": 0, "delete": 1, "insert": 2, "equal": 3}
    rows = []
    for chunks in jiwer.process_words(list(map(spaced, references)), list(map(spaced, hypotheses))).alignments:
        row = [0, 0, 0, 0]
        for c in chunks:
            row[column[c.type]] += (
                c.hyp_end_idx - c.hyp_start_idx if c.type == "insert" else c.ref_end_idx - c.ref_start_idx
            )
        rows.append(row)
    return np.array(rows, dtype=np.int64)


def wer_stats(references: Sequence[str], hypotheses: Sequence[str]) -> np.ndarray:
    """Per utterance ``[errors, reference_words]`` (int64, shape [n, 2]), from one jiwer alignment of all pairs."""
    return errors_and_words(wer_counts(references, hypotheses))


def errors_and_words(counts: np.ndarray) -> np.ndarray:
    """``wer_counts`` rows as ``[errors, reference_words]``, the statistics WER is a function of."""
    substitutions, deletions, insertions, hits = counts.T
    return np.stack([substitutions + deletions + insertions, hits + substitutions + deletions], axis=1)


def wer_from_stats(totals: np.ndarray) -> float:
    """Corpus WER (%) from summed ``[errors, reference_words]`` (see ``wer_report`` for zero reference words)."""
    errors, ref_words = int(totals[0]), int(totals[1])
    if ref_words == 0:
        return 0.0 if errors == 0 else math.inf
    return 100.0 * errors / ref_words


# -- BLEU --------------------------------------------------------------------------------------------------------


def bleu_report(references: Sequence[Sequence[str]], hypotheses: Sequence[str], **bleu_args) -> dict:
    """Corpus BLEU with sacrebleu. ``references`` holds one list per reference set (sacrebleu's layout: with 4
    references, 4 lists of n strings); ``bleu_args`` go to ``sacrebleu.metrics.BLEU`` (tokenize, lowercase, ...)."""
    _check_reference_sets(references, hypotheses)
    bleu = BLEU(**bleu_args)
    score = bleu.corpus_score(list(map(spaced, hypotheses)), [list(map(spaced, r)) for r in references])
    return _report(bleu, score, len(hypotheses))


def _report(bleu: BLEU, score, sentences: int) -> dict:
    return {
        "bleu": score.score,
        "precisions": list(score.precisions),
        "bp": score.bp,
        "sys_len": score.sys_len,
        "ref_len": score.ref_len,
        "sentences": sentences,
        "signature": f"{bleu.get_signature()}|{WORDS}",
    }


def _bleu_from_stats(bleu: BLEU, totals: np.ndarray):
    """sacrebleu's corpus score from summed ``bleu_stats``, with ``bleu``'s smoothing."""
    order = bleu.max_ngram_order
    t = [int(x) for x in totals]
    return BLEU.compute_bleu(
        correct=t[2 : 2 + order],
        total=t[2 + order :],
        sys_len=t[0],
        ref_len=t[1],
        smooth_method=bleu.smooth_method,
        smooth_value=bleu.smooth_value,
        effective_order=bleu.effective_order,
        max_ngram_order=order,
    )


def bleu_report_from_stats(totals: np.ndarray, sentences: int, references: int, **bleu_args) -> dict:
    """``bleu_report`` from summed ``bleu_stats`` of sentences with ``references`` references each (sacrebleu's
    corpus score is the same function of the same sums)."""
    bleu = BLEU(**bleu_args)
    score = _bleu_from_stats(bleu, totals)
    bleu.num_refs = references  # what sacrebleu sets when it reads references, for the signature
    return _report(bleu, score, sentences)


def bleu_stats(references: Sequence[Sequence[str]], hypotheses: Sequence[str], **bleu_args) -> np.ndarray:
    """Per sentence sacrebleu's sufficient statistics (int64, shape [n, 2 + 2 * max_ngram_order]).

    Taken from sacrebleu's public ``sentence_score`` (its counts do not depend on smoothing; effective order is
    switched on only to silence its sentence-level warning), so tokenisation and n-gram clipping are sacrebleu's."""
    _check_reference_sets(references, hypotheses)
    bleu = BLEU(**{**bleu_args, "effective_order": True})
    rows = []
    for i, hyp in enumerate(hypotheses):
        s = bleu.sentence_score(spaced(hyp), [spaced(refs[i]) for refs in references])
        rows.append([s.sys_len, s.ref_len, *s.counts, *s.totals])
    return np.array(rows, dtype=np.int64).reshape(len(hypotheses), 2 + 2 * bleu.max_ngram_order)


def chrf_report(references: Sequence[Sequence[str]], hypotheses: Sequence[str]) -> dict:
    """Corpus chrF (sacrebleu's defaults: character 6-grams, β = 2) with its signature; ``references`` in
    ``bleu_report``'s layout. MT reports give it beside BLEU: it credits a right word with a wrong ending."""
    _check_reference_sets(references, hypotheses)
    chrf = sacrebleu.metrics.CHRF()
    score = chrf.corpus_score(list(hypotheses), [list(r) for r in references])
    return {"chrf": score.score, "sentences": len(hypotheses), "signature": str(chrf.get_signature())}


def corpus_scorer(metric: str, **bleu_args) -> Callable[[np.ndarray], float]:
    """The corpus metric ("wer" or "bleu") as a function of summed per-utterance statistics.

    BLEU goes through sacrebleu's ``BLEU.compute_bleu`` with the smoothing ``BLEU(**bleu_args)`` uses for a corpus.
    """
    if metric == "wer":
        return wer_from_stats
    if metric != "bleu":
        raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
    bleu = BLEU(**bleu_args)
    return lambda totals: _bleu_from_stats(bleu, totals).score


# -- choices -----------------------------------------------------------------------------------------------------


def choose(scores: Sequence[Sequence[float]]) -> np.ndarray:
    """Per utterance the index of the highest score; ties go to the lower rank (the earlier hypothesis)."""
    chosen = np.empty(len(scores), dtype=np.int64)
    for i, s in enumerate(scores):
        if len(s) == 0:
            raise ValueError(f"utterance {i}: no hypotheses to choose from")
        chosen[i] = int(np.argmax(s))
    return chosen


def pick(nbest: Sequence[Sequence[str]], chosen: Sequence[int]) -> list[str]:
    """The chosen hypothesis of every utterance."""
    return [hyps[int(k)] for hyps, k in zip(nbest, chosen, strict=True)]


def oracle_wer(references: Sequence[str], nbest: Sequence[Sequence[str]]) -> np.ndarray:
    """Per utterance the hypothesis with the fewest word errors (ties to the lower rank): the WER lower bound."""
    _same_length(references, nbest)
    flat_refs = [ref for ref, hyps in zip(references, nbest, strict=True) for _ in hyps]
    errors = wer_stats(flat_refs, [h for hyps in nbest for h in hyps])[:, 0]
    return choose(unflatten(-errors, nbest))


def oracle_bleu(
    references: Sequence[Sequence[str]], nbest: Sequence[Sequence[str]], **sentence_bleu_args
) -> np.ndarray:
    """Per sentence the hypothesis with the highest ``sacrebleu.sentence_bleu`` (smoothed, effective order; ties to
    the lower rank). Not the exact corpus-BLEU oracle (that choice is not per sentence), the usual approximation."""
    _check_reference_sets(references, nbest)
    scores = [
        [
            sacrebleu.sentence_bleu(spaced(h), [spaced(refs[i]) for refs in references], **sentence_bleu_args).score
            for h in hyps
        ]
        for i, hyps in enumerate(nbest)
    ]
    return choose(scores)


# -- significance ------------------------------------------------------------------------------------------------


def paired_bootstrap(
    metric: str,
    references: Sequence[str] | Sequence[Sequence[str]],
    sys_a: Sequence[str],
    sys_b: Sequence[str],
    samples: int = 1000,
    seed: int = 0,
    **bleu_args,
) -> dict:
    """Is system B better than system A? Paired bootstrap resampling (Koehn 2004) on the corpus metric.

    ``references`` as for ``wer_report`` (metric "wer") or ``bleu_report`` (metric "bleu").
    """
    if metric == "wer":
        stats_a, stats_b = wer_stats(references, sys_a), wer_stats(references, sys_b)
        signature = WER_SIGNATURE
    elif metric == "bleu":
        stats_a, stats_b = bleu_stats(references, sys_a, **bleu_args), bleu_stats(references, sys_b, **bleu_args)
        signature = bleu_report(references, sys_a, **bleu_args)["signature"]
    else:
        raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
    return paired_bootstrap_stats(metric, stats_a, stats_b, samples, seed, signature=signature, **bleu_args)


def paired_bootstrap_stats(
    metric: str,
    stats_a: np.ndarray,
    stats_b: np.ndarray,
    samples: int = 1000,
    seed: int = 0,
    signature: str | None = None,
    **bleu_args,
) -> dict:
    """``paired_bootstrap`` on per-utterance sufficient statistics (``signature``: the metric's, to which the
    bootstrap's settings are added).

    Each sample draws n utterances with replacement, the same draw for both systems, and recomputes both corpus
    scores from the summed statistics. ``p_value`` is the fraction of samples in which B is *not* better than A
    (a tie counts against B, so identical systems give 1): Koehn's one-sided test of "B is better". ``p_worse`` is
    the fraction in which B is *not* worse (a tie counts against "worse", so identical systems give 1 again): the
    one-sided test of "B is worse than A", e.g. weights carried to a list they were not tuned on against its
    1-best. sacrebleu's ``--paired-bs`` asks a two-sided question instead (Moses' script) and works on strings, hence this version.
    A draw is a row of counts, so the sums of all samples are one matrix product; 1000 samples of 3000 utterances
    take well under a second, mostly sacrebleu's ``compute_bleu`` per sample.
    """
    if stats_a.shape != stats_b.shape or len(stats_a) == 0:
        raise ValueError(f"paired bootstrap: need equal, non-empty statistics, got {stats_a.shape} and {stats_b.shape}")
    score = corpus_scorer(metric, **bleu_args)
    n = len(stats_a)
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, n, size=(samples, n))
    counts = np.bincount((draws + n * np.arange(samples)[:, None]).ravel(), minlength=samples * n)
    counts = counts.reshape(samples, n).astype(np.float64)  # float: the product runs in BLAS, exact below 2**53
    sums_a, sums_b = counts @ stats_a.astype(np.float64), counts @ stats_b.astype(np.float64)
    scores_a = np.array([score(s) for s in sums_a])
    scores_b = np.array([score(s) for s in sums_b])
    b_better = scores_b > scores_a if HIGHER_IS_BETTER[metric] else scores_b < scores_a
    b_worse = scores_b < scores_a if HIGHER_IS_BETTER[metric] else scores_b > scores_a
    a, b = score(stats_a.sum(0)), score(stats_b.sum(0))
    return {
        "metric": metric,
        "a": a,
        "b": b,
        "delta": b - a,
        "delta_ci95": [float(x) for x in np.percentile(scores_b - scores_a, [2.5, 97.5])],
        "p_value": float(1.0 - b_better.mean()),
        "p_worse": float(1.0 - b_worse.mean()),
        "samples": samples,
        "seed": seed,
        **({} if signature is None else {"signature": f"{signature}|bootstrap:{samples}|seed:{seed}"}),
    }


# -- helpers -----------------------------------------------------------------------------------------------------


def _same_length(references: Sequence, hypotheses: Sequence) -> None:
    if len(references) != len(hypotheses):
        raise ValueError(f"{len(references)} references but {len(hypotheses)} hypotheses (or n-best lists)")


def _check_reference_sets(references: Sequence[Sequence[str]], hypotheses: Sequence) -> None:
    """sacrebleu's layout: a list of reference sets, each as long as the hypotheses."""
    if not references or isinstance(references[0], str):
        raise ValueError("references must be a list of reference sets (lists of strings), one per reference")
    for k, refs in enumerate(references):
        if len(refs) != len(hypotheses):
            raise ValueError(f"reference set {k} has {len(refs)} sentences, expected {len(hypotheses)}")


def unflatten(values: np.ndarray, nbest: Sequence[Sequence]) -> list[np.ndarray]:
    """Cut an array with one row per hypothesis of the flattened lists back into per-utterance pieces."""
    return np.split(values, np.cumsum([len(h) for h in nbest])[:-1])
