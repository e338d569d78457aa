"""Sampled objectives: the proposal, each loss against its formula, their limits, and training through the loop;
target sampling (a batch's own vocabulary with its importance weights) and adaptive importance sampling (a proposal
that follows the model, kept by checkpoints)."""

import json
import math
import tomllib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.nn import functional as F

from lmserve.training.checkpoint import resolve_checkpoint
from lmserve.training.cli import main
from lmserve.training.config import (
    SAMPLED_OBJECTIVES,
    ConfigError,
    HeadConfig,
    ObjectiveConfig,
    config_from_dict,
    load_config,
)
from lmserve.training.heads import AdaptiveSoftmax, DSoftmax, FullSoftmax, SlimSoftmax, build_head
from lmserve.training.model import LSTMLM
from lmserve.training.objectives import (
    NCE,
    SAMPLED_TYPES,
    AdaptiveImportanceSampling,
    BetaNCE,
    BlackOut,
    ImportanceSampling,
    NegativeSampling,
    Noise,
    TargetSampling,
    build_objective,
    self_normalised,
)
from lmserve.training.trainer import Trainer

V, D, N = 30, 8, 20
ROOT = Path(__file__).resolve().parents[1]


def zipf_prior(vocab_size: int = V) -> torch.Tensor:
    weights = 1.0 / torch.arange(1, vocab_size + 1, dtype=torch.float64)
    return (weights / weights.sum()).log().float()


def linear_head(**kwargs) -> FullSoftmax:
    torch.manual_seed(0)
    head = FullSoftmax(D, V, **kwargs)
    head.init_bias(zipf_prior())
    return head


def fixed_samples(monkeypatch, ids):
    monkeypatch.setattr(Noise, "sample", lambda self, n: torch.tensor(ids))


def test_registry_matches_the_config_choices():
    assert tuple(SAMPLED_TYPES) == SAMPLED_OBJECTIVES
    for name in SAMPLED_OBJECTIVES:
        assert type(build_objective(ObjectiveConfig(type=name))).name == name


def test_noise_is_powered_unigram_mixed_with_uniform_and_sampled_from():
    prior = zipf_prior()
    noise = Noise(prior, power=0.75, uniform=0.2)
    powered = prior.double().exp() ** 0.75
    want = 0.8 * powered / powered.sum() + 0.2 / V
    torch.testing.assert_close(noise.log_q.exp().double(), want, atol=1e-6, rtol=0)
    torch.manual_seed(0)
    counts = torch.bincount(noise.sample(200_000), minlength=V).double()
    torch.testing.assert_close(counts / counts.sum(), want, atol=3e-3, rtol=0)
    torch.testing.assert_close(Noise(prior, 0.0, 0.0).log_q.exp(), torch.full((V,), 1 / V))
    torch.testing.assert_close(Noise(prior, 1.0, 1.0).log_q.exp(), torch.full((V,), 1 / V))


@pytest.mark.parametrize("target_term", ["corrected", "exact"])
def test_importance_sampling_is_a_corrected_softmax_over_target_and_samples(monkeypatch, target_term):
    head, hidden, targets = linear_head(), torch.randn(3, D), torch.tensor([0, 4, 9])
    samples = [4, 2, 2, 17]  # duplicates kept; 4 is row 1's own target (an accidental hit)
    fixed_samples(monkeypatch, samples)
    objective = build_objective(ObjectiveConfig(type="importance_sampling", samples=4, target_term=target_term))
    out = objective(head, hidden, targets)
    log_q = objective.noise(head).log_q
    logits = head.scores(hidden)
    want = 0.0
    for n, t in enumerate(targets.tolist()):
        row = [logits[n, t] - (math.log(4) + log_q[t] if target_term == "corrected" else 0.0)]
        row += [logits[n, j] - math.log(4) - log_q[j] for j in samples if j != t]
        want = want - (row[0] - torch.stack(row).logsumexp(0))
    torch.testing.assert_close(out.loss, want)


