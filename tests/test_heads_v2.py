"""The output layers of issue 33, one by one: differentiated softmax, CNN-softmax with its correction, clustered slim
sub-vectors, and scoring a word outside the vocabulary from its spelling (``Head.speller``). The generic head
contract (normalisation, target terms, bf16, bias init) runs over them in tests/test_heads.py."""

import pytest
import torch
from safetensors.torch import save_file
from torch.nn import functional as F

from lmserve.training.config import ConfigError, config_from_dict
from lmserve.training.heads import (
    AdaptiveSoftmax,
    CharCNNSoftmax,
    CNNSoftmax,
    DSoftmax,
    FullSoftmax,
    SlimSoftmax,
    Speller,
    dsoftmax,
)
from lmserve.training.heads.base import LinearHead
from lmserve.training.heads.charcnn import PAD, char_inventory, spell
from lmserve.training.heads.slim import kmeans

V, D, N = 60, 12, 40
WORDS = ["<unk>", "<s>", "</s>", *(f"w{i}" for i in range(V - 3))]


def spellings(words: list[str], head) -> torch.Tensor:
    speller = head.speller()
    width = speller.max_chars + 2
    rows = [spell(w, speller.inventory, speller.max_chars) for w in words]
    return torch.tensor([r + [PAD] * (width - len(r)) for r in rows])


# -- differentiated softmax ---------------------------------------------------------------------------------------


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


def test_config_checks_the_new_keys_at_start_up():
    for raw, key in (
        ({"head": {"type": "dsoftmax"}}, "needs head.cutoffs"),
        ({"head": {"type": "full", "band_widths": [4]}}, "head.band_widths is for head.type = dsoftmax"),
        ({"head": {"type": "full", "slim_embeddings": "run"}}, "head.slim_embeddings is for head.type = slim"),
        ({"head": {"type": "dsoftmax", "band_layout": "x"}}, "head.band_layout"),
        ({"head": {"type": "cnnsoftmax", "correction_size": -1}}, "head.correction_size = -1"),
        ({"objective": {"type": "adaptive_importance_sampling", "adapt_rate": 1.5}}, "objective.adapt_rate = 1.5"),
        ({"head": {"type": "adaptive"}, "objective": {"type": "target_sampling"}}, "needs head.type = full"),
    ):
        with pytest.raises(ConfigError, match=key):
            config_from_dict(raw)
    config_from_dict({"head": {"type": "dsoftmax", "cutoffs": [10], "band_widths": [150, 50]}})


# -- CNN-softmax with its correction ------------------------------------------------------------------------------


def cnn_head(correction: int = 4, seed: int = 0) -> CNNSoftmax:
    torch.manual_seed(seed)
    return CNNSoftmax(D, WORDS, 6, 4, [1, 2, 3], 8, correction_size=correction, log_z=1.0)


def test_cnnsoftmax_vectors_are_the_projected_cnn_plus_the_projected_correction():
    head = cnn_head()
    ids = torch.tensor([7, 3, 7, 0, 59, 3])
    vectors, bias = head.output_vectors(ids)
    torch.testing.assert_close(vectors, head.output_matrix()[ids])
    want = head.spelled_vectors(head.char_ids[ids]) + head.correction[ids] @ head.correct.weight.T
    torch.testing.assert_close(vectors, want)
    torch.testing.assert_close(bias, head.bias[ids])
    no_correction = cnn_head(correction=0)
    assert no_correction.correction is None
    torch.testing.assert_close(no_correction.output_matrix(), no_correction.spelled_vectors(no_correction.char_ids))


def test_cnnsoftmax_word_parameters_grow_with_the_correction_only():
    def per_word(head):
        return sum(p.numel() for p in head.parameters() if p.shape[0] == len(WORDS))

    assert per_word(cnn_head(correction=4)) == len(WORDS) * (4 + 1)  # correction vectors and biases
    assert per_word(cnn_head(correction=0)) == len(WORDS)
    full = FullSoftmax(D, len(WORDS))
    assert sum(p.numel() for p in cnn_head().parameters()) < sum(p.numel() for p in full.parameters())


