"""Character-CNN output embeddings: consistency of the sampled and whole-vocabulary paths, padding, training, export."""

import io

import pytest
import torch
from torch.nn import functional as F

from lmserve.training.config import ObjectiveConfig
from lmserve.training.heads import CharCNNSoftmax, FullSoftmax
from lmserve.training.heads.charcnn import PAD
from lmserve.training.objectives import build_objective

WORDS = ["<unk>", "<s>", "</s>", "a", "an", "the", "cat", "cats", "dog", "dogs", "catalogue", "unbelievably", "é"]
V, D, N = len(WORDS), 10, 16
WIDTHS = [1, 3, 5]  # 5 is wider than "a" and its markers


def make_head(max_chars: int = 6, seed: int = 0, **kwargs) -> CharCNNSoftmax:
    torch.manual_seed(seed)
    return CharCNNSoftmax(D, WORDS, 6, 4, WIDTHS, max_chars, **kwargs)


def reference_char_vector(head: CharCNNSoftmax, word: str) -> torch.Tensor:
    """The word's spelling (truncated, with markers) alone, no padding buffer; zero-padded to a filter's width only
    where it is shorter."""
    ids = head.char_ids[WORDS.index(word)]
    ids = ids[ids != PAD]
    embedded = head.char_embedding(ids).T.unsqueeze(0)  # [1, E, L + 2]
    pooled = []
    for conv in head.convs:
        short = max(conv.kernel_size[0] - embedded.shape[2], 0)
        pooled.append(conv(F.pad(embedded, (0, short))).amax(2).squeeze(0))
    return torch.tanh(torch.cat(pooled))


def test_output_vectors_agree_with_logits_including_duplicate_ids():
    head = make_head()
    hidden = torch.randn(N, D)
    logits = head.logits(hidden)
    assert logits.shape == (N, V)
    ids = torch.tensor([7, 3, 7, 0, 12, 3, 11])
    vectors, bias = head.output_vectors(ids)
    assert vectors.shape == (len(ids), D) and bias.shape == (len(ids),)
    torch.testing.assert_close(vectors, head.output_matrix()[ids])
    rows = torch.randint(0, N, (len(ids),))
    torch.testing.assert_close((vectors * hidden[rows]).sum(1) + bias, logits[rows, ids])
    empty, empty_bias = head.output_vectors(torch.zeros(0, dtype=torch.long))
    assert empty.shape == (0, D) and empty_bias.shape == (0,)


def test_log_probs_are_normalised():
    head = make_head(log_z=2.0)
    log_probs = head.log_probs(torch.randn(N, D))
    torch.testing.assert_close(log_probs.logsumexp(-1), torch.zeros(N), atol=1e-5, rtol=0)


def test_char_vectors_see_the_spelling_and_never_the_padding():
    head = make_head()
    matrix = head.output_matrix()
    for word in WORDS:
        torch.testing.assert_close(matrix[WORDS.index(word), D - 6 :], reference_char_vector(head, word))
    with torch.no_grad():
        head.char_embedding.weight[PAD].normal_()  # as the model's uniform re-initialisation of every parameter does
    torch.testing.assert_close(head.output_matrix(), matrix)


def test_char_vectors_do_not_depend_on_max_chars_below_it():
    short, long = make_head(max_chars=3), make_head(max_chars=9, seed=1)
    state = {k: v for k, v in short.state_dict().items() if k != "char_ids"}
    assert long.load_state_dict(state, strict=False).missing_keys == ["char_ids"]
    fits = torch.tensor([i for i, w in enumerate(WORDS) if len(w) <= 3])
    torch.testing.assert_close(long.output_vectors(fits), short.output_vectors(fits))
    truncated = WORDS.index("catalogue")  # "cat" at 3 characters
    assert not torch.allclose(long.output_matrix()[truncated], short.output_matrix()[truncated])
    chars = short.output_matrix()[:, D - 6 :]
    torch.testing.assert_close(chars[truncated], chars[WORDS.index("cat")])


