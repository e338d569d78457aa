"""lm-train export of the class, tree, slim and char-CNN heads, slim input embeddings and sampled objectives: each trains one epoch on the
generated corpus, exports (which runs the held-out parity check, |Δ| <= 1e-4), and its graphs match PyTorch.

Beside tests/test_export.py (whose bundles come from conftest.BUNDLE_HEADS) so that these rows carry their own
head and objective settings."""

import numpy as np
import onnxruntime as ort
import pytest
import torch
from conftest import (
    fit_and_export,
    head_overrides,
    sentence_batch,
    tiny_config_text,
    write_splits,
)

from lmserve.core.bundle import Bundle
from lmserve.training.checkpoint import load_model_for_eval
from lmserve.training.export import SentencesGraph, StepGraph

pytestmark = pytest.mark.slow  # eleven models trained and exported

# name -> (head settings, objective settings, self-normalised)
ROWS = {
    "class": ({"type": "class", "bias_init": "unigram", "classes": 6}, {}, False),
    "class-selfnorm": ({"type": "class", "bias_init": "unigram", "classes": 6}, {"selfnorm_alpha": 0.5}, True),
    # classes clustered from the "class" row's trained embeddings ({runs}: this module's run folder)
    "class-clustered": (
        {"type": "class", "bias_init": "unigram", "classes": 6, "class_embeddings": "{runs}/class"},
        {},
        False,
    ),
    "tree": ({"type": "tree", "bias_init": "unigram"}, {}, False),
    # a Huffman code placed by the "class" row's embeddings
    "tree-huffman-clustered": (
        {"type": "tree", "bias_init": "unigram", "tree": "huffman_clustered", "tree_embeddings": "{runs}/class"},
        {},
        False,
    ),
    "slim": ({"type": "slim", "slim_subvectors": 4, "slim_pool": 32}, {}, False),
    "full-nce": (
        {"type": "full", "bias_init": "unigram", "log_z": 3.0, "learn_log_z": True},
        {"type": "nce", "samples": 20},
        True,
    ),
    "slim-is": (
        {"type": "slim", "bias_init": "unigram", "slim_subvectors": 4, "slim_pool": 32},
        {"type": "importance_sampling", "samples": 20},
        True,
    ),
    "slim-input": ({"type": "full"}, {}, False),
    "charcnn": ({"type": "charcnn", "charcnn_size": 8, "charcnn_widths": [1, 2]}, {}, False),
    "charcnn-is": (
        {"type": "charcnn", "bias_init": "unigram", "charcnn_size": 8, "charcnn_widths": [1, 2]},
        {"type": "importance_sampling", "samples": 20},
        True,
    ),
}
# [model] settings of a row, beside the tiny config's
MODEL = {"slim-input": {"input_slim_subvectors": 4, "input_slim_pool": 32}}

SENTENCES = [[5, 9, 3, 14], [7], [], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32]]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("head_bundles")
    corpus = write_splits(root)
    made = {}
    for name, (head, objective, _) in ROWS.items():
        text = tiny_config_text(
            corpus, "sentence", head["type"], train={"epochs": 1}, objective=objective, model=MODEL.get(name, {})
        )
        made[name] = fit_and_export(root, name, text, head_overrides(head, root))
    return made


def run(bundle: Bundle, graph: str, feed: dict) -> list[np.ndarray]:
    session = ort.InferenceSession(str(bundle.graph_path(graph)), providers=["CPUExecutionProvider"])
    layers, hidden = bundle.manifest["model"]["layers"], bundle.manifest["model"]["hidden_size"]
    for name in (i.name for i in session.get_inputs()):  # a start state, for graphs that take one
        if name not in feed:
            feed[name] = np.zeros((layers, len(feed["lengths"]), hidden), dtype=np.float32)
    return session.run(None, feed)


@pytest.mark.parametrize("name", list(ROWS))
def test_new_heads_and_objectives_export_and_match_pytorch(exported, name):
    run_dir, path = exported[name]
    head, _, self_normalised = ROWS[name]
    bundle = Bundle.load(path)
    assert bundle.manifest["head"] == head["type"]
    assert bundle.normalised is (not self_normalised)
    held = bundle.manifest["heldout"]
    assert held["max_abs_diff"] <= 1e-4
    if not self_normalised:
        assert held["score_ppl"] == pytest.approx(held["ppl"], rel=1e-4)
    _, _, model = load_model_for_eval(run_dir)
    model.eval()

    inputs, targets, lengths = sentence_batch(SENTENCES)
    got = run(bundle, "sentences", {"input_ids": inputs, "target_ids": targets, "lengths": lengths})[0]
    with torch.no_grad():
        want = SentencesGraph(model, self_normalised)(*map(torch.from_numpy, (inputs, targets, lengths))).numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)

    layers, hidden = bundle.manifest["model"]["layers"], bundle.manifest["model"]["hidden_size"]
    h = np.random.default_rng(0).normal(size=(layers, 3, hidden)).astype(np.float32)
    c = np.random.default_rng(1).normal(size=(layers, 3, hidden)).astype(np.float32)
    prev = np.array([1, 5, 9], dtype=np.int64)
    candidates = np.array([[3, 4], [2, 40], [0, 11]], dtype=np.int64)
    step = run(bundle, "step", {"prev_ids": prev, "h": h, "c": c, "candidates": candidates})
    full = run(bundle, "step_full", {"prev_ids": prev, "h": h, "c": c})
    with torch.no_grad():
        t = [torch.from_numpy(x) for x in (prev, h, c, candidates)]
        want_step = StepGraph(model, self_normalised, full=False)(*t)
        want_full = StepGraph(model, self_normalised, full=True)(*t[:3])
    for a, b in zip(step + full, [*want_step, *want_full], strict=True):
        np.testing.assert_allclose(a, b.numpy(), atol=1e-4, rtol=0)
    assert full[0].shape == (3, bundle.manifest["vocab"]["size"])
    np.testing.assert_allclose(np.take_along_axis(full[0], candidates, 1), step[0], atol=1e-5)
    if not self_normalised:
        np.testing.assert_allclose(np.logaddexp.reduce(full[0], axis=1), 0, atol=1e-4)  # a distribution
