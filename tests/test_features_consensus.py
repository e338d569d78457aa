"""The features rerankers use besides LMs: minimum-Bayes-risk consensus (sentence BLEU, chrF, 1 − WER),
rank, chars and src_ratio. Each value is pinned on a list small enough to work out by hand (the arithmetic is in the
comments); similarities agree with sacrebleu and jiwer on random pairs; tuning with consensus and no LM picks the
majority hypothesis and survives the weights file."""

import json
import math

import jiwer
import numpy as np
import pytest
import sacrebleu

from lmserve.rescoring import consensus
from lmserve.rescoring.commands.cli import main as rescore_main
from lmserve.rescoring.features import Consensus, feature_matrices, parse_consensus, parse_definition
from lmserve.rescoring.nbest import Hypothesis, NBestEntry, NBestList, write_nbest
from lmserve.rescoring.rescore import Setup, report, reranked, setup_from_record, setup_record, tune
from lmserve.rescoring.tune import read_weights, write_weights


def one_list(texts, features=None, source=None, ranks=None) -> NBestList:
    features = features or [{} for _ in texts]
    ranks = ranks or [None for _ in texts]
    hyps = [Hypothesis(t, dict(f), r) for t, f, r in zip(texts, features, ranks, strict=True)]
    return NBestList([NBestEntry("u", hyps, source=source)], "tiny")


def column(nbest, name, definitions=None) -> np.ndarray:
    (x,) = feature_matrices(nbest, [name], definitions=definitions)
    return x[:, 0]


# -- pinned values ---------------------------------------------------------------------------------------------------

# ASR: sim(i, j) = max(0, 1 − ED(i, j) / words of j). ED("a b c", "a b") = 1, ED("a b c", "c") = 2, ED("a b", "c") = 2:
#   sim(0,1) = 1 − 1/2 = 1/2   sim(0,2) = 1 − 2/1 < 0 → 0
#   sim(1,0) = 1 − 1/3 = 2/3   sim(1,2) = 1 − 2/1 < 0 → 0
#   sim(2,0) = 1 − 2/3 = 1/3   sim(2,1) = 1 − 2/2 = 0
ASR = ["a b c", "a b", "c"]


def test_consensus_wer_by_hand_uniform_and_posterior_weighted():
    score = [0.0, math.log(2), 0.0]  # posteriors ∝ e^score = 1 : 2 : 1
    nbest = one_list(ASR, [{"score": s} for s in score])
    # uniform: C_i = mean over the two others: (1/2 + 0)/2, (2/3 + 0)/2, (1/3 + 0)/2
    np.testing.assert_allclose(column(nbest, "consensus_wer"), [1 / 4, 1 / 3, 1 / 6])
    # @score, weights 1 : 2 : 1:  C_0 = (2·1/2 + 1·0)/3,  C_1 = (1·2/3 + 1·0)/2,  C_2 = (1·1/3 + 2·0)/3
    np.testing.assert_allclose(column(nbest, "consensus_wer@score"), [1 / 3, 1 / 3, 1 / 9])
    # @2*score, weights 1 : 4 : 1:  C_0 = (4·1/2)/5,  C_1 = (1·2/3)/2,  C_2 = (1·1/3)/5
    np.testing.assert_allclose(column(nbest, "consensus_wer@2*score"), [2 / 5, 1 / 3, 1 / 15])
    # the softmax's normaliser cancels: shifting every score changes nothing, even far beyond exp's range
    shifted = one_list(ASR, [{"score": s - 1e4} for s in score])
    np.testing.assert_allclose(column(shifted, "consensus_wer@2*score"), [2 / 5, 1 / 3, 1 / 15])


def test_consensus_weighted_by_a_definition_and_inside_one():
    nbest = one_list(ASR, [{"am": 0.0, "lm": s} for s in (0.0, math.log(4), 0.0)])
    # first = 0.5·lm: weights 1 : 2 : 1, as consensus_wer@score above
    definitions = dict([parse_definition("first=0.5*lm+am")])
    np.testing.assert_allclose(column(nbest, "consensus_wer@first", definitions), [1 / 3, 1 / 3, 1 / 9])
    # a definition over a consensus feature, weighted by 0.5·lm (1 : 2 : 1 again): 15·(1/3, 1/3, 1/9) + (3, 2, 1)
    name, terms = parse_definition("x = 15*consensus_wer@0.5*lm + length")
    assert terms == {"consensus_wer@0.5*lm": 15.0, "length": 1.0}
    np.testing.assert_allclose(column(nbest, name, {name: terms}), [8.0, 7.0, 8 / 3])