def test_importance_sampling_gradient_tends_to_the_cross_entropy_gradient():
    """With many samples the sampled softmax's gradient is the exact one. (With the target's logit corrected, its term
    of the estimated normaliser is off by its expected count S·Q(target), a bias of the order of p(target): small
    here, where most targets are rare words; the next test takes frequent ones.)"""
    vocab_size, grads = 2000, {}
    for name, objective in (("is", ImportanceSampling(samples=20_000)), ("ce", build_objective(ObjectiveConfig()))):
        torch.manual_seed(0)
        head = FullSoftmax(D, vocab_size)
        head.init_bias(zipf_prior(vocab_size))
        hidden = torch.randn(N, D, generator=torch.Generator().manual_seed(1), requires_grad=True)
        targets = torch.randint(0, vocab_size, (N,), generator=torch.Generator().manual_seed(2))
        objective(head, hidden, targets).loss.backward()
        grads[name] = hidden.grad
    assert (grads["is"] - grads["ce"]).norm() < 0.02 * grads["ce"].norm()


def test_only_the_exact_target_term_is_consistent_for_frequent_targets():
    """Frequent targets, many samples: correcting the target's logit by its expected count (thousands here) drops its
    term from the denominator, and the gradient keeps pushing it up whatever the model predicts; the exact term
    beside the samples' estimate of the rest of Z gives the cross-entropy gradient."""
    vocab_size, grads = 2000, {}
    objectives = {
        "corrected": ImportanceSampling(samples=20_000),
        "exact": ImportanceSampling(samples=20_000, exact_target=True),
        "ce": build_objective(ObjectiveConfig()),
    }
    for name, objective in objectives.items():
        torch.manual_seed(0)
        head = FullSoftmax(D, vocab_size)
        head.init_bias(zipf_prior(vocab_size))
        hidden = torch.randn(N, D, generator=torch.Generator().manual_seed(1), requires_grad=True)
        targets = torch.arange(N) % 4  # the four most frequent words: p(target) 0.03 to 0.12
        objective(head, hidden, targets).loss.backward()
        grads[name] = torch.cat([hidden.grad.flatten(), head.linear.bias.grad])
    assert (grads["exact"] - grads["ce"]).norm() < 0.03 * grads["ce"].norm()  # 1.6%
    assert (grads["corrected"] - grads["ce"]).norm() > 0.05 * grads["ce"].norm()  # 7.0%


def test_nce_is_logistic_regression_of_data_against_k_noise_words(monkeypatch):
    head, hidden, targets = linear_head(log_z=2.0), torch.randn(3, D), torch.tensor([0, 4, 9])
    fixed_samples(monkeypatch, [4, 1, 28])
    objective = NCE(samples=3)
    out = objective(head, hidden, targets)
    log_q = objective.noise(head).log_q
    scores = head.scores(hidden)  # already less log_z
    want = 0.0
    for n, t in enumerate(targets.tolist()):
        want = want - F.logsigmoid(scores[n, t] - math.log(3 * log_q[t].exp()))
        for j in (4, 1, 28):  # a noise word equal to the target stays: NCE's noise may draw it
            want = want - F.logsigmoid(-(scores[n, j] - math.log(3 * log_q[j].exp())))
    torch.testing.assert_close(out.loss, want)


def test_negative_sampling_ignores_the_noise_probabilities(monkeypatch):
    head, hidden, targets = linear_head(), torch.randn(3, D), torch.tensor([0, 4, 9])
    fixed_samples(monkeypatch, [4, 1])
    scores = head.scores(hidden)
    want = -(F.logsigmoid(scores[torch.arange(3), targets]) + F.logsigmoid(-scores[:, [4, 1]]).sum(1)).sum()
    torch.testing.assert_close(NegativeSampling(samples=2)(head, hidden, targets).loss, want)


def test_blackout_shares_one_weighted_denominator(monkeypatch):
    head, hidden, targets = linear_head(), torch.randn(3, D), torch.tensor([0, 4, 9])
    samples = [4, 2, 17]
    fixed_samples(monkeypatch, samples)
    objective = BlackOut(samples=3)
    out = objective(head, hidden, targets)
    q = objective.noise(head).log_q.exp()
    weighted = head.scores(hidden).exp() / q  # exp(s_w) / Q(w)
    want = 0.0
    for n, t in enumerate(targets.tolist()):
        others = [j for j in samples if j != t]  # S_K excludes the target
        denominator = weighted[n, t] + weighted[n, others].sum()
        want = want - torch.log(weighted[n, t] / denominator)
        want = want - torch.log(1 - weighted[n, others] / denominator).sum()
    torch.testing.assert_close(out.loss, want)


