import pytest
import torch

from training.config import HeadConfig, ModelConfig
from training.model import LSTMLM


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
