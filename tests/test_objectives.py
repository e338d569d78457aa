import pytest
import torch

from lmserve.training.config import ObjectiveConfig
from lmserve.training.heads import FullSoftmax
from lmserve.training.objectives import CrossEntropy, SelfNormPenalty, build_objective


def test_cross_entropy_is_summed_negative_log_likelihood():
    torch.manual_seed(0)
    head = FullSoftmax(8, 30)
    hidden, targets = torch.randn(20, 8), torch.randint(0, 30, (20,))
    out = CrossEntropy()(head, hidden, targets)
    expected = torch.nn.functional.cross_entropy(head.linear(hidden), targets, reduction="sum")
    torch.testing.assert_close(out.loss, expected)
    torch.testing.assert_close(out.nll, expected.detach())


def test_selfnorm_penalty_adds_alpha_log_z_squared():
    torch.manual_seed(0)
    head = FullSoftmax(8, 30)
    hidden, targets = torch.randn(20, 8), torch.randint(0, 30, (20,))
    plain = CrossEntropy()(head, hidden, targets)
    penalised = build_objective(ObjectiveConfig(selfnorm_alpha=0.5))(head, hidden, targets)
    log_z = head.linear(hidden).logsumexp(-1)
    torch.testing.assert_close(penalised.loss - plain.loss, 0.5 * log_z.pow(2).sum())
    torch.testing.assert_close(penalised.nll, plain.nll)  # the reported likelihood is not the penalised loss


def test_infrequent_penalty_samples_a_gamma_fraction_and_rescales():
    penalty = SelfNormPenalty(alpha=1.0, gamma=0.25)
    torch.manual_seed(0)
    counts = [len(penalty.rows(10_000)) for _ in range(5)]
    assert all(2300 < c < 2700 for c in counts)
    assert penalty(torch.ones(3, 1)) == pytest.approx(3 / 0.25)  # each sampled row counts 1/gamma times
    assert SelfNormPenalty(1.0, 1.0).rows(5) is None
    with pytest.raises(ValueError, match="selfnorm_gamma"):
        SelfNormPenalty(1.0, 0.0)


def test_training_with_the_penalty_drives_log_z_to_zero():
    """Fit the same head on the same data with and without the penalty: only the penalised one self-normalises."""
    torch.manual_seed(0)
    hidden, targets = torch.randn(256, 8), torch.randint(0, 30, (256,))
    mean_abs_log_z = {}
    for alpha in (0.0, 1.0):
        torch.manual_seed(1)
        head = FullSoftmax(8, 30)
        with torch.no_grad():
            head.linear.bias.fill_(1.0)  # start far from normalised: log Z ~ log 30 + 1
        objective = build_objective(ObjectiveConfig(selfnorm_alpha=alpha))
        optimizer = torch.optim.Adam(head.parameters(), lr=0.05)
        for _ in range(300):
            optimizer.zero_grad()
            (objective(head, hidden, targets).loss / len(targets)).backward()
            optimizer.step()
        mean_abs_log_z[alpha] = head.linear(hidden).logsumexp(-1).abs().mean().item()
    assert mean_abs_log_z[1.0] < 0.3 and mean_abs_log_z[0.0] > 3.0


def test_selfnorm_on_adaptive_softmax_penalises_the_head_and_the_target_cluster():
    from lmserve.training.heads import AdaptiveSoftmax

    torch.manual_seed(0)
    head = AdaptiveSoftmax(8, 30, cutoffs=[5, 15])
    hidden, targets = torch.randn(20, 8), torch.tensor([0, 1, 7, 20] * 5)
    plain = CrossEntropy()(head, hidden, targets)
    penalised = build_objective(ObjectiveConfig(selfnorm_alpha=0.1))(head, hidden, targets)
    _, log_norms = head.target_terms(hidden, targets)
    torch.testing.assert_close(penalised.loss - plain.loss, 0.1 * log_norms.pow(2).sum())
    assert (log_norms[:, 1] != 0).sum() == 10  # only targets 7 and 20 go through a tail cluster
