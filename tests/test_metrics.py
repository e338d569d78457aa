import math
import time

import jiwer
import numpy as np
import pytest
import sacrebleu

from lmserve.rescoring import metrics

WORDS = "the a cat dog sat on mat ran far away big small red".split()


def sentences(n: int, seed: int, max_len: int = 12) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(1, max_len)))) for _ in range(n)]


def corrupt(sentence: str, rng: np.random.Generator, rate: float) -> str:
    """Substitute, drop or double words at the given rate: hypotheses with known-ish error levels."""
    out = []
    for w in sentence.split():
        r = rng.random()
        if r < rate / 3:
            out.append(str(rng.choice(WORDS)))
        elif r < 2 * rate / 3:
            continue
        elif r < rate:
            out += [w, w]
        else:
            out.append(w)
    return " ".join(out)


def nbest_lists(refs: list[str], n: int, seed: int) -> list[list[str]]:
    rng = np.random.default_rng(seed)
    return [[corrupt(r, rng, 0.4) for _ in range(n)] for r in refs]


def test_wer_report_agrees_with_jiwer():
    refs = sentences(50, 1)
    hyps = [corrupt(r, np.random.default_rng(i), 0.3) for i, r in enumerate(refs)]
    hyps[3] = ""  # empty hypotheses are fine
    report = metrics.wer_report(refs, hyps)
    out = jiwer.process_words(refs, hyps)
    assert report["wer"] == pytest.approx(100 * jiwer.wer(refs, hyps))
    assert (report["substitutions"], report["deletions"], report["insertions"], report["hits"]) == (
        out.substitutions,
        out.deletions,
        out.insertions,
        out.hits,
    )
    assert report["reference_words"] == sum(len(r.split()) for r in refs)
    assert report["signature"].startswith("wer|")


def test_wer_with_empty_references():
    report = metrics.wer_report(["", "a b"], ["x y", "a b"])
    assert (report["insertions"], report["reference_words"], report["wer"]) == (2, 2, 100.0)
    assert metrics.wer_report([""], [""])["wer"] == 0.0
    assert metrics.wer_report(["", ""], ["x", ""])["wer"] == math.inf  # errors but nothing to divide by
    assert metrics.wer_report([], [])["wer"] == 0.0
    with pytest.raises(ValueError, match="2 references but 1"):
        metrics.wer_report(["a", "b"], ["a"])


def test_wer_stats_are_per_utterance_jiwer_counts():
    refs = sentences(30, 2) + [""]
    hyps = [corrupt(r, np.random.default_rng(i), 0.5) for i, r in enumerate(refs[:-1])] + ["extra words"]
    stats = metrics.wer_stats(refs, hyps)
    for (errors, n), r, h in zip(stats, refs, hyps, strict=True):
        out = jiwer.process_words([r], [h])
        assert errors == out.substitutions + out.deletions + out.insertions
        assert n == len(r.split())
    assert metrics.wer_from_stats(stats.sum(0)) == pytest.approx(metrics.wer_report(refs, hyps)["wer"])


def test_bleu_report_agrees_with_sacrebleu():
    refs = [sentences(40, 3), sentences(40, 4)]
    hyps = [corrupt(r, np.random.default_rng(i), 0.3) for i, r in enumerate(refs[0])]
    for args in ({}, {"tokenize": "none"}, {"lowercase": True}):
        report = metrics.bleu_report(refs, hyps, **args)
        expected = sacrebleu.corpus_bleu(hyps, refs, **args)
        assert report["bleu"] == pytest.approx(expected.score)
        assert report["precisions"] == pytest.approx(expected.precisions)
        assert report["bp"] == pytest.approx(expected.bp)
    assert metrics.bleu_report(refs, hyps)["signature"].startswith("nrefs:2|case:mixed|eff:no|tok:13a|smooth:exp")


def test_bleu_stats_sum_to_the_corpus_score():
    refs = [sentences(40, 5), sentences(40, 6), sentences(40, 7)]
    hyps = [corrupt(r, np.random.default_rng(i), 0.3) for i, r in enumerate(refs[1])]
    hyps[0] = ""
    stats = metrics.bleu_stats(refs, hyps)
    assert stats.shape == (40, 10)
    assert metrics.corpus_scorer("bleu")(stats.sum(0)) == pytest.approx(metrics.bleu_report(refs, hyps)["bleu"])
    with pytest.raises(ValueError, match="reference sets"):
        metrics.bleu_report(refs[0], hyps)
    with pytest.raises(ValueError, match="reference set 1 has 39"):
        metrics.bleu_report([refs[0], refs[1][:-1]], hyps)


def test_choose_breaks_ties_to_the_lower_rank():
    assert metrics.choose([[1, 3, 3], [0.5], [-2, -1, -1]]).tolist() == [1, 0, 1]
    with pytest.raises(ValueError, match="utterance 1"):
        metrics.choose([[1], []])


