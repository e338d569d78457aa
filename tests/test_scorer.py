"""The torch-free scorer: same numbers as the trained model, batching and prefix sharing change nothing."""

import json
import math
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import BUNDLE_HEADS

from lmserve.core.bundle import BundleError, sha256_file
from lmserve.core.textnorm import TextNormalizer
from lmserve.rescoring.commands.cli import main as rescore_main
from lmserve.rescoring.scorer import Scorer
from lmserve.training.checkpoint import load_model_for_eval
from lmserve.training.export import SentencesGraph, export_onnx

SENTENCES = ["w1 w2 w3", "w5", "", "w0 w7 w7 w7 w2 w9 w11 w3 w1 w4 w4 w20", "w1 zzz w2 qqq", "w3 w2"]


def torch_scores(run, self_normalised, sentences):
    """The reference: the PyTorch model through the same sentence function, one sentence at a time."""
    _, vocab, model = load_model_for_eval(run)
    model.eval()
    out = []
    for text in sentences:
        ids = [vocab.index.get(w, vocab.unk_id) for w in text.split()]
        inputs = torch.tensor([[vocab.bos_id, *ids]])
        targets = torch.tensor([[*ids, vocab.eos_id]])
        with torch.no_grad():
            out.append(SentencesGraph(model, self_normalised)(inputs, targets, torch.tensor([len(ids) + 1]))[0].numpy())
    return out


@pytest.mark.parametrize(("head", "alpha"), BUNDLE_HEADS)
def test_scores_match_the_pytorch_model(bundles, head, alpha):
    run, bundle = bundles[(head, alpha)]
    scorer = Scorer(bundle, threads=1)
    assert scorer.normalised is (alpha == 0)
    got = scorer.score(SENTENCES)
    for text, score, want in zip(SENTENCES, got, torch_scores(run, alpha > 0, SENTENCES), strict=True):
        assert score.words == text.split()
        assert len(score.token_logprobs) == len(text.split()) + 1
        np.testing.assert_allclose(score.token_logprobs, want, atol=1e-4)
        assert score.log10prob == pytest.approx(score.logprob / math.log(10))
    assert [s.oov for s in got] == [0, 0, 0, 0, 2, 0]


def test_batching_does_not_change_scores(bundles):
    scorer = Scorer(bundles[("adaptive", 0.0)][1], threads=1)
    together = scorer.score(SENTENCES * 5)
    scorer.max_batch_tokens = 4  # every sentence nearly alone
    apart = scorer.score(SENTENCES * 5)
    for a, b in zip(together, apart, strict=True):
        np.testing.assert_allclose(a.token_logprobs, b.token_logprobs, atol=1e-5)


@pytest.mark.parametrize(("head", "alpha"), BUNDLE_HEADS)
@pytest.mark.parametrize("tails", [False, True], ids=["stepped", "tails"])
def test_prefix_sharing_gives_the_scores_of_each_hypothesis_alone(bundles, head, alpha, tails):
    scorer = Scorer(bundles[(head, alpha)][1], threads=1, max_batch_tokens=2 if tails else 0)
    if tails:
        scorer.tails_min_batches = 1  # 2 tail tokens are enough
    lists = [
        ["w1 w2 w3 w4", "w1 w2 w3 w5", "w1 w2 w3", "w1 w2 w3 w4", "w2", ""],  # shared prefixes, a repeat, empty
        ["w7 zzz w8", "w7 zzz w9 w9"],
        ["w3"],
    ]
    scorer.stats.lstm_steps = 0
    sentences_runs = []  # the tails go through the sentences graph, and only they
    run_sentences = scorer.sessions["sentences"].run
    scorer.sessions["sentences"].run = lambda *args: sentences_runs.append(1) or run_sentences(*args)
    shared = scorer.score_nbest(lists, max_batch_rows=3)
    scorer.sessions["sentences"].run = run_sentences
    assert bool(sentences_runs) == tails
    steps_shared = scorer.stats.lstm_steps
    alone = [scorer.score(hyps) for hyps in lists]
    steps_alone = scorer.stats.lstm_steps - steps_shared
    for got_list, want_list in zip(shared, alone, strict=True):
        for got, want in zip(got_list, want_list, strict=True):
            assert got.words == want.words and got.oov == want.oov
            np.testing.assert_allclose(got.token_logprobs, want.token_logprobs, atol=1e-4)
    # one step per distinct prefix that something follows; alone, one per word and </s> of every hypothesis
    # list 1: <s> | w1 | w1 w2 | w1 w2 w3 | w1 w2 w3 w4 | w1 w2 w3 w5 | w2    list 2: <s> | w7 | w7 zzz | ... (6)
    assert steps_shared == 7 + 6 + 2 and steps_alone == 22 + 9 + 2
    assert scorer.score_nbest([]) == [] and scorer.score_nbest([[]]) == [[]]


def test_lowercasing_follows_the_bundle(bundles, tmp_path):
    path = tmp_path / "lower"
    shutil.copytree(bundles[("full", 0.0)][1], path)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["text"]["lowercase"] = True
    (path / "manifest.json").write_text(json.dumps(manifest))
    lower, plain = Scorer(path, threads=1), Scorer(bundles[("full", 0.0)][1], threads=1)
    assert lower.score(["W1 W2"])[0].logprob == pytest.approx(plain.score(["w1 w2"])[0].logprob)
    assert plain.score(["W1 W2"])[0].oov == 2