def test_beta_nce_is_a_power_loss_that_reduces_to_nce(monkeypatch):
    head, hidden, targets = linear_head(), torch.randn(3, D), torch.tensor([0, 4, 9])
    fixed_samples(monkeypatch, [4, 1, 28])
    nce = NCE(samples=3)(head, hidden, targets).loss
    torch.testing.assert_close(BetaNCE(3, beta=1.0)(head, hidden, targets).loss, nce)
    torch.testing.assert_close(BetaNCE(3, beta=1.0 + 1e-5)(head, hidden, targets).loss, nce, atol=1e-3, rtol=1e-4)
    objective = BetaNCE(3, beta=1.25)
    log_q = objective.noise(head).log_q
    scores = head.scores(hidden)
    want = 0.0
    for n, t in enumerate(targets.tolist()):
        p_data = torch.sigmoid(scores[n, t] - math.log(3) - log_q[t])
        want = want + (1 - p_data**0.25) / 0.25
        for j in (4, 1, 28):
            p_noise = torch.sigmoid(-(scores[n, j] - math.log(3) - log_q[j]))
            want = want + (1 - p_noise**0.25) / 0.25
    torch.testing.assert_close(objective(head, hidden, targets).loss, want)
    with pytest.raises(ValueError, match="objective.beta = 0"):
        BetaNCE(3, beta=0.0)


@pytest.mark.parametrize("name", SAMPLED_OBJECTIVES)
def test_the_selfnorm_penalty_composes_with_every_sampled_objective(monkeypatch, name):
    head, hidden, targets = linear_head(), torch.randn(N, D), torch.randint(0, V, (N,))
    fixed_samples(monkeypatch, [3, 5, 7])
    plain = build_objective(ObjectiveConfig(type=name, samples=3, nll_stride=1))(head, hidden, targets)
    penalised = build_objective(ObjectiveConfig(type=name, samples=3, selfnorm_alpha=0.5))(head, hidden, targets)
    log_z = head.scores(hidden).logsumexp(-1)
    torch.testing.assert_close(penalised.loss - plain.loss, 0.5 * log_z.pow(2).sum())
    exact = F.cross_entropy(head.scores(hidden), targets, reduction="sum")
    torch.testing.assert_close(plain.nll, exact)  # stride 1: every position
    torch.testing.assert_close(penalised.nll, exact)  # the penalty's rows give it for free


def test_the_training_nll_is_estimated_from_every_nth_position():
    head, hidden, targets = linear_head(), torch.randn(64, D), torch.randint(0, V, (64,))
    out = ImportanceSampling(samples=5, nll_stride=8)(head, hidden, targets)
    per_position = F.cross_entropy(head.scores(hidden), targets, reduction="none")
    torch.testing.assert_close(out.nll, per_position[::8].sum() * 8)
    assert not out.nll.requires_grad


def test_samples_are_shared_and_only_they_and_the_targets_get_gradients():
    head, hidden, targets = linear_head(), torch.randn(N, D), torch.randint(0, 10, (N,))
    torch.manual_seed(5)
    NCE(samples=4, nll_stride=N)(head, hidden, targets).loss.backward()
    touched = set(torch.nonzero(head.linear.weight.grad.abs().sum(1)).flatten().tolist())
    torch.manual_seed(5)
    drawn = set(Noise(head.log_prior, 1.0, 0.0).sample(4).tolist())
    assert touched == set(targets.tolist()) | drawn


