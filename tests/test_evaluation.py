"""``lm-rescore evaluate`` and the protocol behind it (``rescoring.evaluation``), on lists generated here: folds of
whole documents, the per-list guard, the baselines that say what the LMs added, MT's best single system, chrF and
the length ratio; the OOV features told apart; ``tune`` on several lists; ``nbest``'s warnings on lists unlike the
ones the weights were tuned on."""

import json

import numpy as np
import pytest
from conftest import make_sentences

from lmserve.rescoring import tune
from lmserve.rescoring.commands.cli import main as rescore_main
from lmserve.rescoring.evaluation import Evaluation, ListData, Recipe, feature_groups, partition, variants
from lmserve.rescoring.features import feature_matrices
from lmserve.rescoring.liststats import compare, list_statistics
from lmserve.rescoring.lmscores import HypothesisScores, LMSums, compute, read_cache, write_cache
from lmserve.rescoring.nbest import Hypothesis, NBestEntry, NBestList, write_nbest
from lmserve.rescoring.ngram import NgramLM, build_ngram
from lmserve.rescoring.rescore import Setup
from lmserve.rescoring.tune import TuningSet

SEARCH = {"restarts": 1, "penalty": 0.0, "bounds": {}}


def noisy_lists(n: int, seed: int, name: str, hyps: int = 5, scale: float = 1.0) -> NBestList:
    """Each reference and hyps-1 copies with 1-2 words replaced by words the n-gram never saw in that place; an
    ``am`` score (times ``scale``) that puts a corrupted copy first about half the time; ``hint`` marks the
    reference in entries with an even id only."""
    rng = np.random.default_rng(seed)
    entries = []
    for i, ref in enumerate(make_sentences(n, seed=seed)):
        words = ref.split()
        texts = [ref]
        for _ in range(hyps - 1):
            w = list(words)
            for _ in range(int(rng.integers(1, 3))):
                w[int(rng.integers(len(w)))] = f"w{int(rng.integers(20, 40))}"
            texts.append(" ".join(w))
        am = rng.normal(0, 1, size=hyps)
        am[0] -= 0.3
        order = np.argsort(-am, kind="stable")
        hyp = [
            Hypothesis(texts[k], {"am": scale * float(am[k]), "hint": float(k == 0 and i % 2 == 0)}, rank=r + 1)
            for r, k in enumerate(order)
        ]
        entries.append(NBestEntry(f"doc{i // 4}-{i}", hyp, [ref]))
    return NBestList(entries, name)


@pytest.fixture(scope="module")
def ngram(tmp_path_factory):
    out = tmp_path_factory.mktemp("ngram") / "train3"
    build_ngram((s.split() for s in make_sentences(300, seed=1)), 3, out, discount_fallback=True)
    return out.with_suffix(".bin")


def scored(nbest: NBestList, ngram_path) -> list:
    from lmserve.core.textnorm import PRESETS

    return compute(nbest, None, NgramLM(ngram_path), PRESETS["none"])


# -- folds and the guard ---------------------------------------------------------------------------------------------


def test_document_folds_keep_documents_whole_and_balanced():
    docs = [f"d{i // 3}" for i in range(30)]  # ten documents of three entries
    docs[29] = "d0"  # a document's entry out of place still goes with it
    folds = tune.fold_indices(30, 3, groups=docs)
    assert sorted(np.concatenate(folds).tolist()) == list(range(30))
    for fold in folds:
        inside = {docs[i] for i in fold}
        assert all(docs[i] not in inside for other in folds if other is not fold for i in other)
    assert {len(f) for f in folds} <= {9, 10, 11, 12}
    with pytest.raises(ValueError, match="cannot cut 2 documents of 4 entries into 3 folds"):
        tune.fold_indices(4, 3, groups=["a", "a", "b", "b"])
    # several lists: fold j holds the j-th fold of each
    parts = partition([10, 20], 2, "contiguous")
    assert parts[0].tolist() == [*range(5), *range(10, 20)] and parts[1].tolist() == [*range(5, 10), *range(20, 30)]