def test_a_caller_normaliser_replaces_the_bundles(bundles):
    bundle = bundles[("full", 0.0)][1]
    upper = Scorer(bundle, threads=1, normalizer=TextNormalizer(case="lower", punctuation="strip"))
    plain = Scorer(bundle, threads=1)
    assert upper.encode("W1, W2!")[0] == ["w1", "w2"]
    assert upper.score(["W1, W2!"])[0].logprob == pytest.approx(plain.score(["w1 w2"])[0].logprob)


def test_unknown_text_settings_in_the_manifest_are_a_bundle_error(bundles, tmp_path):
    path = tmp_path / "badtext"
    shutil.copytree(bundles[("full", 0.0)][1], path)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["text"] = {"tokenizer": "sentencepiece"}
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="manifest.json: text section: tokenizer"):
        Scorer(path, threads=1)


def test_graph_that_does_not_fit_the_vocabulary_is_an_error(bundles, tmp_path):
    """A step_full graph from another bundle with another vocabulary (checksums updated, so only the shapes tell)."""
    path = tmp_path / "mixed"
    shutil.copytree(bundles[("full", 0.0)][1], path)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["vocab"]["size"] = 7
    (path / "vocab.tsv").write_text("#lmserve-vocab v1\n<unk>\t0\n<s>\t0\n</s>\t0\na\t1\nb\t1\nc\t1\nd\t1\n")
    import hashlib

    manifest["files"]["vocab.tsv"] = hashlib.sha256((path / "vocab.tsv").read_bytes()).hexdigest()
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="step_full.onnx: scores 43 words, the vocabulary has 7"):
        Scorer(path, threads=1)


def test_scorer_never_imports_torch(bundles):
    code = (
        "import sys; from lmserve.rescoring.scorer import Scorer; "
        f"s = Scorer({str(bundles[('adaptive', 0.5)][1])!r}, threads=1); "
        "s.score(['w1 w2']); s.score_nbest([['w1', 'w1 w2']]); "
        "assert 'torch' not in sys.modules, 'torch was imported'; print('ok')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_lm_rescore_score_cli(bundles, tmp_path, capsys, monkeypatch):
    bundle = str(bundles[("full", 0.0)][1])
    text = tmp_path / "in.txt"
    text.write_text("w1 w2\nw3 zzz\n\n")
    assert rescore_main(["score", "--lm", bundle, "--input", str(text), "--threads", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    want = Scorer(bundle, threads=1).score(["w1 w2", "w3 zzz", ""])
    assert [float(x) for x in lines] == pytest.approx([s.logprob for s in want], abs=1e-5)
    assert rescore_main(["score", "--lm", bundle, "--input", str(text), "--per-token", "--log10"]) == 0
    first = capsys.readouterr().out.splitlines()[0].split("\t")
    assert float(first[0]) == pytest.approx(want[0].log10prob, abs=1e-5)
    assert [p.split("=")[0] for p in first[1].split()] == ["w1", "w2", "</s>"]
    assert rescore_main(["score", "--lm", bundle, "--input", str(text), "--format", "jsonl", "--per-token"]) == 0
    record = json.loads(capsys.readouterr().out.splitlines()[1])
    assert record["oov"] == 1 and record["tokens"][1][0] == "zzz"
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok\n\xff\n")
    assert rescore_main(["score", "--lm", bundle, "--input", str(bad)]) == 2
    assert "bad.txt:2: not valid UTF-8" in capsys.readouterr().err
    assert rescore_main(["score", "--lm", str(tmp_path), "--input", str(text)]) == 2
    assert "not a model bundle" in capsys.readouterr().err


def test_format_1_bundles_still_score_and_share_prefixes(bundles, tmp_path):
    """Version 1 sentences graphs have no h0/c0: the scorer steps through every prefix instead of running tails."""
    run, bundle = bundles[("adaptive", 0.0)]
    old = tmp_path / "v1"
    shutil.copytree(bundle, old)
    _, _, model = load_model_for_eval(run)
    ids = torch.tensor([[1, 5, 6], [1, 7, 2]])
    time_axes = {0: "batch", 1: "time"}
    axes = {"input_ids": time_axes, "target_ids": time_axes, "lengths": {0: "batch"}, "logprobs": time_axes}
    inputs = (ids, ids.roll(-1, 1), torch.tensor([3, 2]))
    names = ["input_ids", "target_ids", "lengths"]
    export_onnx(SentencesGraph(model.eval(), False), inputs, old / "sentences.onnx", names, ["logprobs"], axes)
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["format_version"] = 1
    manifest["files"]["sentences.onnx"] = sha256_file(old / "sentences.onnx")
    (old / "manifest.json").write_text(json.dumps(manifest))
    v1, v2 = Scorer(old, threads=1, max_batch_tokens=2), Scorer(bundle, threads=1, max_batch_tokens=2)
    v1.tails_min_batches = v2.tails_min_batches = 1  # 2 tail tokens are enough
    assert not v1.continues_from_state and v2.continues_from_state
    lists = [["w1 w2 w3 w4 w5 w6", "w1 w2 w9 w4 w5", "w1 w3", "w1 w2 w9 w4 w5"], ["w4 w4 w4 w4 w4 w4 w4"]]
    for got, want in zip(sum(v1.score_nbest(lists), []), sum(v2.score_nbest(lists), []), strict=True):
        np.testing.assert_allclose(got.token_logprobs, want.token_logprobs, atol=1e-5)