# MT: words "a b c d", "a b c e", "a b" (sentence BLEU, exp smoothing, effective order; brevity penalty on j's length)
#   sim(0,1) = sim(1,0): precisions 3/4, 2/3, 1/2 and no 4-gram match → 1/(2·1); BP 1 → (1/8)^(1/4) = 2^(-3/4)
#   sim(0,2) = sim(1,2): 2/4, 1/3, no 3-gram match → 1/(2·2), no 4-gram → 1/(4·1); BP 1 → (1/96)^(1/4)
#   sim(2,0) = sim(2,1): effective order 2, precisions 2/2, 1/1; BP exp(1 − 4/2) → e^-1
MT = ["a b c d", "a b c e", "a b"]


def test_consensus_bleu_by_hand():
    near, far, short = 2**-0.75, 96**-0.25, math.exp(-1)
    np.testing.assert_allclose(
        consensus.similarity_matrix(MT, "bleu"), [[1, near, far], [near, 1, far], [short, short, 1]]
    )
    np.testing.assert_allclose(column(one_list(MT), "consensus_bleu"), [(near + far) / 2, (near + far) / 2, short])


# chrF: whitespace goes, so "a b" is "ab" and "ab c" is "abc"; only orders both sides have count.
#   "ab" against "abc": 1-grams P 2/2, R 2/3; 2-grams P 1/1, R 1/2 → P = 1, R = 7/12
#                       F2 = 5PR / (4P + R) = (35/12) / (55/12) = 7/11
#   "abc" against "ab": 1-grams P 2/3, R 1; 2-grams P 1/2, R 1 (no 3-grams in "ab") → P = 7/12, R = 1
#                       F2 = (35/12) / (28/12 + 1) = 7/8
def test_consensus_chrf_by_hand():
    np.testing.assert_allclose(column(one_list(["a b", "ab c"]), "consensus_chrf"), [7 / 11, 7 / 8])


def test_votes_weigh_a_deduplicated_list_as_its_expansion():
    near = 2**-0.75  # sim("a b c d", "a b c e"), both ways (see MT above)
    dedup = one_list(MT[:2], [{"votes": 3}, {"votes": 1}])
    # C_0: two other outputs of the same string (sim 1) and one of the other: (2·1 + 1·near)/3; C_1: its three others
    np.testing.assert_allclose(column(dedup, "consensus_bleu"), [(2 + near) / 3, near])
    expanded = one_list([MT[0]] * 3 + [MT[1]])
    np.testing.assert_allclose(column(expanded, "consensus_bleu")[[0, 3]], column(dedup, "consensus_bleu"))
    # posteriors multiply with votes: p ∝ e^score = 1 : 3 gives C_0 = (2·1·1 + 1·3·near)/(2 + 3)
    weighted = one_list(MT[:2], [{"votes": 3, "s": 0.0}, {"votes": 1, "s": math.log(3)}])
    np.testing.assert_allclose(column(weighted, "consensus_chrf@s")[0], (2 + 3 * chrf(MT[0], MT[1])) / 5)
    # one output alone has no one to agree with; two outputs of one string agree fully
    np.testing.assert_allclose(column(one_list(["x y"]), "consensus_wer"), [0.0])
    np.testing.assert_allclose(column(one_list(["x y"], [{"votes": 2}]), "consensus_wer"), [1.0])


def chrf(hypothesis: str, reference: str) -> float:
    return sacrebleu.sentence_chrf(hypothesis, [reference]).score / 100