def test_oracle_wer_is_at_most_one_best():
    refs = sentences(60, 8)
    nbest = nbest_lists(refs, 8, 9)
    oracle = metrics.oracle_wer(refs, nbest)
    one_best = metrics.wer_report(refs, [h[0] for h in nbest])["wer"]
    oracle_wer = metrics.wer_report(refs, metrics.pick(nbest, oracle))["wer"]
    assert oracle_wer < one_best
    for ref, hyps, k in zip(refs, nbest, oracle, strict=True):
        errors = [metrics.wer_stats([ref], [h])[0, 0] for h in hyps]
        assert k == int(np.argmin(errors))  # fewest errors, first of equals
    assert metrics.oracle_wer(["a b"], [["a c", "a c", "a b", "a b"]]).tolist() == [2]


def test_oracle_bleu_picks_the_best_sentence_bleu():
    refs = [sentences(40, 10), sentences(40, 11)]
    nbest = nbest_lists(refs[0], 6, 12)
    oracle = metrics.oracle_bleu(refs, nbest)
    for i, (hyps, k) in enumerate(zip(nbest, oracle, strict=True)):
        scores = [sacrebleu.sentence_bleu(h, [refs[0][i], refs[1][i]]).score for h in hyps]
        assert k == int(np.argmax(scores))
    one_best = metrics.bleu_report(refs, [h[0] for h in nbest])["bleu"]
    assert metrics.bleu_report(refs, metrics.pick(nbest, oracle))["bleu"] > one_best


def test_paired_bootstrap_wer():
    refs = sentences(300, 13)
    rng = np.random.default_rng(14)
    bad = [corrupt(r, rng, 0.4) for r in refs]
    good = [corrupt(r, rng, 0.1) for r in refs]
    clear = metrics.paired_bootstrap("wer", refs, bad, good, samples=500, seed=1)
    assert clear["delta"] < 0 and clear["p_value"] < 0.01
    assert clear["delta_ci95"][1] < 0
    assert clear["signature"].endswith("|bootstrap:500|seed:1")
    same = metrics.paired_bootstrap("wer", refs, bad, bad, samples=500, seed=1)
    assert same["delta"] == 0 and same["p_value"] == 1.0
    reverse = metrics.paired_bootstrap("wer", refs, good, bad, samples=500, seed=1)
    assert reverse["p_value"] > 0.99
    again = metrics.paired_bootstrap("wer", refs, bad, good, samples=500, seed=1)
    assert again == clear  # seeded


def test_paired_bootstrap_bleu():
    refs = [sentences(200, 15)]
    rng = np.random.default_rng(16)
    bad = [corrupt(r, rng, 0.5) for r in refs[0]]
    good = [corrupt(r, rng, 0.1) for r in refs[0]]
    clear = metrics.paired_bootstrap("bleu", refs, bad, good, samples=300)
    assert clear["delta"] > 0 and clear["p_value"] < 0.01
    assert clear["signature"].startswith("nrefs:1|")
    assert metrics.paired_bootstrap("bleu", refs, good, good, samples=300)["p_value"] == 1.0


def test_paired_bootstrap_is_fast_on_cached_statistics():
    rng = np.random.default_rng(17)
    lengths = rng.integers(5, 30, size=(3000, 1))
    wer_a = np.hstack([rng.integers(0, 5, size=(3000, 1)), lengths])
    wer_b = np.hstack([rng.integers(0, 4, size=(3000, 1)), lengths])
    correct = rng.integers(0, 10, size=(3000, 4))
    bleu_a = np.hstack([lengths + 2, lengths, correct, correct + 5])
    start = time.perf_counter()
    wer = metrics.paired_bootstrap_stats("wer", wer_a, wer_b, samples=1000)
    bleu = metrics.paired_bootstrap_stats("bleu", bleu_a, bleu_a, samples=1000)
    assert time.perf_counter() - start < 2.0  # about 0.2 s; generous for a busy machine
    assert wer["p_value"] < 0.01 and bleu["p_value"] == 1.0
    with pytest.raises(ValueError, match="metric must be one of"):
        metrics.paired_bootstrap_stats("ter", wer_a, wer_b)


def test_chrf_report_is_sacrebleus_corpus_chrf():
    hyps = ["the cat sat on the mat", "a dog barked"]
    refs = [["the cat sat on a mat", "a dog was barking"], ["a cat sat on the mat", "the dog barked"]]
    report = metrics.chrf_report(refs, hyps)
    assert report["chrf"] == pytest.approx(sacrebleu.corpus_chrf(hyps, refs).score)
    assert report["signature"].startswith("nrefs:2|") and report["sentences"] == 2
