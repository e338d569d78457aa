"""Rescoring end to end on generated lists: LM scores (neural + real KenLM) and their cache, features, tuning on a dev
set, reranking a test set, reports; and the proof that tuning never opens the test set."""

import json
import pickle
import sys

import numpy as np
import pytest
from conftest import make_sentences

from lmserve.rescoring.commands.cli import main as rescore_main
from lmserve.rescoring.commands.remote import _hypothesis_scores
from lmserve.rescoring.features import feature_matrices, parse_definition
from lmserve.rescoring.interpolated import InterpolatedLM
from lmserve.rescoring.lmscores import cache_key, compute, load_or_compute, summed
from lmserve.rescoring.nbest import Hypothesis, NBestEntry, NBestList, read_nbest, write_nbest
from lmserve.rescoring.ngram import NgramLM, build_ngram
from lmserve.rescoring.rescore import LanguageModels, Setup, report, reranked, tune
from lmserve.server.messages import sentence_score


def corrupted_lists(n: int, seed: int, name: str) -> NBestList:
    """Each reference plus 4 copies with 1-2 words replaced by random words; a noisy 'am' score that ranks a
    corrupted copy first half of the time, so that an LM can fix choices."""
    rng = np.random.default_rng(seed)
    entries = []
    for i, ref in enumerate(make_sentences(n, seed=seed)):
        words = ref.split()
        texts = [ref]
        for _ in range(4):
            w = list(words)
            for _ in range(int(rng.integers(1, 3))):
                w[int(rng.integers(len(w)))] = f"w{int(rng.integers(20, 40))}"
            texts.append(" ".join(w))
        am = rng.normal(0, 1, size=5)
        am[0] -= 0.3
        order = np.argsort(-am, kind="stable")
        hyps = [Hypothesis(texts[k], {"am": float(am[k]), "extra": float(k == 0) if i % 2 else 0.0}) for k in order]
        entries.append(NBestEntry(f"utt{i}", hyps, [ref]))
    return NBestList(entries, name)


@pytest.fixture(scope="module")
def ngram_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("ngram") / "train3"
    build_ngram((s.split() for s in make_sentences(300, seed=1)), 3, out, discount_fallback=True)
    return out.with_suffix(".bin")


def test_definitions_parse_and_errors_name_the_problem():
    assert parse_definition("am=0.6*decoder+0.4*ctc") == ("am", {"decoder": 0.6, "ctc": 0.4})
    assert parse_definition("x = a - 2*b + 1e-1*c") == ("x", {"a": 1.0, "b": -2.0, "c": 0.1})
    for bad in ("am", "am=", "am=0.6*", "am=decoder ctc", "1x=a"):
        with pytest.raises(ValueError, match="feature definition"):
            parse_definition(bad)


def test_features_from_lists_definitions_and_a_missing_feature_is_an_error():
    nbest = NBestList([NBestEntry("u", [Hypothesis("a b", {"d": 1.0, "c": 2.0}), Hypothesis("a", {"d": 3.0})])])
    (x,) = feature_matrices(nbest, ["am", "length"], definitions={"am": {"d": 0.5}})
    np.testing.assert_allclose(x, [[0.5, 2], [1.5, 1]])
    for names, definitions in ((["length", "c"], {}), (["am"], {"am": {"d": 0.5, "c": 2.0}})):
        with pytest.raises(ValueError, match=r"lists\[0\] \(id 'u'\).hypotheses\[1\]: no feature 'c'"):
            feature_matrices(nbest, names, definitions=definitions)  # never a silent 0.0
    with pytest.raises(ValueError, match="unknown feature 'nope'.*carries"):
        feature_matrices(nbest, ["nope"])
    with pytest.raises(ValueError, match="needs LM scores"):
        feature_matrices(nbest, ["neural"])


