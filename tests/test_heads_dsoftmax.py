"""Differentiated softmax: each frequency band of the vocabulary reads its own segment of the hidden state
(``head.band_widths``, ``head.band_layout``); its chunked training terms against the full logits, and its settings.
The generic head contract (normalisation, target terms, bf16, bias init) runs over it in tests/test_heads.py."""

import pytest
import torch

from lmserve.training.heads import DSoftmax, dsoftmax
from lmserve.training.heads.base import LinearHead

V, D, N = 60, 12, 40


@pytest.mark.parametrize("layout, widths", [("disjoint", [6, 4, 2]), ("nested", [12, 5, 2])])
def test_dsoftmax_bands_read_their_segment_of_the_hidden_state(layout, widths):
    torch.manual_seed(0)
    head = DSoftmax(D, V, [8, 20], widths, layout)
    hidden = torch.randn(N, D)
    vectors, bias = head.output_vectors(torch.arange(V))
    torch.testing.assert_close(hidden @ vectors.T + bias, head.logits(hidden))
    starts = [0, 6, 10] if layout == "disjoint" else [0, 0, 0]
    for band, (a, b) in enumerate([(0, 8), (8, 20), (20, V)]):
        inside = torch.zeros(D, dtype=torch.bool)
        inside[starts[band] : starts[band] + widths[band]] = True
        assert torch.all(vectors[a:b, ~inside] == 0) and torch.all(vectors[a:b, inside] != 0)
    # as many parameters as multiply-adds per position: Σ |band| · width, and a bias per word
    assert sum(p.numel() for p in head.parameters()) == 8 * widths[0] + 12 * widths[1] + 40 * widths[2] + V
    empty, empty_bias = head.output_vectors(torch.zeros(0, dtype=torch.long))
    assert empty.shape == (0, D) and empty_bias.shape == (0,)


def test_dsoftmax_samples_get_gradients_only_in_their_band():
    torch.manual_seed(1)
    head = DSoftmax(D, V, [8, 20], [6, 4, 2])
    head.init_bias(torch.full((V,), -torch.log(torch.tensor(float(V)))))
    target, sampled = head.sampled_scores(torch.randn(4, D), torch.tensor([1, 9, 30, 59]), torch.tensor([2, 25]))
    (target.sum() + sampled.sum()).backward()
    grads = [w.grad for w in head.weights]
    assert grads[0][[1, 2]].abs().sum() > 0 and grads[0][[0, 3, 4]].abs().sum() == 0
    assert grads[1][1].abs().sum() > 0 and grads[2][[5, 10, 39]].abs().sum() > 0


@pytest.mark.parametrize("layout, widths", [("disjoint", [6, 4, 2]), ("nested", [12, 5, 2])])
@pytest.mark.parametrize("chunk_floats", [1 << 22, 7 * V])
def test_dsoftmax_training_terms_and_gradients_are_the_full_logits(layout, widths, chunk_floats, monkeypatch):
    """The chunked banded terms (one chunk, and 7-row chunks with a short last one) give the values and gradients of
    the plain path: the ``[N, V]`` scores, their gather and logsumexp."""
    monkeypatch.setattr(dsoftmax, "CPU_CHUNK_FLOATS", chunk_floats)
    torch.manual_seed(3)
    head = DSoftmax(D, V, [8, 20], widths, layout, log_z=1.0, learn_log_z=True)
    with torch.no_grad():
        head.log_z_offset.fill_(0.3)
    hidden = torch.randn(N, D, requires_grad=True)
    targets = torch.randint(0, V, (N,))
    targets[:3] = torch.tensor([0, 8, V - 1])  # the bands' edges
    weights = torch.randn(N), torch.randn(N)  # any loss of the two terms
    results = []
    for terms in (head.target_terms, lambda h, t: LinearHead.target_terms(head, h, t)):
        head.zero_grad()
        hidden.grad = None
        score, log_norms = terms(hidden, targets)
        ((score * weights[0]).sum() + (log_norms.squeeze(1) * weights[1]).sum()).backward()
        results.append([score, log_norms, hidden.grad, *(p.grad for p in head.parameters())])
    for fused, plain in zip(*results, strict=True):
        torch.testing.assert_close(fused, plain)


@pytest.mark.parametrize(
    "cutoffs, widths, layout, key",
    [
        ([8, 20], [6, 4], "disjoint", "one width per band"),
        ([8, 20], [2, 4, 6], "disjoint", "shrink"),
        ([8, 20], [6, 4, 3], "disjoint", "add up to 13"),
        ([8, 20], [10, 4, 2], "nested", "first width of 12"),
        ([20, 8], [6, 4, 2], "disjoint", "head.cutoffs"),
        ([8, V], [6, 4, 2], "disjoint", "head.cutoffs"),
        ([8, 20], [6, 4, 2], "stacked", "head.band_layout"),
    ],
)
def test_dsoftmax_settings_are_checked_naming_their_key(cutoffs, widths, layout, key):
    with pytest.raises(ValueError, match=key):
        DSoftmax(D, V, cutoffs, widths, layout)