def test_a_loss_on_some_words_reaches_the_char_cnn():
    head = make_head()
    vectors, bias = head.output_vectors(torch.tensor([6, 7, 7]))
    ((vectors @ torch.randn(D)) + bias).sum().backward()
    for name, param in head.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name
    assert head.word_vectors.grad[[0, 1, 2, 8]].abs().sum() == 0  # words not asked for: no word-vector gradient


def test_frozen_head_serves_the_same_scores():
    head = make_head(log_z=2.0, learn_log_z=True)
    with torch.no_grad():
        head.log_z_offset.fill_(0.7)
    frozen = head.frozen()
    assert isinstance(frozen, FullSoftmax) and frozen.log_z == pytest.approx(2.7)
    assert not any(p.requires_grad for p in frozen.parameters())
    hidden, targets = torch.randn(N, D), torch.randint(0, V, (N,))
    torch.testing.assert_close(frozen.scores(hidden), head.scores(hidden), atol=1e-5, rtol=0)
    torch.testing.assert_close(frozen.log_probs(hidden), head.log_probs(hidden), atol=1e-5, rtol=0)
    torch.testing.assert_close(
        frozen.target_score(hidden, targets), head.target_score(hidden, targets), atol=1e-5, rtol=0
    )


def test_trains_with_importance_sampling():
    head = make_head()
    weights = 1.0 / torch.arange(1, V + 1, dtype=torch.float64)
    head.init_bias((weights / weights.sum()).log().float())
    objective = build_objective(ObjectiveConfig(type="importance_sampling", samples=8, nll_stride=1))
    torch.manual_seed(0)
    hidden = torch.randn(64, D)
    targets = (hidden @ torch.randn(D, V)).argmax(1)  # learnable: a function of the hidden state
    optimizer = torch.optim.SGD(head.parameters(), lr=0.1)
    conv_before = head.convs[1].weight.detach().clone()

    def exact_nll():
        with torch.no_grad():
            return F.nll_loss(head.log_probs(hidden), targets).item()

    start = exact_nll()
    for _ in range(20):
        optimizer.zero_grad()
        objective(head, hidden, targets).loss.div(len(targets)).backward()
        optimizer.step()
    assert exact_nll() < 0.8 * start
    assert not torch.equal(head.convs[1].weight, conv_before)


@pytest.mark.parametrize(
    "kwargs, key",
    [
        (dict(charcnn_size=0), "head.charcnn_size = 0"),
        (dict(charcnn_size=D), f"head.charcnn_size = {D}"),
        (dict(charcnn_size=7), "head.charcnn_size = 7"),  # not a multiple of 3 widths
        (dict(char_embedding_size=0), "head.char_embedding_size = 0"),
        (dict(max_chars=0), "head.charcnn_max_chars = 0"),
        (dict(widths=[0, 1, 2]), "head.charcnn_widths"),
        (dict(widths=[1, 2, 9], max_chars=6), "head.charcnn_widths"),
        (dict(widths=[]), "head.charcnn_widths"),
    ],
)
def test_bad_config_names_the_key(kwargs, key):
    args = dict(charcnn_size=6, char_embedding_size=4, widths=WIDTHS, max_chars=6) | kwargs
    with pytest.raises(ValueError, match=key.replace("[", r"\[")):
        CharCNNSoftmax(D, WORDS, **args)


def test_state_dict_round_trip():
    head, fresh = make_head(learn_log_z=True), make_head(seed=1, learn_log_z=True)
    buffer = io.BytesIO()
    torch.save(head.state_dict(), buffer)
    buffer.seek(0)
    fresh.load_state_dict(torch.load(buffer))
    assert torch.equal(fresh.char_ids, head.char_ids)
    hidden = torch.randn(N, D)
    torch.testing.assert_close(fresh.logits(hidden), head.logits(hidden), atol=0, rtol=0)