def test_rank_chars_and_src_ratio_by_hand():
    texts = ["this is a test", "this\u00a0is test", "это тест"]  # str.split(): the no-break space splits words too
    nbest = one_list(texts, source="das ist ein Test")
    np.testing.assert_allclose(column(nbest, "rank"), [1, 2, 3])  # no ranks given: positions
    np.testing.assert_allclose(column(one_list(texts, ranks=[3, 1, 2]), "rank"), [3, 1, 2])
    np.testing.assert_allclose(column(nbest, "chars"), [11, 10, 7])  # 4+2+1+4, 4+2+4, 3+4
    np.testing.assert_allclose(column(nbest, "src_ratio"), [4 / 4, 3 / 4, 2 / 4])
    np.testing.assert_allclose(column(one_list(texts, source=""), "src_ratio"), [4, 3, 2])  # empty source: one word
    # a Chinese or Japanese character is a source word of its own, other runs go by spaces: 4 + 2 ("iPhone", "13"),
    # and 3 kana + 1 ideograph; counted by spaces, both sources would be 2 words long
    np.testing.assert_allclose(column(one_list(texts, source="是否有途 iPhone 13"), "src_ratio"), [4 / 6, 3 / 6, 2 / 6])
    np.testing.assert_allclose(column(one_list(texts, source="すみま 東"), "src_ratio"), [4 / 4, 3 / 4, 2 / 4])


def test_nonword_counts_tokens_without_a_letter_or_digit():
    texts = ["because i .", "because i", "so .. it is 2 . ok", "it's a-ok ¿qué?"]
    # "." and ".." count; "2" (a digit), "it's", "a-ok" and "¿qué?" (letters inside punctuation) do not
    np.testing.assert_allclose(column(one_list(texts), "nonword"), [1, 0, 2, 0])


# -- errors ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, message",
    [
        ("src_ratio", r"tiny\[0\] \(id 'u'\): feature 'src_ratio' needs the source sentence \(NBestEntry.source"),
        ("consensus_chrf@score", "feature 'consensus_chrf@score': no feature 'score' to weight by; the list carries"),
        ("consensus_blue", "feature 'consensus_blue': expected consensus_KIND or consensus_KIND@"),
        ("consensus_bleu@0*am", "scale of the posterior must be > 0"),
        ("consensus_bleu@consensus_wer", "cannot be weighted by consensus"),
        ("consensus_wer@neural", "feature 'neural' needs LM scores"),
        ("ranks", "unknown feature 'ranks'; the list carries"),
    ],
)
def test_errors_name_the_feature_and_what_is_missing(name, message):
    with pytest.raises(ValueError, match=message):
        feature_matrices(one_list(MT, [{"am": 0.0}] * 3), [name])


def test_bad_votes_and_scores_are_errors():
    with pytest.raises(ValueError, match=r"hypotheses\[1\]: feature 'votes' = 0.5; expected a count >= 1"):
        feature_matrices(one_list(MT[:2], [{"votes": 2}, {"votes": 0.5}]), ["consensus_wer"])
    with pytest.raises(ValueError, match="'am' has values that are not finite"):
        feature_matrices(one_list(MT[:2], [{"am": 0.0}, {"am": math.nan}]), ["consensus_wer@am"])
    assert parse_consensus("consensus_chrf@0.5*score") == Consensus("chrf", "score", 0.5)
    assert parse_consensus("consensus_wer") == Consensus("wer") and parse_consensus("length") is None


# -- agreement with sacrebleu and jiwer ------------------------------------------------------------------------------


def random_texts(rng, n):
    words = ["a", "b", "the", "cat", "ü", "straße", "a.", "ab", "日本", "!"]
    return [" ".join(rng.choice(words, size=int(rng.integers(0, 9)))) for _ in range(n)]


def test_similarities_agree_with_sacrebleu_and_jiwer_on_random_pairs():
    rng = np.random.default_rng(7)
    for _ in range(60):
        texts = random_texts(rng, int(rng.integers(1, 6)))
        bleu, chrf_, wer = (consensus.similarity_matrix(texts, kind) for kind in consensus.KINDS)
        for i, h in enumerate(texts):
            for j, r in enumerate(texts):
                # tokenize="none": words are str.split(); sacrebleu's default 13a would also split off punctuation
                assert bleu[i, j] == pytest.approx(
                    sacrebleu.sentence_bleu(h, [r], tokenize="none").score / 100, abs=1e-8
                )
                assert chrf_[i, j] == pytest.approx(chrf(h, r), abs=1e-8)
                expected = max(0.0, 1 - jiwer.wer(r, h)) if r.split() else float(not h.split())
                assert wer[i, j] == pytest.approx(expected, abs=1e-12)


# -- tuning without an LM --------------------------------------------------------------------------------------------