def _two_lists(a: int = 200, b: int = 60) -> tuple[TuningSet, np.ndarray]:
    """One pooled tuning set: list A, where feature ``hint`` marks the right hypothesis, and the smaller list B,
    where it marks a wrong one; the first pass (``base``) right on half of every list."""
    rng = np.random.default_rng(3)
    features, stats, owners = [], [], []
    for owner, n, helps in (("A", a, True), ("B", b, False)):
        for _ in range(n):
            right_first = rng.random() < 0.5
            base = np.array([1.0, 0.0])
            errors = np.array([0, 3]) if right_first else np.array([3, 0])
            right = int(np.argmin(errors))
            hint = np.zeros(2)
            hint[right if helps else 1 - right] = 1.0
            features.append(np.column_stack([base, hint]))
            stats.append(np.column_stack([errors, [10, 10]]))
            owners.append(owner)
    return TuningSet("A+B", ("base", "hint"), "wer", features, stats), np.array(owners)


def test_the_guard_per_list_refuses_weights_that_only_the_union_gains_from():
    data, owners = _two_lists()
    args = {"fixed": "base", "restarts": 1}
    union = tune.tune_guarded(data, 5, 5, **args)
    assert union.adopted and union.result.weights["hint"] > 0  # A carries the union: B gets worse unseen
    per_list = tune.tune_guarded(data, 5, 5, owners=owners, **args)
    assert not per_list.adopted and per_list.result.weights == {"base": 1.0, "hint": 0.0}
    assert per_list.per_list["A"]["improved"] == 5 and per_list.per_list["B"]["improved"] == 0


# -- the evaluation ----------------------------------------------------------------------------------------------


def test_feature_groups_and_variants_drop_only_the_lms_they_remove():
    defs = {"prior": {"rank": -1.0}, "mix": {"neural": 1.0, "am": 1.0}}
    assert feature_groups("oov", defs, has_lm=True) == {"neural"}  # the alias reads the bundle's vocabulary
    assert feature_groups("oov", defs, has_lm=False) == {"ngram"}
    assert feature_groups("interp", defs, True) == {"neural", "ngram"}
    assert feature_groups("mix", defs, True) == {"neural", "first_pass"}
    assert feature_groups("prior", defs, True) == {"first_pass"}
    assert feature_groups("consensus_wer@am", defs, True) == {"consensus"}
    assert feature_groups("sys_A", defs, True) == feature_groups("votes", defs, True) == {"systems"}
    recipe = Recipe(("am", "neural", "ngram", "interp", "oov_lm", "oov_ngram", "length"), "am", defs, (0.5,), SEARCH)
    found, skipped = variants(recipe, has_lm=True, has_ngram=True)
    assert found["no_lm"].recipe.features == ("am", "length")
    assert found["ngram_only"].recipe.features == ("am", "ngram", "oov_ngram", "length")
    assert found["without_ngram"].recipe.features == ("am", "neural", "oov_lm", "length")
    assert found["without_surface"].recipe.features == ("am", "neural", "ngram", "interp", "oov_lm", "oov_ngram")
    assert "without_first_pass" in found and found["without_first_pass"].recipe.fixed == "neural"
    alone, skipped = variants(Recipe(("am", "ngram", "oov"), "am", {}, (0.5,), SEARCH), has_lm=False, has_ngram=True)
    assert alone["no_lm"].recipe.features == ("am",) and "ngram_only" not in alone
    assert "no n-gram" not in skipped["ngram_only"] and "neural" in skipped["ngram_only"]