def test_sampled_objectives_work_on_slim_heads_and_refuse_others():
    torch.manual_seed(0)
    slim = SlimSoftmax(D, V, subvectors=2, pool=10, log_z=1.0, learn_log_z=True)
    slim.init_bias(zipf_prior())
    hidden = torch.randn(N, D, requires_grad=True)
    BlackOut(samples=6)(slim, hidden, torch.randint(0, V, (N,))).loss.backward()
    assert slim.table.pools.grad.abs().sum() > 0 and slim.log_z_offset.grad is not None
    adaptive = AdaptiveSoftmax(D, V, cutoffs=[10])
    adaptive.init_bias(zipf_prior())
    with pytest.raises(ValueError, match="objective.type = nce .* head.type = full or slim or charcnn"):
        NCE(samples=3)(adaptive, hidden, torch.zeros(N, dtype=torch.long))
    with pytest.raises(ValueError, match='head.bias_init = "unigram"'):
        NCE(samples=3)(FullSoftmax(D, V), hidden, torch.zeros(N, dtype=torch.long))


def test_sampled_settings_are_validated_with_their_keys():
    for kwargs, key in (
        ({"samples": 0}, "objective.samples"),
        ({"noise_power": -1.0}, "objective.noise_power"),
        ({"noise_uniform": 1.5}, "objective.noise_uniform"),
        ({"nll_stride": 0}, "objective.nll_stride"),
    ):
        with pytest.raises(ValueError, match=key):
            build_objective(ObjectiveConfig(type="nce", **kwargs))


def test_config_refuses_combinations_that_cannot_work():
    with pytest.raises(
        ConfigError, match="needs head.type = full or slim or charcnn or dsoftmax or cnnsoftmax, got tree"
    ):
        config_from_dict({"head": {"type": "tree", "bias_init": "unigram"}, "objective": {"type": "nce"}})
    # every head gets the unigram from the trainer, so these need no bias setting
    for head, objective in (("full", "blackout"), ("class", "cross_entropy"), ("tree", "cross_entropy")):
        config_from_dict({"head": {"type": head}, "objective": {"type": objective}})


def test_normalisation_is_decided_by_head_and_objective():
    def cfg(head="full", objective="cross_entropy", alpha=0.0):
        return config_from_dict(
            {
                "head": {"type": head, "bias_init": "unigram", "slim_pool": 8},
                "objective": {"type": objective, "selfnorm_alpha": alpha},
            }
        )

    assert not self_normalised(cfg())
    assert self_normalised(cfg(alpha=0.1))
    assert all(self_normalised(cfg(objective=name)) for name in SAMPLED_OBJECTIVES)
    assert self_normalised(cfg(head="slim", objective="importance_sampling"))
    assert not self_normalised(cfg(head="class"))
    assert self_normalised(cfg(head="class", alpha=0.1))
    assert not self_normalised(cfg(head="tree", alpha=0.1))  # its scores are log-probabilities


def test_nce_with_a_learned_log_z_trains_a_self_normalised_model():
    """Fit per-context distributions (one-hot contexts, so the head can represent them exactly) with NCE, Z_c
    learned from log 9, and with cross-entropy: NCE's scores come out normalised without Z ever being computed, and
    its exact likelihood is close to the exact objective's."""
    torch.manual_seed(0)
    contexts = torch.arange(512) % D
    hidden = torch.eye(D)[contexts]
    targets = torch.distributions.Categorical(
        probs=torch.distributions.Dirichlet(torch.full((V,), 0.5)).sample((D,))[contexts]
    ).sample()
    results = {}
    for name, cfg in (("nce", ObjectiveConfig(type="nce", samples=20)), ("ce", ObjectiveConfig())):
        head = build_head(HeadConfig(log_z=9.0, learn_log_z=True), D, V)
        head.init_bias(zipf_prior())
        objective = build_objective(cfg)
        optimizer = torch.optim.Adam(head.parameters(), lr=0.05)
        torch.manual_seed(1)
        for _ in range(100):
            optimizer.zero_grad()
            (objective(head, hidden, targets).loss / len(targets)).backward()
            optimizer.step()
        with torch.no_grad():
            score, log_norms = head.target_terms(hidden, targets)
            results[name] = ((log_norms.sum(-1) - score).mean().item(), log_norms.sum(-1).abs().mean().item())
    assert results["nce"][1] < 0.25  # |log Z| small: self-normalised
    assert results["nce"][0] < results["ce"][0] * 1.05


