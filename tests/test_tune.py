import json
from datetime import datetime

import numpy as np
import pytest

from lmserve.rescoring import evaluation, metrics, tune
from lmserve.rescoring.evaluation import Recipe
from lmserve.rescoring.tune import TuningSet

NAMES = ("base", "lm", "noise")


def synthetic_wer_set(utterances: int = 300, hyps: int = 10, seed: int = 0) -> TuningSet:
    """N-best lists where each hypothesis has e word errors out of 20. "base" sees the errors through heavy noise,
    "lm" through light noise (the informative feature), "noise" not at all; all live on different scales."""
    rng = np.random.default_rng(seed)
    features, stats = [], []
    for _ in range(utterances):
        n = int(rng.integers(2, hyps + 1))
        errors = rng.integers(0, 8, size=n)
        base = -errors + rng.normal(0, 3, n)
        lm = 50 * (-errors + rng.normal(0, 0.5, n)) - 200
        noise = rng.normal(0, 10, n)
        features.append(np.column_stack([base, lm, noise]))
        stats.append(np.column_stack([errors, np.full(n, 20)]))
    return TuningSet("synthetic", NAMES, "wer", features, stats)


def test_tuning_recovers_the_informative_feature():
    dev = synthetic_wer_set()
    result = tune.tune_weights(dev, restarts=2, seed=1)
    assert result.baseline_metric == pytest.approx(dev.evaluate(np.array([1.0, 0, 0])))
    assert result.dev_metric < result.baseline_metric - 4  # WER points: 9.3 -> about 4.6
    assert result.dev_metric <= dev.evaluate(np.array([0.0, 1.0, 0.0]))  # at least as good as "lm" alone
    assert result.dev_metric == pytest.approx(dev.evaluate(np.array([result.weights[f] for f in NAMES])))
    assert result.weights["base"] == 1.0
    # Direction: in units of each feature's spread, "lm" dominates and "noise" barely counts.
    spread = dev.within_list_spread()
    influence = {f: abs(result.weights[f]) * s for f, s in zip(NAMES, spread, strict=True)}
    assert result.weights["lm"] > 0
    assert influence["lm"] > 2 * influence["base"] and influence["lm"] > 3 * influence["noise"]
    assert len(result.runs) == 2 * 3
    assert {m for m, _, _ in result.runs} == {"powell", "nelder-mead"}
    assert result.spread["min"] == result.dev_metric == min(v for _, _, v in result.runs)
    assert result.spread["min"] <= result.spread["mean"] <= result.spread["max"]


def test_tuning_is_seeded_and_applies_to_new_data():
    dev, test = synthetic_wer_set(seed=2), synthetic_wer_set(seed=3)
    a = tune.tune_weights(dev, methods=("powell",), restarts=1, seed=5)
    b = tune.tune_weights(dev, methods=("powell",), restarts=1, seed=5)
    assert a.weights == b.weights and a.runs == b.runs
    chosen = tune.apply_weights(test.features, NAMES, a.weights)
    assert chosen.tolist() == test.choose(np.array([a.weights[f] for f in NAMES])).tolist()
    assert test.score(chosen) < test.evaluate(np.array([1.0, 0, 0]))  # tuned weights carry over
    with pytest.raises(ValueError, match="weights name"):
        tune.apply_weights(test.features, NAMES, {"base": 1.0})


def test_a_search_that_finds_nothing_keeps_the_start():
    rng = np.random.default_rng(4)
    features = [rng.normal(size=(4, 2)) for _ in range(20)]
    stats = [np.tile([[1, 10]], (4, 1)) for _ in range(20)]  # every hypothesis equally good
    result = tune.tune_weights(TuningSet("flat", ("a", "b"), "wer", features, stats), restarts=1)
    assert result.weights == {"a": 1.0, "b": 0.0} and result.dev_metric == result.baseline_metric == 10.0