def test_cnnsoftmax_frozen_head_serves_the_same_scores_and_keeps_its_speller():
    head = cnn_head()
    frozen = head.frozen()
    assert isinstance(frozen, FullSoftmax) and frozen.log_z == pytest.approx(1.0)
    assert isinstance(frozen.speller(), Speller) and not any(p.requires_grad for p in frozen.parameters())
    assert all(p.requires_grad for p in head.parameters())  # the snapshot froze its own copy only
    hidden = torch.randn(N, D)
    torch.testing.assert_close(frozen.log_probs(hidden), head.log_probs(hidden), atol=1e-5, rtol=0)
    chars = spellings(["w12x", "zzz", "é"], head)
    rows = hidden[:3]
    torch.testing.assert_close(frozen.spelled_logprob(rows, chars, 0), head.spelled_logprob(rows, chars, 0))


@pytest.mark.parametrize("bad, key", [(dict(correction_size=-1), "head.correction_size"), (dict(widths=[]), "widths")])
def test_cnnsoftmax_settings_name_their_key(bad, key):
    args = dict(charcnn_size=6, char_embedding_size=4, widths=[1, 2, 3], max_chars=8, correction_size=4) | bad
    with pytest.raises(ValueError, match=key):
        CNNSoftmax(D, WORDS, **args)