@pytest.mark.parametrize(
    ("head", "objective"),
    [
        ("full", {"type": "importance_sampling", "samples": 20}),
        ("full", {"type": "negative_sampling", "samples": 10, "noise_power": 0.75}),
        ("full", {"type": "blackout", "samples": 20, "noise_power": 0.5}),
        ("full", {"type": "beta_nce", "samples": 20, "beta": 1.25}),
        ("slim", {"type": "nce", "samples": 20, "selfnorm_alpha": 0.1, "selfnorm_gamma": 0.5}),
    ],
)
@pytest.mark.slow  # trains, or builds the benchmarks' full-size models
def test_sampled_objectives_train_through_the_loop(write_config, tmp_path, head, objective):
    config = write_config("sentence", head, objective=objective, train={"epochs": 1})
    settings = ["head.bias_init=unigram", "head.learn_log_z=true", "head.slim_pool=32"]
    assert main(["fit", str(config), "--out", str(tmp_path / "run"), *(f"--set={s}" for s in settings)]) == 0
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert (
        math.isfinite(results["test"]["ppl"]) and results["test"]["ppl"] < 30
    )  # uniform over the ~43 words is 43; exact CE gets 21


def comparison_rows(corpus: str) -> tuple[Path, dict[str, list[str]]]:
    """The config of configs/<corpus>_objectives.rows.toml and its rows, all tables: name -> --set overrides."""
    spec = tomllib.loads((ROOT / "configs" / f"{corpus}_objectives.rows.toml").read_text())
    config = ROOT / "configs" / spec.get("config", f"{corpus}_objectives.toml")
    common = spec.get("set", [])
    tables = [table for table in spec.values() if isinstance(table, dict)]
    return config, {name: [*common, *row["set"]] for table in tables for name, row in table.items()}


@pytest.mark.slow  # trains, or builds the benchmarks' full-size models
@pytest.mark.parametrize("corpus", ["ptb", "ptb8", "ptb_medium", "gutenberg"])
def test_every_comparison_row_builds_its_model_and_objective(tmp_path, corpus):
    config, rows = comparison_rows(corpus)
    assert {"full-ce", "class-ce", "tree-ce", "full-is", "full-nce"} <= set(rows)
    vocab_size = 50_000 if corpus == "gutenberg" else 10_001
    words = [f"w{i}" for i in range(vocab_size)]
    (tmp_path / "ckpt").mkdir()  # stands for the full-ce run whose embeddings the clustered tree and classes split
    save_file({"embedding.weight": torch.randn(vocab_size, 4)}, str(tmp_path / "ckpt" / "model.safetensors"))
    for name, settings in rows.items():
        overrides = [
            f"{s.split('=')[0]}={tmp_path / 'ckpt'}"
            if s.startswith(("head.tree_embeddings=", "head.class_embeddings="))
            else s
            for s in settings
        ]
        cfg = load_config(config, overrides)
        model = LSTMLM(vocab_size, cfg.model, cfg.head, words)
        model.head.init_bias(zipf_prior(vocab_size))
        objective = build_objective(cfg.objective)
        hidden, targets = torch.randn(6, cfg.model.hidden_size), torch.randint(0, vocab_size, (6,))
        assert torch.isfinite(objective(model.head, hidden, targets).loss), name


@pytest.mark.parametrize("name", SAMPLED_OBJECTIVES)
def test_sampled_losses_are_float32_under_bf16_autocast(monkeypatch, name):
    """As the exact heads' terms (tests/test_heads.py): the sampled scores leave the head in float32 under bf16
    autocast, so that no loss mixes bf16 logits with float32 reductions (what failed on CUDA for the adaptive head)."""
    head, hidden, targets = linear_head(), torch.randn(N, D), torch.randint(0, V, (N,))
    fixed_samples(monkeypatch, [3, 5, 7])
    config = ObjectiveConfig(type=name, samples=3, nll_stride=1)
    want = build_objective(config)(head, hidden, targets)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        target, sampled = head.sampled_scores(hidden, targets, torch.tensor([3, 5, 7]))
        got = build_objective(config)(head, hidden, targets)  # a fresh one: an adaptive proposal moves each step
    assert (target.dtype, sampled.dtype, got.loss.dtype) == (torch.float32,) * 3
    torch.testing.assert_close(got.loss, want.loss, rtol=0.02, atol=0.1)


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


@pytest.mark.slow  # trains, or builds the benchmarks' full-size models
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