def test_lm_scores_share_tokens_interpolate_and_cache(bundles, ngram_model, tmp_path):
    models = LanguageModels.load(bundles[("full", 0.0)][1], ngram_model, threads=1)
    nbest = NBestList([NBestEntry("u", [Hypothesis("w1 w2 zzz"), Hypothesis("w1 w2"), Hypothesis("")])])
    scores = models.scores(nbest)
    first = scores[0][0]
    assert first.oov == 1 and len(first.neural) == len(first.ngram) == 4
    # the n-gram saw the neural LM's unknown word as <unk>
    ngram = NgramLM(ngram_model)
    np.testing.assert_allclose(first.ngram, ngram.token_logprobs(["w1", "w2", "<unk>"]))
    # per-word interpolation lies between the two models, token by token
    mixed = first.interpolated(0.3)
    assert np.all(mixed >= np.minimum(first.neural, first.ngram) - 1e-12)
    assert np.all(mixed <= np.maximum(first.neural, first.ngram) + 1e-12)
    # the feature matrix holds, per hypothesis, the sums of these token scores (definitions over them too)
    names = ["neural", "ngram", "interp", "oov", "length", "lms"]
    (x,) = feature_matrices(nbest, names, scores, {"lms": {"neural": 2.0, "ngram": -1.0}}, 0.3)
    expected = [
        [s.neural.sum(), s.ngram.sum(), s.interpolated(0.3).sum(), s.oov, len(h.text.split()), 0.0]
        for h, s in zip(nbest.entries[0].hypotheses, scores[0], strict=True)
    ]
    expected = np.array(expected)
    expected[:, 5] = 2 * expected[:, 0] - expected[:, 1]
    np.testing.assert_allclose(x, expected, rtol=1e-12)
    # the cache returns the same numbers without running the models, and is recomputed for other settings
    cache = tmp_path / "scores.jsonl"
    written = models.scores(nbest, cache)

    def must_not_run():
        raise AssertionError("the cache holds these scores")

    read = load_or_compute(cache, cache_key(nbest, models.scorer, models.ngram, models.normalizer), nbest, must_not_run)
    again = LanguageModels(None, models.ngram, models.normalizer).scores(nbest, cache)  # no neural LM: another key
    assert again[0][0].neural is None
    with pytest.raises(ValueError, match="feature 'neural': that LM was not given"):
        feature_matrices(nbest, ["ngram", "neural"], again)
    with pytest.raises(ValueError, match="interpolation needs both"):
        feature_matrices(nbest, ["interp"], again, lam=0.3)
    for a, b in zip(written[0], read[0], strict=True):
        np.testing.assert_allclose(a.neural, b.neural, rtol=1e-6)
        np.testing.assert_allclose(a.ngram, b.ngram, rtol=1e-6)
    with pytest.raises(ValueError, match="nothing to score with"):
        compute(nbest, None, None, models.normalizer)