def test_bleu_tuning_from_text():
    rng = np.random.default_rng(6)
    words = "the cat sat on a mat and dog ran far".split()
    refs, nbest, features = [], [], []
    for _ in range(60):
        ref = " ".join(rng.choice(words, size=8))
        hyps = []
        for _ in range(5):
            hyp = [w if rng.random() > 0.4 else str(rng.choice(words)) for w in ref.split()]
            hyps.append(" ".join(hyp))
        good = np.array([sum(a == b for a, b in zip(h.split(), ref.split(), strict=True)) for h in hyps])
        refs.append(ref)
        nbest.append(hyps)
        features.append(np.column_stack([rng.normal(size=5), good + rng.normal(0, 0.3, 5)]))
    dev = TuningSet.from_bleu("toy", ("base", "matches"), features, [refs], nbest)
    assert dev.signature.startswith("nrefs:1|")
    one_best = metrics.bleu_report([refs], [h[0] for h in nbest])["bleu"]
    assert dev.evaluate(np.array([1.0, 0.0])) == pytest.approx(
        metrics.bleu_report([refs], metrics.pick(nbest, dev.choose(np.array([1.0, 0.0]))))["bleu"]
    )
    result = tune.tune_weights(dev, restarts=1)
    assert result.dev_metric > one_best + 10 and result.weights["matches"] > 0
    chosen = tune.apply_weights(features, ("base", "matches"), result.weights)
    assert metrics.bleu_report([refs], metrics.pick(nbest, chosen))["bleu"] == pytest.approx(result.dev_metric)


def test_a_length_ratio_bound_keeps_bleu_tuning_from_buying_bleu_with_length():
    """Each list holds the reference itself and the reference with two words more; the first pass prefers the exact
    one (BLEU 100, length ratio 1.0). Asked for a length ratio of at least 1.2, the search gives up BLEU to stay
    inside; without the bound it keeps the exact ones. The reported figure is BLEU alone."""
    rng = np.random.default_rng(0)
    words = "the cat sat on a mat and dog ran far".split()
    refs = [" ".join(rng.choice(words, size=8)) for _ in range(20)]
    nbest = [[ref, f"{ref} far away"] for ref in refs]
    features = [np.array([[1.0, 0.0], [0.0, 1.0]]) for _ in refs]
    dev = TuningSet.from_bleu("toy", ("base", "longer"), features, [refs], nbest)
    free = tune.tune_weights(dev, restarts=1)
    assert free.dev_metric == pytest.approx(100.0)
    assert dev.length_ratio(dev.choose(np.array([free.weights["base"], free.weights["longer"]]))) == 1.0
    bounded = tune.tune_weights(dev, restarts=1, length_ratio=(1.2, None))
    weights = np.array([bounded.weights["base"], bounded.weights["longer"]])
    assert dev.length_ratio(dev.choose(weights)) == pytest.approx(1.25)
    assert bounded.dev_metric == pytest.approx(dev.evaluate(weights)) and bounded.dev_metric < 100.0
    assert bounded.settings["length_ratio"] == [1.2, None]
    with pytest.raises(ValueError, match="length_ratio bounds BLEU tuning, not wer"):
        tune.tune_weights(synthetic_wer_set(20), length_ratio=(0.9, 1.1))


