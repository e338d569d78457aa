"""CNN-softmax (output vectors from a char-CNN plus a small per-word correction), and scoring a word outside the
vocabulary from its spelling (``Head.speller``) with it and the char-CNN head. The generic head contract runs over
CNN-softmax in tests/test_heads.py; the char-CNN head alone is tests/test_heads_charcnn.py."""

import pytest
import torch
from torch.nn import functional as F

from lmserve.training.config import ObjectiveConfig
from lmserve.training.heads import AdaptiveSoftmax, CharCNNSoftmax, CNNSoftmax, DSoftmax, FullSoftmax, Speller
from lmserve.training.heads.charcnn import PAD, char_inventory, spell
from lmserve.training.objectives import build_objective

V, D, N = 60, 12, 40
WORDS = ["<unk>", "<s>", "</s>", *(f"w{i}" for i in range(V - 3))]


def spellings(words: list[str], head) -> torch.Tensor:
    speller = head.speller()
    width = speller.max_chars + 2
    rows = [spell(w, speller.inventory, speller.max_chars) for w in words]
    return torch.tensor([r + [PAD] * (width - len(r)) for r in rows])


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


def test_cnnsoftmax_trains_its_cnn_and_corrections_with_importance_sampling():
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