def majority_lists(n: int, seed: int, name: str) -> NBestList:
    """ASR-like lists of 7: the reference 3 times (its own decoder scores) and 4 variants with one or two words
    replaced; the first pass's 'am' prefers a variant, so only agreement finds the reference."""
    rng = np.random.default_rng(seed)
    entries = []
    for i in range(n):
        words = [f"w{k}" for k in rng.integers(0, 50, size=int(rng.integers(6, 12)))]
        texts = [" ".join(words)] * 3
        for _ in range(4):
            variant = list(words)
            for k in rng.choice(len(words), size=int(rng.integers(1, 3)), replace=False):
                variant[k] = f"x{int(rng.integers(0, 1000))}"
            texts.append(" ".join(variant))
        am = rng.normal(0, 1, size=7) - 1.5 * (np.arange(7) < 3)
        order = np.argsort(-am, kind="stable")
        hyps = [Hypothesis(texts[k], {"am": float(am[k])}, rank + 1) for rank, k in enumerate(order)]
        entries.append(NBestEntry(f"utt{i}", hyps, [texts[0]]))
    return NBestList(entries, name)


def test_tuned_consensus_picks_the_majority_and_the_weights_file_keeps_the_setup(tmp_path):
    dev, test = majority_lists(40, 1, "dev"), majority_lists(40, 2, "test")
    setup = Setup.parse("am,consensus_wer,rank")
    tuned = tune(dev, setup, None, "wer", fixed="am", restarts=1)
    assert tuned.result.baseline_metric > 10 and tuned.result.dev_metric == 0.0  # every choice a copy of the reference
    chosen = tuned.setup.choose(test, None)
    rep = report(test, chosen, "wer", bootstrap_samples=50)
    assert rep["rescored"]["wer"] < rep["1best"]["wer"] / 10  # (the weight that sufficed on dev nearly always does)
    path = tmp_path / "w.json"
    write_weights(path, tuned.result, setup_record(_NoModels(), tuned.setup))
    again = setup_from_record(read_weights(path))
    assert again.features == ["am", "consensus_wer", "rank"] and again.weights == tuned.setup.weights
    ranked, again_chosen = reranked(test, again, None)
    assert again_chosen.tolist() == chosen.tolist()
    assert [e.hypotheses[0].text for e in ranked] == [e.hypotheses[k].text for e, k in zip(test, chosen, strict=True)]
    assert all("consensus_wer" in h.features for e in ranked for h in e.hypotheses)


class _NoModels:
    paths = {"lm": None, "ngram": None, "normalize": None}


def test_cli_tunes_and_rescores_a_voted_mt_list_without_an_lm(tmp_path, capsys):
    """Deduplicated lists with votes (MT system outputs): the string three systems wrote beats the one the first
    pass prefers, through lm-rescore tune and nbest with consensus weighted by the first pass's posterior."""
    lists = majority_lists(30, 3, "mt")
    for entry in lists:
        reference = entry.references[0]
        keep = [h for h in entry.hypotheses if h.text != reference]
        best = max((h for h in entry.hypotheses if h.text == reference), key=lambda h: h.features["am"])
        best.features["votes"] = 3.0
        for h in keep:
            h.features["votes"] = 1.0
        entry.hypotheses = sorted([best, *keep], key=lambda h: -h.features["am"])
        entry.source = " ".join(["s"] * len(reference.split()))
    path, weights = tmp_path / "mt.jsonl", tmp_path / "mt.weights.json"
    write_nbest(lists, path, "jsonl")
    features = "am,consensus_bleu@0.5*am,src_ratio"
    tune_args = ["tune", str(path), "--metric", "bleu", "--restarts", "1", "--quiet", "--out", str(weights)]
    assert rescore_main([*tune_args, "--features", features]) == 0
    assert json.loads(weights.read_text())["features"] == features.split(",")
    out, rep = tmp_path / "out.jsonl", tmp_path / "report.json"
    assert rescore_main(["nbest", str(path), "--weights", str(weights), "--out", str(out), "--report", str(rep)]) == 0
    result = json.loads(rep.read_text())
    assert result["rescored"]["bleu"] == pytest.approx(100.0) and result["1best"]["bleu"] < 90
    capsys.readouterr()
    assert rescore_main([*tune_args, "--features", "am,consensus_bleu@score"]) == 2
    assert "no feature 'score' to weight by" in capsys.readouterr().err