def test_the_lambda_of_interp_is_chosen_by_the_search_objective_with_its_length_bound():
    """One search per λ: the λ kept is the one whose search did best on what it minimised (BLEU with the length
    bound's cost), not on BLEU alone, which would let a λ whose best choices break the bound win. Here λ 0.2's
    features allow only the exact references (BLEU 100, length ratio 1.0, outside the bound), λ 0.8's the longer
    ones (ratio 1.25, inside)."""
    rng = np.random.default_rng(0)
    words = "the cat sat on a mat and dog ran far".split()
    refs = [" ".join(rng.choice(words, size=8)) for _ in range(20)]
    nbest = [[ref, f"{ref} far away"] for ref in refs]
    exact = TuningSet.from_bleu("toy", ("base", "interp"), [np.array([[1.0, 0.0], [0.0, 0.0]])] * 20, [refs], nbest)
    longer = TuningSet.from_bleu("toy", ("base", "interp"), [np.array([[0.0, 0.0], [1.0, 0.0]])] * 20, [refs], nbest)
    recipe = Recipe(("base", "interp"), "base", lambdas=(0.2, 0.8), search={"restarts": 1, "length_ratio": (1.2, None)})
    fit = evaluation.fit({0.2: exact, 0.8: longer}, recipe)
    assert fit.by_lambda[0.2] == pytest.approx(100.0) and fit.by_lambda[0.8] < 100.0  # BLEU alone picks 0.2 ...
    assert fit.lam == 0.8  # ... the bound picks 0.8
    assert fit.result.objective < tune.tune_weights(exact, restarts=1, length_ratio=(1.2, None)).objective


def test_from_wer_uses_jiwer_errors():
    refs = ["a b c", "d e"]
    nbest = [["a b c", "a x c", "b c"], ["d e f"]]
    features = [np.zeros((3, 1)), np.zeros((1, 1))]
    dev = TuningSet.from_wer("tiny", ("s",), features, refs, nbest)
    assert [s.tolist() for s in dev.stats] == [[[0, 3], [1, 3], [1, 3]], [[1, 2]]]
    assert dev.signature == metrics.WER_SIGNATURE
    with pytest.raises(ValueError, match="utterance 1: 1 feature rows but 2 hypotheses"):
        TuningSet.from_wer("tiny", ("s",), features, refs, [nbest[0], ["d e", "d"]])


def test_tuning_set_validation():
    ok = [np.zeros((2, 2))], [np.zeros((2, 2), dtype=int)]
    with pytest.raises(ValueError, match=r"features \(2, 2\), expected \[n_hyps >= 1, 3\]"):
        TuningSet("x", ("a", "b", "c"), "wer", *ok)
    with pytest.raises(ValueError, match="finite"):
        TuningSet("x", ("a", "b"), "wer", [np.array([[0.0, -np.inf], [0, 0]])], ok[1])
    with pytest.raises(ValueError, match="metric"):
        TuningSet("x", ("a", "b"), "ter", *ok)
    with pytest.raises(ValueError, match="fixed feature 'c'"):
        tune.tune_weights(TuningSet("x", ("a", "b"), "wer", *ok), fixed="c")


def test_fold_indices_partition():
    folds = tune.fold_indices(103, 5, seed=3)
    assert sorted(np.concatenate(folds).tolist()) == list(range(103))
    assert {len(f) for f in folds} <= {20, 21}
    assert [f.tolist() for f in folds] == [f.tolist() for f in tune.fold_indices(103, 5, seed=3)]
    with pytest.raises(ValueError):
        tune.fold_indices(3, 5)


def test_cross_validation_never_tunes_on_the_held_out_fold(monkeypatch):
    data = synthetic_wer_set(utterances=120)
    seen = []
    real = tune.tune_weights

    def spy(dev, **kwargs):
        seen.append(dev.ids.copy())
        return real(dev, **kwargs)

    monkeypatch.setattr(tune, "tune_weights", spy)
    cv = tune.cross_validate(data, k=4, seed=7, restarts=1, methods=("powell",))
    assert len(seen) == len(cv.folds) == 4
    for tuned_on, fold in zip(seen, cv.folds, strict=True):
        assert not set(tuned_on) & set(fold.heldout.tolist())
        assert sorted(set(tuned_on) | set(fold.heldout.tolist())) == list(range(len(data)))
        assert fold.heldout_metric == pytest.approx(data.subset(fold.heldout).score(cv.chosen[fold.heldout]))
    assert sorted(np.concatenate([f.heldout for f in cv.folds]).tolist()) == list(range(len(data)))
    assert cv.heldout_metric == pytest.approx(data.score(cv.chosen))
    assert cv.heldout_metric < cv.baseline_metric