def test_lm_sums_of_a_batch_give_the_features_of_token_scores(bundles, ngram_model):
    """What a scoring process sends back for a batch of lists, each at its own λ (or none): after a round trip
    through pickle, the same feature matrices as the token scores give, also with an LM missing and for an empty
    list; interp at another λ than the sums were taken at is refused."""
    models = LanguageModels.load(bundles[("full", 0.0)][1], ngram_model, threads=1)
    nbest = NBestList(
        [
            NBestEntry("u", [Hypothesis("w1 w2 zzz"), Hypothesis(""), Hypothesis("w3 w1 w2 w4")]),
            NBestEntry("v", [Hypothesis("w4 w4"), Hypothesis("w2 zzz w1")]),
            NBestEntry("w", [Hypothesis("w1")]),
        ]
    )
    rows = models.scores(nbest)
    lams = [0.3, None, 0.7]
    sums = pickle.loads(pickle.dumps(summed(rows, lams)))
    for i, lam in enumerate(lams):
        one = NBestList([nbest.entries[i]])
        names = ["neural", "ngram", "oov", "length"] + (["interp"] if lam else [])
        [want] = feature_matrices(one, names, [rows[i]], lam=lam)
        [got] = feature_matrices(one, names, [sums[i]], lam=lam)
        np.testing.assert_allclose(got, want, rtol=1e-12)
    with pytest.raises(ValueError, match="at λ=0.5: these sums have it at λ=0.3"):
        feature_matrices(NBestList([nbest.entries[0]]), ["interp"], [sums[0]], lam=0.5)
    with pytest.raises(ValueError, match="at λ=0.4: these sums have it at λ=None"):
        feature_matrices(NBestList([nbest.entries[1]]), ["interp"], [sums[1]], lam=0.4)
    ngram_only = LanguageModels(None, models.ngram, models.normalizer).scores(nbest)
    [sums] = summed(ngram_only[:1], [None])
    np.testing.assert_array_equal(sums.oov, [h.oov for h in ngram_only[0]])
    with pytest.raises(ValueError, match="'neural': that LM was not given"):
        feature_matrices(NBestList([nbest.entries[0]]), ["neural"], [sums])
    with pytest.raises(ValueError, match="interpolation needs both"):
        summed(ngram_only[:1], [0.5])
    with pytest.raises(ValueError, match="must be in"):
        summed(rows[:1], [1.5])
    assert summed([], []) == []


def test_tuned_lm_features_beat_the_first_pass_on_held_out_lists(bundles, ngram_model):
    models = LanguageModels.load(bundles[("full", 0.0)][1], ngram_model, threads=1)
    dev, test = corrupted_lists(80, 11, "dev"), corrupted_lists(80, 12, "test")
    setup = Setup.parse("am,neural,ngram,interp,length")
    tuned = tune(dev, setup, models.scores(dev), "wer", fixed="am", lambdas=(0.3, 0.7), restarts=2)
    assert set(tuned.by_lambda) == {0.3, 0.7}
    chosen = tuned.setup.choose(test, models.scores(test))
    rep = report(test, chosen, "wer", bootstrap_samples=200)
    assert rep["rescored"]["wer"] < rep["1best"]["wer"]
    assert rep["oracle"]["wer"] <= rep["rescored"]["wer"]
    assert rep["bootstrap"]["p_value"] < 0.05
    out, ranked_choice = reranked(test, tuned.setup, models.scores(test))
    assert ranked_choice.tolist() == chosen.tolist()
    for entry in out:
        scores = [h.features["rescore"] for h in entry.hypotheses]
        assert scores == sorted(scores, reverse=True)
    assert [e.hypotheses[0].text for e in out] == [e.hypotheses[k].text for e, k in zip(test, chosen, strict=True)]


def test_cli_tune_then_rescore_and_tuning_never_opens_the_test_set(bundles, ngram_model, tmp_path, capsys):
    dev, test = tmp_path / "dev.jsonl", tmp_path / "test.jsonl"
    write_nbest(corrupted_lists(60, 21, "dev"), dev, "jsonl")
    write_nbest(corrupted_lists(60, 22, "test"), test, "jsonl")
    weights = tmp_path / "dev.weights.json"
    opened = []

    def audit(event, args):
        if event == "open" and isinstance(args[0], str | bytes) and "test" in str(args[0]):
            opened.append(str(args[0]))

    sys.addaudithook(audit)
    common = ["--lm", str(bundles[("full", 0.0)][1]), "--ngram", str(ngram_model), "--threads", "1"]
    args = ["tune", str(dev), *common, "--metric", "wer", "--features", "am,neural,ngram,length", "--fixed", "am"]
    guard = ["--bounds", "neural=0:", "--require-folds", "3"]
    assert rescore_main([*args, "--restarts", "1", "--cv", "3", *guard, "--out", str(weights)]) == 0
    assert not [p for p in opened if p.endswith("test.jsonl")]
    record = json.loads(weights.read_text())
    assert record["features"] == ["am", "neural", "ngram", "length"] and record["cross_validation"]["folds"] == 3
    assert record["adopted"] and record["cross_validation"]["folds_improved"] == 3 and record["weights"]["neural"] >= 0
    assert set(record["weight_spread"]) == set(record["cross_validation"]["weight_spread"]) == set(record["features"])
    printed = capsys.readouterr().out
    assert "weight stability" in printed and "runs (4):" in printed and "folds (3):" in printed

    out, rep = tmp_path / "test.rescored.jsonl", tmp_path / "test.report.json"
    assert rescore_main(["nbest", str(test), "--weights", str(weights), "--out", str(out), "--report", str(rep)]) == 0
    table = capsys.readouterr().out
    assert "rescored" in table and "oracle" in table and "WER" in table
    result = json.loads(rep.read_text())
    assert result["rescored"]["wer"] < result["1best"]["wer"]
    assert len(read_nbest(out)) == 60


