"""lm-train export: every head exports, ONNX Runtime matches PyTorch, the bundle validates on load."""

import json
import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from conftest import BUNDLE_HEADS, sentence_batch

from lmserve.core.bundle import Bundle, BundleError
from lmserve.training.checkpoint import load_model_for_eval
from lmserve.training.cli import main
from lmserve.training.export import SentencesGraph, StepGraph


def session(bundle: Bundle, graph: str) -> ort.InferenceSession:
    return ort.InferenceSession(str(bundle.graph_path(graph)), providers=["CPUExecutionProvider"])


SENTENCES = [[5, 9, 3, 14], [7], [], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32]]


@pytest.mark.parametrize(("head", "alpha"), BUNDLE_HEADS)
def test_every_head_exports_and_matches_pytorch(bundles, head, alpha):
    run, path = bundles[(head, alpha)]
    bundle = Bundle.load(path)
    assert bundle.manifest["head"] == head
    assert bundle.normalised is (alpha == 0)
    held = bundle.manifest["heldout"]
    assert held["max_abs_diff"] <= 1e-4
    if alpha == 0:
        assert held["score_ppl"] == pytest.approx(held["ppl"], rel=1e-4)
    _, _, model = load_model_for_eval(run)
    model.eval()
    inputs, targets, lengths = sentence_batch(SENTENCES)
    layers, hidden = bundle.manifest["model"]["layers"], bundle.manifest["model"]["hidden_size"]
    zeros = np.zeros((layers, len(lengths), hidden), dtype=np.float32)
    state = np.random.default_rng(2).normal(size=(2, layers, len(lengths), hidden)).astype(np.float32)
    for h0, c0 in ((zeros, zeros), state):  # whole sentences, and tails continuing from a given state
        feed = {"input_ids": inputs, "target_ids": targets, "lengths": lengths, "h0": h0, "c0": c0}
        got = session(bundle, "sentences").run(None, feed)[0]
        with torch.no_grad():
            want = SentencesGraph(model, alpha > 0)(*map(torch.from_numpy, feed.values())).numpy()
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
        assert np.all(got[2, 1:] == 0) and np.all(got[1, 2:] == 0)  # padding scores nothing

    h = np.random.default_rng(0).normal(size=(layers, 3, hidden)).astype(np.float32)
    c = np.random.default_rng(1).normal(size=(layers, 3, hidden)).astype(np.float32)
    prev = np.array([1, 5, 9], dtype=np.int64)
    candidates = np.array([[3, 4], [2, 40], [0, 11]], dtype=np.int64)
    step = session(bundle, "step").run(None, {"prev_ids": prev, "h": h, "c": c, "candidates": candidates})
    full = session(bundle, "step_full").run(None, {"prev_ids": prev, "h": h, "c": c})
    with torch.no_grad():
        t = [torch.from_numpy(x) for x in (prev, h, c, candidates)]
        want_step = StepGraph(model, alpha > 0, full=False)(*t)
        want_full = StepGraph(model, alpha > 0, full=True)(*t[:3])
    for a, b in zip(step + full, [*want_step, *want_full], strict=True):
        np.testing.assert_allclose(a, b.numpy(), atol=1e-4, rtol=0)
    assert full[0].shape == (3, bundle.manifest["vocab"]["size"])
    np.testing.assert_allclose(np.take_along_axis(full[0], candidates, 1), step[0], atol=1e-5)
    if alpha == 0:
        np.testing.assert_allclose(np.logaddexp.reduce(full[0], axis=1), 0, atol=1e-4)  # a distribution


@pytest.mark.parametrize(("head", "alpha"), [("adaptive", 0.0), ("full", 0.5)])
def test_step_scores_summed_word_by_word_equal_the_sentence_score(bundles, head, alpha):
    bundle = Bundle.load(bundles[(head, alpha)][1])
    words = SENTENCES[0]
    step = session(bundle, "step")
    shape = (bundle.manifest["model"]["layers"], 1, bundle.manifest["model"]["hidden_size"])
    h = c = np.zeros(shape, dtype=np.float32)
    total, prev = 0.0, 1
    for word in [*words, 2]:
        scores, h, c = step.run(None, {"prev_ids": np.array([prev]), "h": h, "c": c, "candidates": np.array([[word]])})
        total += float(scores[0, 0])
        prev = word
    inputs, targets, lengths = sentence_batch([words])
    feed = {"input_ids": inputs, "target_ids": targets, "lengths": lengths, "h0": np.zeros(shape, np.float32)}
    sentence = session(bundle, "sentences").run(None, {**feed, "c0": feed["h0"]})[0]
    assert total == pytest.approx(float(sentence.sum()), abs=1e-4)


def test_int8_export_quantises_and_stays_close(bundles, tmp_path):
    run, _ = bundles[("full", 0.0)]
    assert main(["export", "--checkpoint", str(run), "--out", str(tmp_path / "int8"), "--quantize", "int8"]) == 0
    int8 = Bundle.load(tmp_path / "int8")
    assert int8.manifest["quantization"] == "int8-dynamic"
    ops = {node.op_type for node in onnx.load(int8.graph_path("sentences")).graph.node}
    assert {"DynamicQuantizeLSTM", "DynamicQuantizeLinear"} <= ops  # the LSTM and the output layer run in int8
    held = int8.manifest["heldout"]
    assert held["score_ppl"] == pytest.approx(held["ppl"], rel=0.05)


def test_bundle_validation_names_what_is_wrong(bundles, tmp_path):
    good = bundles[("full", 0.0)][1]

    def damaged(change) -> str:
        path = tmp_path / f"b{len(list(tmp_path.iterdir()))}"
        shutil.copytree(good, path)
        change(path)
        with pytest.raises(BundleError) as info:
            Bundle.load(path)
        return str(info.value)

    def edit_manifest(**fields):
        def change(path):
            manifest = json.loads((path / "manifest.json").read_text())
            manifest.update(fields)
            (path / "manifest.json").write_text(json.dumps(manifest))

        return change

    assert "step.onnx: missing" in damaged(lambda p: (p / "step.onnx").unlink())
    assert "sha256 does not match" in damaged(
        lambda p: (p / "vocab.tsv").write_text((p / "vocab.tsv").read_text() + "extra\t1\n")
    )
    assert "format_version 4 is not supported" in damaged(edit_manifest(format_version=4))
    assert "'normalisation' is 'approximate'" in damaged(edit_manifest(normalisation="approximate"))
    assert "vocab.size says 99" in damaged(edit_manifest(vocab={**Bundle.load(good).manifest["vocab"], "size": 99}))
    assert "not valid JSON" in damaged(lambda p: (p / "manifest.json").write_text("{"))
    assert "not a model bundle" in damaged(lambda p: (p / "manifest.json").unlink())


@pytest.mark.parametrize(("section", "field"), [("vocab", "size"), ("model", "layers"), ("model", "hidden_size")])
def test_a_bundle_error_names_the_whole_field(tmp_path, bundles, section, field):
    bundle = tmp_path / "bundle"
    shutil.copytree(bundles[("full", 0.0)][1], bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest[section][field] = 0
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match=rf"field '{section}\.{field}' = 0: expected a positive integer"):
        Bundle.load(bundle)