def test_cross_validation_transfer_and_held_out_say_what_the_ngram_added(ngram):
    lists = [noisy_lists(60, seed, name) for seed, name in ((11, "a"), (12, "b"), (13, "c"))]
    data = [ListData(x.name, x, scored(x, ngram)) for x in lists]
    recipe = Recipe(
        ("am", "ngram", "oov_ngram", "length"), "am", {}, (0.5,), {**SEARCH, "bounds": {"ngram": (0, None)}}
    )
    evaluation = Evaluation(data, "wer", recipe, has_lm=False, has_ngram=True, ablate=())
    cv = evaluation.cross_validation(3, "contiguous", "union", guard=(3, 3))
    for name in ("a", "b", "c"):
        rep = cv["lists"][name]
        systems = rep["systems"]
        assert set(systems) == {"1best", "recipe", "no_lm"}
        assert systems["recipe"]["wer"] < systems["no_lm"]["wer"] and systems["recipe"]["wer"] < systems["1best"]["wer"]
        assert rep["bootstrap"]["recipe_vs_no_lm"]["delta"] < 0 and rep["oracle"] <= systems["recipe"]["wer"]
        assert 0.5 < systems["recipe"]["length_ratio"] < 2 and len(rep["per_fold"]) == 3
        assert all(set(row["guard"]["per_list"]) == {"a", "b", "c"} for row in rep["per_fold"])
    assert cv["union"]["systems"]["recipe"]["wer"] < cv["union"]["systems"]["1best"]["wer"]
    moved = evaluation.transfer()
    assert moved["lists"]["a"]["tuned_on"] == ["b", "c"]
    assert moved["lists"]["a"]["systems"]["recipe"]["wer"] < moved["lists"]["a"]["systems"]["1best"]["wer"]
    held = evaluation.held_out(["a", "b"], ["c"])
    assert held["fits"]["recipe"]["weights"]["ngram"] > 0 and set(held["lists"]) == {"c"}
    ceiling = evaluation.ceilings()["lists"]["c"]["wer"]
    assert ceiling <= cv["lists"]["c"]["systems"]["recipe"]["wer"] + 1e-9  # in-sample: seen the references


def two_hypothesis_lists(n: int = 120, seed: int = 0):
    """n two-hypothesis lists, the first pass right on 70% of them; feature ``good`` marks the right hypothesis,
    ``noise`` is random."""
    rng = np.random.default_rng(seed)
    entries = []
    for i in range(n):
        right, wrong = f"word{i} is right", f"word{i} was wrong here"
        first_right = rng.random() < 0.7
        texts = [right, wrong] if first_right else [wrong, right]
        entries.append(
            NBestEntry(
                f"u{i}",
                [
                    Hypothesis(t, {"good": float(t == right), "noise": float(rng.normal())}, rank=k + 1)
                    for k, t in enumerate(texts)
                ],
                references=[right],
            )
        )
    return NBestList(entries, "synthetic")


@pytest.mark.parametrize("feature", ["good", "noise"])
def test_cross_validation_of_one_list_with_the_guard_nested(feature):
    """With the guard nested, a fold keeps the first pass unless every fold of its training part gains: a feature
    that knows the answer is adopted in every fold, random noise in none (the first pass's WER, exactly)."""
    nbest = two_hypothesis_lists()
    definitions = Setup.parse(f"prior,{feature}", ["prior=-1*rank"]).definitions
    recipe = Recipe(("prior", feature), "prior", definitions, (0.5,), {"restarts": 2})
    evaluation = Evaluation([ListData(nbest.name, nbest, None)], "wer", recipe, False, False, ablate=())
    cv = evaluation.cross_validation(5, "contiguous", guard=(5, 5))
    assert cv["guard"] == {"folds": 5, "required": 5, "per_list": True}
    rep = cv["lists"][nbest.name]
    if feature == "good":
        assert rep["systems"]["recipe"]["wer"] == 0.0 and rep["folds_improved"] == 5
    else:
        assert rep["systems"]["recipe"]["wer"] == rep["systems"]["1best"]["wer"] > 0
        assert all(fold["weights"] == {"prior": 1.0, "noise": 0.0} for fold in rep["per_fold"])