def test_cli_errors_name_the_problem(tmp_path, capsys):
    dev = tmp_path / "dev.jsonl"
    write_nbest(corrupted_lists(5, 1, "dev"), dev, "jsonl")
    assert (
        rescore_main(["tune", str(dev), "--metric", "wer", "--features", "am,neural", "--out", str(tmp_path / "w")])
        == 2
    )
    assert "needs LM scores" in capsys.readouterr().err
    assert (
        rescore_main(["nbest", str(dev), "--weights", str(tmp_path / "missing.json"), "--out", str(tmp_path / "o")])
        == 2
    )
    assert "missing.json" in capsys.readouterr().err
    tune = ["tune", str(dev), "--metric", "wer", "--features", "am,length", "--out", str(tmp_path / "w")]
    for flags, message in (
        (["--bounds", "lm=0:"], "bounds name 'lm'"),
        (["--bounds", "length=1:0"], "low limit is above"),
        (["--require-folds", "2"], "--require-folds 2: expected 1 to --cv (0)"),
        (["--penalty", "nan"], "--penalty nan"),
        (["--length-ratio", "0.99:1.03"], "--length-ratio bounds BLEU tuning (MT lists), not --metric wer"),
        (["--length-ratio", "1.1:1.0"], "--length-ratio '1.1:1.0': the low limit is above the high one"),
        (["--length-ratio", "short"], "--length-ratio 'short': expected LOW:HIGH"),
    ):
        assert rescore_main([*tune, *flags]) == 2
        assert message in capsys.readouterr().err


