"""The estimators of issue 33: target sampling (a batch's own vocabulary with its importance weights) and adaptive
importance sampling (a proposal that follows the model, kept by checkpoints). The objectives' shared contract (the
registry, the self-normalisation penalty, bf16) runs over them in tests/test_objectives_sampled.py."""

import math

import pytest
import torch
from safetensors.torch import load_file
from torch.nn import functional as F

from lmserve.training.checkpoint import resolve_checkpoint
from lmserve.training.cli import main
from lmserve.training.config import ObjectiveConfig
from lmserve.training.heads import DSoftmax, FullSoftmax
from lmserve.training.objectives import (
    AdaptiveImportanceSampling,
    ImportanceSampling,
    Noise,
    TargetSampling,
    build_objective,
)
from lmserve.training.trainer import Trainer

V, D, N = 30, 8, 20


def zipf_prior() -> torch.Tensor:
    weights = 1.0 / torch.arange(1, V + 1, dtype=torch.float64)
    return (weights / weights.sum()).log().float()


def linear_head() -> FullSoftmax:
    torch.manual_seed(0)
    head = FullSoftmax(D, V)
    head.init_bias(zipf_prior())
    return head


# -- target sampling ----------------------------------------------------------------------------------------------


def test_target_sampling_softmaxes_over_the_batchs_targets_and_draws(monkeypatch):
    head, hidden, targets = linear_head(), torch.randn(4, D), torch.tensor([0, 4, 9, 4])
    monkeypatch.setattr(Noise, "sample", lambda self, n: torch.tensor([4, 2, 2][:n]))
    objective = TargetSampling(samples=3)
    ids, log_pi = objective.batch_vocabulary(head, targets)
    assert ids.tolist() == [0, 2, 4, 9]  # each word once: the targets and the draws
    u, q = head.log_prior.double().exp()[ids], objective.noise(head).log_q.double().exp()[ids]
    want_pi = 1 - (1 - u) ** (len(targets) - 1) * (1 - q) ** 3  # besides a position's own target
    torch.testing.assert_close(log_pi.double().exp(), want_pi, rtol=1e-5, atol=0)
    scores = head.scores(hidden)
    got = objective(head, hidden, targets).loss
    want = 0.0
    for n, t in enumerate(targets.tolist()):
        terms = [scores[n, t]] + [scores[n, w] - log_pi[i] for i, w in enumerate(ids.tolist()) if w != t]
        want = want + torch.logsumexp(torch.stack(terms), 0) - scores[n, t]
    torch.testing.assert_close(got, want)


def test_target_samplings_inclusion_probabilities_and_normaliser_estimate_are_right():
    """Over many batches drawn as the training text and Q draw them: each word is in V' with the probability of the
    formula, and e^{s_t} + Σ_{w ∈ V', w ≠ t} e^{s_w} / π(w), π(w) being that probability given that a position's own
    target t is another word, estimates Z without bias (Horvitz-Thompson)."""
    torch.manual_seed(6)
    head, objective = linear_head(), TargetSampling(samples=5, noise_power=0.5, noise_uniform=0.1)
    hidden = torch.randn(1, D)
    scores = head.scores(hidden)[0].detach().double()
    unigram = head.log_prior.exp()
    trials, included, estimates = 4000, torch.zeros(V), []
    for _ in range(trials):
        targets = torch.multinomial(unigram, 8, replacement=True)
        ids, log_pi = objective.batch_vocabulary(head, targets)
        included[ids] += 1
        t = int(targets[0])
        rest = (scores[ids] - log_pi.double()).exp() * (ids != t)
        estimates.append(scores[t].exp() + rest.sum())
    q = objective.noise(head).log_q.double().exp()
    pi = 1 - (1 - unigram.double()) ** 8 * (1 - q) ** 5
    torch.testing.assert_close(included.double() / trials, pi, atol=0.03, rtol=0)
    z = scores.exp().sum()
    assert float(torch.stack(estimates).mean() / z) == pytest.approx(1.0, abs=0.03)


def test_target_sampling_trains_a_linear_head_towards_the_exact_likelihood():
    torch.manual_seed(7)
    head = DSoftmax(D, V, [6], [8, 4], "nested")
    head.init_bias(zipf_prior())
    hidden = torch.randn(64, D)
    targets = (hidden @ torch.randn(D, V)).argmax(1)
    objective = build_objective(ObjectiveConfig(type="target_sampling", samples=6, nll_stride=1))
    optimizer = torch.optim.Adam(head.parameters(), lr=0.05)

    def exact_nll():
        with torch.no_grad():
            return F.nll_loss(head.log_probs(hidden), targets).item()

    start = exact_nll()
    for _ in range(40):
        optimizer.zero_grad()
        objective(head, hidden, targets).loss.div(len(targets)).backward()
        optimizer.step()
    assert exact_nll() < 0.7 * start