# -- words outside the vocabulary ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["charcnn", "cnnsoftmax"])
def test_a_spelled_word_takes_unks_place_in_the_softmax(kind):
    torch.manual_seed(2)
    if kind == "charcnn":
        head = CharCNNSoftmax(D, WORDS, 6, 4, [1, 2, 3], 8, log_z=0.5)
    else:
        head = cnn_head()
    hidden = torch.randn(3, D)
    chars = spellings(["w123", "neverseen", "w5"], head)
    vectors, bias = head.speller()(chars)
    if kind == "charcnn":  # no word vector of its own: the CNN part only
        assert torch.all(vectors[:, : D - 6] == 0)
    assert torch.all(bias == head.bias[-(V // 10) :].mean())  # a rare word's bias, not <unk>'s
    spelled = (hidden * vectors).sum(1) + bias - head.log_z
    torch.testing.assert_close(head.spelled_score(hidden, chars), spelled)
    scores = head.scores(hidden)
    scores[:, 0] = spelled  # <unk>'s place
    torch.testing.assert_close(head.spelled_logprob(hidden, chars, 0), scores.log_softmax(-1)[:, 0])
    # an in-vocabulary word's own spelling gives its CNN part back, so the speller reads spellings as the head does
    own = spellings(["w5"], head)
    assert torch.equal(own[0], head.char_ids[WORDS.index("w5")])


def test_heads_without_characters_have_no_speller():
    for head in (FullSoftmax(D, V), AdaptiveSoftmax(D, V, [8, 20]), DSoftmax(D, V, [8], [8, 4])):
        assert head.speller() is None and head.frozen().speller() is None
    with pytest.raises(ValueError, match="no model of spellings"):
        FullSoftmax(D, V).spelled_score(torch.randn(1, D), torch.tensor([[1, 3, 2]]))


def test_unknown_characters_are_left_out_of_a_spelling():
    inventory = char_inventory(["ab", "c"])
    assert spell("abc", inventory, 8) == [1, 3, 4, 5, 2]
    assert spell("aéb", inventory, 8) == spell("ab", inventory, 8)
    assert spell("cabcab", inventory, 3) == [1, 5, 3, 4, 2]  # the first max_chars known characters
    assert spell("ééé", inventory, 3) == [1, 2]


# -- clustered slim sub-vectors -----------------------------------------------------------------------------------


def test_kmeans_finds_separated_clusters_deterministically():
    torch.manual_seed(3)
    centres = torch.tensor([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]])
    members = torch.randint(0, 3, (200,))
    members[:3] = torch.tensor([0, 1, 2])  # the starting centroids are the first points
    points = centres[members] + 0.1 * torch.randn(200, 2)
    found, labels = kmeans(points, 3)
    torch.testing.assert_close(found, centres[:3], atol=0.05, rtol=0)
    assert torch.equal(labels, members)
    again, labels_again = kmeans(points, 3)
    assert torch.equal(again, found) and torch.equal(labels_again, labels)


def test_slim_sub_vectors_clustered_from_a_trained_models_output_vectors(tmp_path):
    torch.manual_seed(4)
    # 6 kinds of words whose trained vectors are alike within a kind; chunk k of kind j is centre[k][j]
    kinds = torch.arange(V) % 6
    centres = torch.randn(4, 6, D // 4)
    trained = torch.cat([centres[k][kinds] for k in range(4)], dim=1) + 0.01 * torch.randn(V, D)
    save_file(
        {"head.linear.weight": trained, "embedding.weight": torch.zeros(V, 5)}, str(tmp_path / "model.safetensors")
    )
    clustered = SlimSoftmax(D, V, subvectors=4, pool=24, embeddings=str(tmp_path))
    random = SlimSoftmax(D, V, subvectors=4, pool=24)
    before = clustered.table.assignment.clone()
    assert torch.equal(before, random.table.assignment)  # until the trainer hands over the unigram
    clustered.init_bias(torch.full((V,), -torch.log(torch.tensor(float(V)))))
    assignment = clustered.table.assignment
    for k in range(4):  # same kind, same sub-vector; the pools hold the centres
        for kind in range(6):
            assert len(set(assignment[kinds == kind, k].tolist())) == 1
    vectors = clustered.table.vectors(torch.arange(V))
    torch.testing.assert_close(vectors, trained, atol=0.05, rtol=0)  # the noise around the centres
    hidden = torch.randn(N, D)
    torch.testing.assert_close(clustered.logits(hidden), hidden @ vectors.T + clustered.bias)


def test_slim_clustering_checks_its_source(tmp_path):
    save_file({"head.linear.weight": torch.randn(V, D + 1)}, str(tmp_path / "model.safetensors"))
    head = SlimSoftmax(D, V, subvectors=4, pool=24, embeddings=str(tmp_path))
    with pytest.raises(ValueError, match="head.slim_embeddings = .* 13 dimensions"):
        head.init_bias(torch.zeros(V))
    with pytest.raises(ValueError, match="head.slim_pool = 400"):
        SlimSoftmax(D, V, subvectors=4, pool=400, embeddings=str(tmp_path))
    save_file({"embedding.weight": torch.randn(V + 1, D)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="cover 61 words"):
        SlimSoftmax(D, V, subvectors=4, pool=24, embeddings=str(tmp_path)).init_bias(torch.zeros(V))


def test_cnnsoftmax_trains_its_cnn_and_corrections_with_importance_sampling():
    from lmserve.training.config import ObjectiveConfig
    from lmserve.training.objectives import build_objective

    head = cnn_head()
    weights = 1.0 / torch.arange(1, len(WORDS) + 1, dtype=torch.float64)
    head.init_bias((weights / weights.sum()).log().float())
    objective = build_objective(ObjectiveConfig(type="importance_sampling", samples=16, nll_stride=1))
    hidden = torch.randn(64, D)
    targets = (hidden @ torch.randn(D, len(WORDS))).argmax(1)
    optimizer = torch.optim.Adam(head.parameters(), lr=0.02)

    def exact_nll():
        with torch.no_grad():
            return F.nll_loss(head.log_probs(hidden), targets).item()

    start, conv = exact_nll(), head.convs[1].weight.detach().clone()
    for _ in range(30):
        optimizer.zero_grad()
        objective(head, hidden, targets).loss.div(len(targets)).backward()
        optimizer.step()
    assert exact_nll() < 0.8 * start and not torch.equal(head.convs[1].weight, conv)