def test_lists_in_another_text_form_than_the_lms_are_refused_before_scoring(bundles, ngram_model, tmp_path, capsys):
    """Upper-case lists for lower-case LMs: every word would be <unk>, and reranking by such scores is noise."""
    upper = NBestList(
        [
            NBestEntry(
                e.id, [Hypothesis(h.text.upper(), h.features) for h in e.hypotheses], [r.upper() for r in e.references]
            )
            for e in corrupted_lists(20, 3, "upper")
        ],
        "upper",
    )
    lists = tmp_path / "upper.jsonl"
    write_nbest(upper, lists, "jsonl")
    tune = ["tune", str(lists), "--metric", "wer", "--features", "am,neural,ngram", "--fixed", "am", "--threads", "1"]
    out = tmp_path / "w.json"
    assert rescore_main([*tune, "--lm", str(bundles[("full", 0.0)][1]), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "100% of the words of 100 hypotheses are unknown to the neural LM" in err and "(e.g. W0, W1, W10)" in err
    assert "--normalize" in err and not out.exists()
    assert rescore_main([*tune, "--ngram", str(ngram_model), "--features", "am,ngram", "--out", str(out)]) == 2
    assert "unknown to the n-gram" in capsys.readouterr().err
    lower = [*tune, "--lm", str(bundles[("full", 0.0)][1]), "--normalize", "lower", "--features", "am,neural"]
    assert rescore_main([*lower, "--out", str(out)]) == 0 and out.exists()  # the right form: scored and tuned


def test_ngram_built_like_a_bundle_sees_the_bundles_tokens(bundles, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("\n".join(make_sentences(200, seed=5) + ["W1 ZZZ w2"]) + "\n")
    out = tmp_path / "like"
    args = ["ngram", "build", "--order", "2", "--text", str(text), "--out", str(out), "--discount-fallback"]
    assert rescore_main([*args, "--like", str(bundles[("full", 0.0)][1]), "--normalize", "lower"]) == 0
    arpa = out.with_suffix(".arpa").read_text()
    assert "\tzzz" not in arpa and "\tW1" not in arpa and "\tw1\t" in arpa and "\t<unk>" in arpa


def test_cli_bleu_tuning_on_a_kbest_list_with_several_references(bundles, tmp_path, capsys):
    lists = corrupted_lists(40, 31, "mt")
    for entry in lists:
        entry.references = [entry.references[0], entry.references[0] + " w1"]
    path = tmp_path / "mt.jsonl"
    write_nbest(lists, path, "jsonl")
    weights = tmp_path / "mt.weights.json"
    common = ["--lm", str(bundles[("full", 0.0)][1]), "--threads", "1", "--quiet"]
    tune_args = ["tune", str(path), *common, "--metric", "bleu", "--features", "am,neural,length", "--restarts", "1"]
    assert rescore_main([*tune_args, "--out", str(weights)]) == 0
    assert json.loads(weights.read_text())["metric"] == "bleu"
    capsys.readouterr()
    out, rep = tmp_path / "mt.out.jsonl", tmp_path / "mt.report.json"
    assert rescore_main(["nbest", str(path), "--weights", str(weights), "--out", str(out), "--report", str(rep)]) == 0
    assert "BLEU" in capsys.readouterr().out
    result = json.loads(rep.read_text())
    assert result["rescored"]["bleu"] > result["1best"]["bleu"] and "nrefs:2" in result["1best"]["signature"]


def test_the_ngram_feature_keeps_the_words_the_ngram_knows_and_the_neural_lm_does_not(bundles, tmp_path):
    """Interpolation mixes the two LMs over the neural vocabulary (zzz as <unk> for both), but the log-linear ngram
    feature scores zzz as the n-gram knows it; the cache, the server's sums and its sentence scores keep that."""
    out = tmp_path / "wide"
    build_ngram(
        [*(s.split() for s in make_sentences(300, seed=1)), ["w1", "w2", "zzz"]], 3, out, discount_fallback=True
    )
    models = LanguageModels.load(bundles[("full", 0.0)][1], out.with_suffix(".bin"), threads=1)
    nbest = NBestList([NBestEntry("u", [Hypothesis("w1 w2 zzz"), Hypothesis("w1 w2")])])
    first, second = models.scores(nbest, tmp_path / "cache.jsonl")[0]
    ngram = NgramLM(out.with_suffix(".bin"))
    np.testing.assert_allclose(first.ngram, ngram.token_logprobs(["w1", "w2", "<unk>"]))  # interp's events
    assert first.ngram_own == pytest.approx(ngram.token_logprobs(["w1", "w2", "zzz"]).sum())
    assert first.ngram_own != pytest.approx(first.ngram.sum()) and second.ngram_own is None
    cached = models.scores(nbest, tmp_path / "cache.jsonl")[0]
    sentences = InterpolatedLM(models.scorer, models.ngram).score(["w1 w2 zzz", "w1 w2"])  # lm-serve's ScoreSentences
    remote = [_hypothesis_scores(sentence_score(t, per_token=True)) for t in sentences]  # tune --server reads these
    assert [r.ngram_own for r in remote] == [first.ngram_own, None]
    for rows in ([first, second], cached, summed([[first, second]], [None])[0], remote):
        [x] = feature_matrices(nbest, ["ngram"], [rows])
        np.testing.assert_allclose(x[:, 0], [first.ngram_own, second.ngram.sum()], rtol=1e-12)