def test_the_training_nll_estimate_can_skip_steps():
    """objective.nll_every: the strided estimate on every n-th step; the steps between count its value per token for
    their own tokens, without whole-vocabulary scores."""
    head, hidden, targets = linear_head(), torch.randn(N, D), torch.randint(0, V, (N,))
    exact = F.cross_entropy(head.scores(hidden), targets, reduction="sum").item()
    objective = build_objective(ObjectiveConfig(type="target_sampling", samples=3, nll_stride=1, nll_every=3))
    calls = []
    original = head.target_terms
    head.target_terms = lambda *a: calls.append(1) or original(*a)
    nlls = [float(objective(head, hidden[: N - k], targets[: N - k]).nll) for k in range(4)]
    assert len(calls) == 2  # steps 1 and 4
    assert nlls[0] == pytest.approx(exact, rel=1e-5)
    assert nlls[1:3] == pytest.approx([nlls[0] * (N - 1) / N, nlls[0] * (N - 2) / N], rel=1e-5)
    want = F.cross_entropy(head.scores(hidden[: N - 3]), targets[: N - 3], reduction="sum").item()
    assert nlls[3] == pytest.approx(want, rel=1e-5)
    with pytest.raises(ValueError, match="objective.nll_every = 0"):
        build_objective(ObjectiveConfig(type="nce", nll_every=0))


# -- adaptive importance sampling ---------------------------------------------------------------------------------


def test_adaptive_proposal_moves_towards_the_models_unigram():
    """A model whose prediction does not depend on the context (zero hidden states) has its biases' softmax as its
    unigram distribution: the adapted proposal converges to it from the training unigram."""
    torch.manual_seed(8)
    head = linear_head()
    model_unigram = torch.distributions.Dirichlet(torch.ones(V)).sample()
    with torch.no_grad():
        head.linear.bias.copy_(model_unigram.log())
    objective = AdaptiveImportanceSampling(samples=50, adapt_rate=0.05, noise_uniform=0.1)
    hidden, targets = torch.zeros(16, D), torch.randint(0, V, (16,))
    start = objective.noise(head).log_q.exp().clone()
    torch.testing.assert_close(start, Noise(head.log_prior, 1.0, 0.1).log_q.exp())
    for _ in range(300):
        objective(head, hidden, targets)
    adapted = objective.noise(head).log_q.exp()
    want = 0.9 * model_unigram + 0.1 / V
    assert (adapted - want).abs().sum() < 0.3 * (start - want).abs().sum()
    assert float(adapted.sum()) == pytest.approx(1.0, abs=1e-5) and float(adapted.min()) >= 0.1 / V - 1e-7
    assert torch.equal(objective.state_dict()["unigram_estimate"], objective.unigram)


def test_the_adapted_proposal_is_flattened_as_the_fixed_one():
    """With noise_power 0.5 the proposal follows the square root of the model's unigram, as the fixed proposal
    takes the square root of the training unigram (a proposal that followed the unigram itself starved rare words)."""
    torch.manual_seed(9)
    head = linear_head()
    model_unigram = torch.distributions.Dirichlet(torch.full((V,), 0.3)).sample()
    with torch.no_grad():
        head.linear.bias.copy_(model_unigram.log())
    objective = AdaptiveImportanceSampling(samples=50, adapt_rate=0.05, noise_power=0.5, noise_uniform=0.1)
    hidden, targets = torch.zeros(16, D), torch.randint(0, V, (16,))
    for _ in range(300):
        objective(head, hidden, targets)
    flat = model_unigram.sqrt() / model_unigram.sqrt().sum()
    adapted = objective.noise(head).log_q.exp()
    assert (adapted - (0.9 * flat + 0.1 / V)).abs().sum() < 0.5 * (
        adapted - (0.9 * model_unigram + 0.1 / V)
    ).abs().sum()


def test_a_zero_rate_is_fixed_importance_sampling(monkeypatch):
    head, hidden, targets = linear_head(), torch.randn(N, D), torch.randint(0, V, (N,))
    monkeypatch.setattr(Noise, "sample", lambda self, n: torch.tensor([3, 5, 7]))
    fixed = ImportanceSampling(samples=3, noise_power=0.5)
    adaptive = AdaptiveImportanceSampling(samples=3, adapt_rate=0.0, noise_power=0.5)
    for _ in range(3):
        torch.testing.assert_close(adaptive(head, hidden, targets).loss, fixed(head, hidden, targets).loss)
    with pytest.raises(ValueError, match="objective.adapt_rate = 2"):
        AdaptiveImportanceSampling(samples=3, adapt_rate=2)


def test_checkpoints_keep_the_adapted_proposal_and_resume_with_it(write_config, tmp_path):
    config = write_config(
        "sentence",
        objective={"type": "adaptive_importance_sampling", "samples": 10, "adapt_rate": 0.2},
        train={"epochs": 1},
    )
    run = tmp_path / "run"
    assert main(["fit", str(config), "--out", str(run), "--set", 'head.bias_init="unigram"']) == 0
    saved = load_file(str(resolve_checkpoint(run, "latest") / "trainer.safetensors"))["objective.unigram_estimate"]
    unigram = torch.tensor(Trainer.resume(run).vocab.target_log_prior()).double().exp()
    assert float(saved.sum()) == pytest.approx(1.0) and not torch.allclose(saved, unigram / unigram.sum(), atol=1e-3)
    resumed = Trainer.resume(run, ["train.epochs=2"])
    assert torch.equal(resumed.objective.unigram, saved)
    assert math.isfinite(resumed.fit()["test"]["ppl"])
    with pytest.raises(ValueError, match="keeps no state"):
        build_objective(ObjectiveConfig(type="nce")).load_state_dict({"unigram_estimate": saved})