def test_weights_file_round_trip(tmp_path):
    result = tune.tune_weights(synthetic_wer_set(utterances=50), restarts=0)
    path = tmp_path / "weights.json"
    tune.write_weights(path, result)
    record = tune.read_weights(path)
    assert record["weights"] == result.weights
    assert record["features"] == list(NAMES)
    assert (record["metric"], record["dev_set"], record["fixed"]) == ("wer", "synthetic", "base")
    assert record["dev_metric"] == result.dev_metric
    assert datetime.fromisoformat(record["date"]).tzinfo is not None
    assert [p.name for p in tmp_path.iterdir()] == ["weights.json"]  # no temporary file left behind


@pytest.mark.parametrize(
    "change, message",
    [
        ({"format": "other"}, "field 'format'"),
        ({"weights": {"base": 1.0}}, "field 'weights' must map exactly"),
        ({"weights": {"base": 1.0, "lm": "x", "noise": 0}}, "not finite numbers for \\['lm'\\]"),
        ({"metric": "ter"}, "field 'metric'"),
    ],
)
def test_read_weights_names_the_bad_field(tmp_path, change, message):
    record = {
        "format": "lmserve-weights",
        "format_version": 1,
        "features": list(NAMES),
        "weights": {"base": 1.0, "lm": 0.5, "noise": 0.0},
        "metric": "wer",
        "dev_set": "dev",
        "date": "2026-01-01T00:00:00+00:00",
    }
    path = tmp_path / "w.json"
    path.write_text(json.dumps(record | change))
    with pytest.raises(ValueError, match=message):
        tune.read_weights(path)


def test_bounds_hold_and_every_run_is_kept():
    dev = synthetic_wer_set(utterances=150)
    free = tune.tune_weights(dev, restarts=2, seed=1)
    assert free.weights["lm"] > 0.01
    bounded = tune.tune_weights(dev, restarts=2, seed=1, bounds={"lm": (None, 0.0), "noise": (-0.01, 0.01)})
    assert bounded.weights["lm"] <= 0.0 and abs(bounded.weights["noise"]) <= 0.01
    assert bounded.dev_metric > free.dev_metric  # the informative feature could not be used
    assert len(bounded.run_weights) == len(bounded.runs) == 6
    assert all(w["lm"] <= 0.0 and abs(w["noise"]) <= 0.01 for w in bounded.run_weights)
    assert bounded.settings["bounds"] == {"lm": [None, 0.0], "noise": [-0.01, 0.01]}
    spread = free.weight_spread["lm"]
    lm = [w["lm"] for w in free.run_weights]
    assert spread["min"] == min(lm) and spread["max"] == max(lm) and spread["std"] == pytest.approx(np.std(lm))
    assert free.weight_spread["base"] == {"mean": 1.0, "std": 0.0, "min": 1.0, "max": 1.0, "sign_agreement": 1.0}
    with pytest.raises(ValueError, match="bounds name 'base'"):
        tune.tune_weights(dev, restarts=0, bounds={"base": (0, 1)})


def test_a_large_penalty_keeps_the_start():
    dev = synthetic_wer_set(utterances=100)
    result = tune.tune_weights(dev, restarts=1, penalty=1e6)
    assert result.weights == {"base": 1.0, "lm": 0.0, "noise": 0.0}
    small = tune.tune_weights(dev, restarts=1, penalty=0.01)
    assert small.dev_metric < result.dev_metric
    with pytest.raises(ValueError, match="penalty"):
        tune.tune_weights(dev, penalty=-1)


