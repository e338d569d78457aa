import pytest
import torch

from lmserve.training.config import HeadConfig, ModelConfig
from lmserve.training.model import LSTMLM


def test_shapes_projection_and_state():
    model = LSTMLM(50, ModelConfig(embedding_size=8, hidden_size=12, layers=3, projection_size=6), HeadConfig())
    hidden, (h, c) = model(torch.randint(0, 50, (5, 4)))
    assert hidden.shape == (5, 4, 6) and h.shape == c.shape == (3, 4, 12)
    assert model.head.linear.in_features == 6


def test_uniform_initialisation_range():
    model = LSTMLM(50, ModelConfig(embedding_size=8, hidden_size=8, init_range=0.05), HeadConfig())
    assert all(p.abs().max() <= 0.05 for p in model.parameters())


def test_tied_embeddings_share_one_matrix_and_need_matching_sizes():
    model = LSTMLM(
        50, ModelConfig(embedding_size=8, hidden_size=12, projection_size=8, tie_embeddings=True), HeadConfig()
    )
    assert model.head.linear.weight is model.embedding.weight
    assert sum(p.numel() for p in model.parameters()) < sum(
        p.numel()
        for p in LSTMLM(50, ModelConfig(embedding_size=8, hidden_size=12, projection_size=8), HeadConfig()).parameters()
    )
    with pytest.raises(ValueError, match="projection_size"):
        LSTMLM(50, ModelConfig(embedding_size=8, hidden_size=12, tie_embeddings=True), HeadConfig())
    with pytest.raises(ValueError, match="no single output matrix"):
        LSTMLM(
            50,
            ModelConfig(embedding_size=8, hidden_size=8, tie_embeddings=True),
            HeadConfig(type="adaptive", cutoffs=[10]),
        )


def test_dropout_only_while_training():
    torch.manual_seed(0)
    model = LSTMLM(50, ModelConfig(embedding_size=8, hidden_size=8, dropout=0.5), HeadConfig())
    x = torch.randint(0, 50, (4, 2))
    model.eval()
    assert torch.equal(model(x)[0], model(x)[0])
    model.train()
    assert not torch.equal(model(x)[0], model(x)[0])


def test_slim_input_embeddings_compose_shared_subvectors():
    # 5 per pool, 10 words each
    cfg = ModelConfig(embedding_size=8, hidden_size=8, input_slim_subvectors=4, input_slim_pool=20)
    model = LSTMLM(50, cfg, HeadConfig())
    table = model.embedding
    assert table.pools.numel() == 20 * 8 // 4  # M sub-vectors of E/K: 10% of the 50 x 8 matrix
    ids = torch.tensor([[0, 7], [49, 7]])
    vectors = model.embedding(ids)
    assert vectors.shape == (2, 2, 8)
    torch.testing.assert_close(vectors[1, 1], torch.cat([table.pools[k, table.assignment[7, k]] for k in range(4)]))
    for k in range(4):
        assert torch.bincount(table.assignment[:, k], minlength=5).tolist() == [10] * 5
    # its own assignment, not the slim output layer's
    head = LSTMLM(50, ModelConfig(embedding_size=8, hidden_size=8), HeadConfig(type="slim", slim_pool=20)).head
    assert not torch.equal(table.assignment, head.table.assignment)
    hidden, _ = model(ids)
    hidden.sum().backward()
    assert table.pools.grad.abs().sum() > 0


def test_slim_input_embeddings_are_validated_and_cannot_be_tied():
    with pytest.raises(ValueError, match="model.input_slim_subvectors = 3"):
        LSTMLM(50, ModelConfig(embedding_size=8, input_slim_subvectors=3, input_slim_pool=30), HeadConfig())
    with pytest.raises(ValueError, match="model.input_slim_pool = 10"):
        LSTMLM(50, ModelConfig(embedding_size=8, input_slim_subvectors=4, input_slim_pool=10), HeadConfig())
    with pytest.raises(ValueError, match="no matrix to tie"):
        LSTMLM(
            50,
            ModelConfig(
                embedding_size=8, hidden_size=8, input_slim_pool=40, input_slim_subvectors=4, tie_embeddings=True
            ),
            HeadConfig(),
        )