def mt_lists(n: int, seed: int) -> NBestList:
    """Three systems' outputs: C always right, A right half the time, B never; ``sys_*`` indicators and votes."""
    rng = np.random.default_rng(seed)
    entries = []
    for i, ref in enumerate(make_sentences(n, seed=seed)):
        wrong = ref + " w39"
        outputs = {"A": ref if rng.random() < 0.5 else wrong, "B": wrong + " w38", "C": ref}
        texts = list(dict.fromkeys(outputs.values()))
        hyps = []
        for k, text in enumerate(texts):
            by = {f"sys_{s}": float(o == text) for s, o in outputs.items()}
            hyps.append(Hypothesis(text, {"votes": sum(by.values()), **by}, rank=k + 1))
        entries.append(NBestEntry(str(i), hyps, [ref, ref], source=ref))
    return NBestList(entries, "mt")


def test_mt_lists_report_chrf_length_ratio_and_the_best_single_system(tmp_path, capsys):
    path = tmp_path / "mt.jsonl"
    write_nbest(mt_lists(40, 5), path, "jsonl")
    out = tmp_path / "eval.json"
    args = ["evaluate", str(path), "--metric", "bleu", "--features", "votes,length,sys_*", "--cv", "4"]
    assert rescore_main([*args, "--restarts", "1", "--quiet", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "chrF" in table and "best_system" in table and "diagnostic" in table
    result = json.loads(out.read_text())
    assert result["recipe"]["features"] == ["votes", "length", "sys_A", "sys_B", "sys_C"]
    rep = result["cross_validation"]["lists"]["mt"]
    assert rep["best_system"] == "C" and rep["systems"]["best_system"]["bleu"] == pytest.approx(100)
    assert rep["systems"]["recipe"]["bleu"] == pytest.approx(100) and rep["folds_beating_best"] == 4
    assert {"bleu", "chrf", "length_ratio"} <= set(rep["systems"]["1best"])
    assert rep["systems"]["1best"]["length_ratio"] > 1  # the first system, A, adds a word half the time
    assert result["chrf_signature"].startswith("nrefs:2")
    assert result["command"].startswith("lm-rescore evaluate ") and "sys_*" in result["command"]
    assert result["in_sample_ceiling"]["diagnostic"]


def test_cli_protocols_together_and_its_errors(ngram, tmp_path, capsys):
    paths = []
    for seed, name in ((31, "x"), (32, "y"), (33, "z")):
        paths.append(tmp_path / f"{name}.jsonl")
        write_nbest(noisy_lists(40, seed, name), paths[-1], "jsonl")
    out = tmp_path / "eval.json"
    common = ["--metric", "wer", "--features", "am,ngram,oov,length", "--ngram", str(ngram), "--restarts", "1"]
    args = ["evaluate", str(paths[0]), f"why={paths[1]}", *common, "--tune", str(paths[2]), "--cv", "2"]
    args += ["--fold-mode", "document", "--document-id", r"^(doc\d+)-", "--transfer", "--first-pass", "am"]
    assert rescore_main([*args, "--guard", "2", "--quiet", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["lists"]) == {"x", "why", "z"} and result["lists"]["z"]["role"] == "tune"
    assert set(result["cross_validation"]["lists"]) == set(result["transfer"]["lists"]) == {"x", "why"}
    assert result["held_out"]["tuned_on"] == ["z"] and result["variants"]["first_pass"]["features"] == ["am"]
    assert result["cross_validation"]["mode"] == "document" and (tmp_path / "x.lmscores.jsonl").exists()
    assert "recipe_vs_no_lm" in result["cross_validation"]["lists"]["x"]["bootstrap"]
    assert "ngram_only" in result["skipped"]
    capsys.readouterr()
    for flags, message in (
        (["--fold-mode", "document"], "--fold-mode document needs --document-id"),
        (["--require-folds", "2"], "--require-folds without --guard"),
        (["--ablate", "lm"], "unknown group 'lm'"),
        (["--features", "am,neural"], "feature 'neural' needs a neural LM bundle"),
        (["--first-pass", "ngram"], "a first-pass baseline reads no LM"),
        (["--transfer-pool", "nope", "--transfer"], "--transfer-pool: no list named 'nope'"),
    ):
        base = ["evaluate", str(paths[0]), str(paths[1]), *common, "--quiet"]
        try:
            code = rescore_main([*base, *flags])
        except SystemExit as refused:  # refused as argparse refuses (command.parse_args)
            code = refused.code
        assert code == 2, flags
        assert message in capsys.readouterr().err


# -- the OOV features ------------------------------------------------------------------------------------------------


def test_oov_lm_and_oov_ngram_are_told_apart_and_oov_keeps_its_meaning(ngram, tmp_path):
    nbest = NBestList([NBestEntry("u", [Hypothesis("w1 w2 qq"), Hypothesis("w1 w2")])], "n")
    both = [[HypothesisScores(np.zeros(4), np.zeros(4), 2, 1), HypothesisScores(np.zeros(3), np.zeros(3), 0, 0)]]
    (x,) = feature_matrices(nbest, ["oov", "oov_lm", "oov_ngram"], both)
    assert x.tolist() == [[2, 2, 1], [0, 0, 0]]  # with a bundle, oov is the bundle's count
    alone = scored(nbest, ngram)  # the n-gram alone: oov is its count
    (x,) = feature_matrices(nbest, ["oov", "oov_ngram"], alone)
    assert x.tolist() == [[1, 1], [0, 0]]
    with pytest.raises(ValueError, match="'oov_lm': no neural LM bundle scored these lists"):
        feature_matrices(nbest, ["oov_lm"], alone)
    sums = LMSums(None, np.zeros(2), None, None, np.array([1, 0]), np.array([4, 3]), None, np.array([1, 0]))
    assert sums.column("oov_ngram", None).tolist() == [1, 0]
    with pytest.raises(ValueError, match="'oov_lm': that LM was not given"):
        sums.column("oov_lm", None)
    cache = tmp_path / "c.lmscores.jsonl"
    write_cache(cache, {"k": 1}, nbest, both)
    assert [h.oov_ngram for h in read_cache(cache, {"k": 1})[0]] == [1, 0]
    lines = cache.read_text().splitlines()  # a line written before oov_ngram was kept: not known with a bundle
    old = json.loads(lines[1])
    for h in old["hypotheses"]:
        del h["oov_ngram"]
    cache.write_text("\n".join([lines[0], json.dumps(old)]) + "\n")
    assert [h.oov_ngram for h in read_cache(cache, {"k": 1})[0]] == [None, None]


# -- tune on several lists, nbest's warnings -------------------------------------------------------------------------


def test_tune_several_lists_records_what_the_lms_added_and_nbest_warns_of_other_lists(ngram, tmp_path, capsys):
    dev = []
    for seed, name in ((41, "deva"), (42, "devb")):
        dev.append(tmp_path / f"{name}.jsonl")
        write_nbest(noisy_lists(40, seed, name), dev[-1], "jsonl")
    weights = tmp_path / "w.json"
    args = ["tune", *map(str, dev), "--metric", "wer", "--features", "am,ngram,length", "--fixed", "am"]
    args += ["--ngram", str(ngram), "--restarts", "1", "--cv", "3", "--require-folds", "3", "--quiet"]
    assert rescore_main([*args, "--out", str(weights)]) == 0
    printed = capsys.readouterr().out
    assert "what the LMs added" in printed and "no_lm (without ngram)" in printed
    record = json.loads(weights.read_text())
    assert record["dev_set"] == "deva+devb" and record["dev_lists"] == {"deva": 40, "devb": 40}
    assert set(record["cross_validation"]["per_list"]) == {"deva", "devb"}
    added = record["lms_added"]
    assert added["no_lm"]["features"] == ["am", "length"] and "bootstrap" in added["no_lm"]
    assert added["recipe"]["heldout_metric"] < added["no_lm"]["heldout_metric"]
    assert record["list_statistics"]["hypotheses_per_entry"]["mean"] == 5
    assert set(record["list_statistics"]["features"]) == {"am"}
    assert (tmp_path / "deva.lmscores.jsonl").exists() and (tmp_path / "devb.lmscores.jsonl").exists()

    same, other = tmp_path / "same.jsonl", tmp_path / "other.jsonl"
    write_nbest(noisy_lists(30, 43, "same"), same, "jsonl")
    write_nbest(noisy_lists(30, 44, "other", hyps=2, scale=10.0), other, "jsonl")
    for path, warned in ((same, False), (other, True)):
        rep = tmp_path / f"{path.stem}.report.json"
        run = ["nbest", str(path), "--weights", str(weights), "--out", str(tmp_path / f"{path.stem}.out.jsonl")]
        assert rescore_main([*run, "--report", str(rep), "--quiet"]) == 0
        captured = capsys.readouterr()
        report = json.loads(rep.read_text())
        assert bool(report["list_statistics"]["warnings"]) == warned
        assert ("hypotheses per entry" in captured.err) == warned and ("feature 'am'" in captured.err) == warned
        assert report["lms_added"]["on_this_list"]["lm_features"] == ["ngram"]
        assert "without the LM terms" in captured.out and report["lms_added"]["at_tune_time"] == added
    with pytest.raises(SystemExit):
        rescore_main([*args, "--cache", str(tmp_path / "c.jsonl"), "--out", str(weights)])
    assert "--cache with several lists" in capsys.readouterr().err


def test_list_statistics_compare():
    tuned = list_statistics(noisy_lists(30, 1, "t"), ["am"])
    assert compare(tuned, list_statistics(noisy_lists(30, 2, "s"), ["am"])) == []
    shifted = noisy_lists(30, 2, "s")
    for entry in shifted:
        for h in entry.hypotheses:
            h.features["am"] += 100
    (warning,) = compare(tuned, list_statistics(shifted, ["am"]))
    assert "outside" in warning and "'am'" in warning


def test_with_a_bundle_the_ngram_only_baseline_and_a_bundle_alone(bundles, ngram, tmp_path, capsys):
    """Both LMs: ``ngram_only`` drops what needs the bundle (``neural``, ``oov_lm``, and ``oov``, which then means
    the bundle's count) and keeps the n-gram's; a bundle alone has no n-gram-only system to compare with."""
    lists = tmp_path / "dev.jsonl"
    write_nbest(noisy_lists(30, 51, "dev"), lists, "jsonl")
    bundle = str(bundles[("full", 0.0)][1])
    out = tmp_path / "both.json"
    common = ["evaluate", str(lists), "--metric", "wer", "--lm", bundle, "--restarts", "1", "--cv", "3", "--quiet"]
    features = ["--features", "am,neural,ngram,oov,oov_ngram,length", "--fixed", "am", "--ablate", "none"]
    assert rescore_main([*common, "--ngram", str(ngram), *features, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["variants"]["ngram_only"]["features"] == ["am", "ngram", "oov_ngram", "length"]
    assert result["variants"]["no_lm"]["features"] == ["am", "length"]
    assert {"recipe_vs_no_lm", "recipe_vs_ngram_only"} <= set(result["cross_validation"]["lists"]["dev"]["bootstrap"])
    alone = tmp_path / "alone.json"
    assert rescore_main([*common, "--features", "am,neural,oov_lm", "--out", str(alone)]) == 0
    result = json.loads(alone.read_text())
    assert set(result["variants"]) == {"recipe", "no_lm", "without_first_pass"}
    assert result["skipped"]["ngram_only"] == "no n-gram"
    capsys.readouterr()