def test_the_guard_keeps_the_first_pass_when_gains_do_not_hold_across_folds():
    dev = synthetic_wer_set(utterances=200)
    useful = tune.tune_guarded(dev, folds=4, require_folds=4, restarts=1)
    assert useful.adopted and useful.cross_validation.folds_improved == 4
    assert useful.result.weights["lm"] > 0
    # Only the noise feature next to the base: it fits each training part a little, and does not hold out.
    noise = TuningSet("noise", ("base", "noise"), "wer", [x[:, [0, 2]] for x in dev.features], dev.stats)
    guarded = tune.tune_guarded(noise, folds=4, require_folds=4, restarts=1)
    cv = guarded.cross_validation
    assert cv.folds_improved < 4 and not guarded.adopted
    assert guarded.result.weights == {"base": 1.0, "noise": 0.0}
    assert guarded.result.dev_metric == guarded.result.baseline_metric
    assert cv.folds_improved == sum(f.heldout_metric < f.heldout_baseline for f in cv.folds)
    summary = cv.summary()
    assert summary["fold_gains"] == [f.heldout_baseline - f.heldout_metric for f in cv.folds]
    assert set(summary["weight_spread"]) == {"base", "noise"}
    nested = tune.cross_validate(noise, k=3, restarts=1, tuner=tune.guarded_tuner(3, 3))
    assert all(f.heldout_metric <= f.heldout_baseline for f in nested.folds)  # a guarded recipe never loses here
    with pytest.raises(ValueError, match="require_folds"):
        tune.tune_guarded(dev, folds=3, require_folds=4)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("interp=0:", {"interp": (0.0, None)}), ("a=-1:2, b=:3", {"a": (-1.0, 2.0), "b": (None, 3.0)}), ("", {})],
)
def test_parse_bounds(text, expected):
    assert tune.parse_bounds(text) == expected


@pytest.mark.parametrize("text", ["interp", "interp=0", "=0:1", "a=x:1", "a=2:1", "a=nan:"])
def test_parse_bounds_names_the_bad_item(text):
    with pytest.raises(ValueError, match="bounds"):
        tune.parse_bounds(text)


def test_contiguous_folds_are_runs_of_consecutive_utterances():
    folds = tune.fold_indices(11, 3, contiguous=True)
    assert [f.tolist() for f in folds] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10]]


def test_costs_start_at_minus_one_so_the_baseline_is_the_cheapest_hypothesis(tmp_path, capsys):
    """Kaldi's ac_cost and lm_cost are negated log-likelihoods: at weight +1 the baseline (and the guard's fallback)
    chose each list's worst hypothesis."""
    from lmserve.rescoring.commands.cli import main
    from lmserve.rescoring.nbest import Hypothesis, NBestEntry, NBestList, write_nbest

    rng = np.random.default_rng(8)
    entries = []
    for i in range(40):
        words = [f"w{int(k)}" for k in rng.integers(0, 30, size=6)]
        texts = [" ".join(words[: 6 - k]) for k in range(4)]  # hypothesis k: k words short of the reference
        hyps = [
            Hypothesis(text, {"ac_cost": 100.0 + 10 * k + float(rng.normal()), "lm_cost": 20.0 + 5 * k}, k + 1)
            for k, text in enumerate(texts)
        ]
        entries.append(NBestEntry(f"utt{i}-1", hyps, [texts[0]]))
    start = tune.start_weights(["ac_cost", "lm_cost", "length"], "ac_cost", None)
    assert start == {"ac_cost": -1.0, "lm_cost": -1.0, "length": 0.0}
    folder = tmp_path / "kaldi"
    write_nbest(NBestList(entries), folder, "kaldi")
    out = tmp_path / "w.json"
    argv = ["tune", str(folder), "--metric", "wer", "--features", "ac_cost,lm_cost", "--restarts", "1"]
    assert main([*argv, "--out", str(out)]) == 0
    assert "wer 0.00 -> 0.00 on the dev list" in capsys.readouterr().out  # the cheapest is the reference
    record = json.loads(out.read_text())
    assert record["weights"]["ac_cost"] == -1.0 and record["baseline_metric"] == 0.0
