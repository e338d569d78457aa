"""Sampled objectives: train a linear head (full, slim or charcnn) without computing its normaliser.

Each step draws ``objective.samples`` words once, with replacement, from a proposal Q (the training unigram to the
power ``noise_power``, mixed with the uniform distribution by ``noise_uniform``), and the whole batch shares them:
a step costs one ``[N, D] x [D, S]`` product instead of ``[N, D] x [D, V]``. The objectives differ in what they make
of the target's score s_t and the samples' scores s_j (both already less the head's log_z):

- ``importance_sampling`` — sampled softmax (Bengio & Senécal 2008; Jean et al. 2015): a softmax over the target and
  the samples, each sample's logit corrected by -log(expected count S·Q(w)); samples equal to the target are
  removed. The target's own logit is corrected too by default (``target_term = "corrected"``, TensorFlow's sampled
  softmax), which stops being consistent as S·Q(target) grows past 1: the target's term of the denominator shrinks
  by that count, so frequent targets keep being pushed up even when the model already predicts them, and more
  samples make it worse. With ``target_term = "exact"`` the denominator is the target's exact term plus the samples'
  unbiased estimate of the rest of Z, Σ_{j≠t} exp(s_j) / (S·Q(j)): the loss is then -s_t + log Ẑ with E[Ẑ] = Z;
- ``nce`` — noise-contrastive estimation (Gutmann & Hyvärinen 2010; Mnih & Teh 2012): logistic regression of data
  against k = S noise words on Δ(w) = s_w - log(k·Q(w)); the scores themselves become log-probabilities;
- ``negative_sampling`` — word2vec's simplification (Mikolov et al. 2013): the same on Δ(w) = s_w, so the scores
  are not log-probabilities;
- ``blackout`` — Ji et al. 2016: a softmax over the target and the samples weighted by 1/Q, one denominator shared by
  all of them, -log p̃(target) - Σ_j log(1 - p̃(j)); samples equal to the target are removed (the paper's S_K
  excludes it);
- ``beta_nce`` — Labeau (2018, ch. 4): NCE's log-loss on the classification probability P(data | w) replaced by the
  one-sided power divergence (1 - P^(β-1)) / (β - 1), which is NCE at β = 1.

Only words reached through the targets and the samples get gradients; the exact normaliser is computed only for the
self-normalisation penalty's rows and for the training-perplexity estimate (every ``nll_stride``-th position, on
every ``nll_every``-th step, the steps between counting the last estimate per token: a head that computes its output
vectors, charcnn and cnnsoftmax, runs its CNN over the whole vocabulary for it, which at 50k words costs more than
the sampled step itself).
"""

from __future__ import annotations

import abc
import math

import torch
from torch.nn import functional as F

from lmserve.training.config import LINEAR_HEADS
from lmserve.training.heads import Head, LinearHead
from lmserve.training.objectives.exact import ObjectiveOutput, SelfNormPenalty


class Noise:
    """The proposal Q = (1 - λ) · u^a / Σ u^a + λ / |V| over the training unigram u, and draws from it."""

    def __init__(self, log_prior: torch.Tensor, power: float, uniform: float):
        log_q = power * log_prior.double()
        self.set(log_q - log_q.logsumexp(0), uniform)

    def set(self, log_base: torch.Tensor, uniform: float) -> None:
        """Q = (1 - uniform) · base + uniform / |V| for a normalised ``log_base`` (an adaptive proposal moves it)."""
        log_q = log_base.double()
        if uniform > 0:
            flat = torch.full_like(log_q, math.log(uniform) - math.log(len(log_q)))
            log_q = torch.logaddexp(log_q + math.log1p(-uniform), flat) if uniform < 1 else flat
        self.log_q = log_q.float()
        cdf = log_q.exp().cumsum(0)
        self.cdf = cdf / cdf[-1]

    def sample(self, n: int) -> torch.Tensor:
        """``n`` ids drawn with replacement: inverse CDF of uniform draws, O(n log |V|) from the global torch RNG
        (so a checkpoint's RNG state makes a resumed run draw the same words)."""
        u = torch.rand(n, dtype=torch.float64, device=self.cdf.device)
        return torch.searchsorted(self.cdf, u, right=True).clamp_(max=len(self.cdf) - 1)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - e^x) for x <= 0, accurate at both ends (Mächler 2012)."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


class SampledObjective(abc.ABC):
    name: str

    def __init__(
        self,
        samples: int,
        noise_power: float = 1.0,
        noise_uniform: float = 0.0,
        nll_stride: int = 64,
        selfnorm: SelfNormPenalty | None = None,
        nll_every: int = 1,
    ):
        if samples < 1:
            raise ValueError(f"objective.samples = {samples}: expected at least 1 word drawn per step")
        if noise_power < 0:
            raise ValueError(f"objective.noise_power = {noise_power}: expected >= 0 (0 = uniform noise)")
        if not 0 <= noise_uniform <= 1:
            raise ValueError(f"objective.noise_uniform = {noise_uniform}: expected a mixture weight in [0, 1]")
        if nll_stride < 1:
            raise ValueError(f"objective.nll_stride = {nll_stride}: expected >= 1 (1 = every position)")
        self.samples = samples
        self.noise_power = noise_power
        self.noise_uniform = noise_uniform
        if nll_every < 1:
            raise ValueError(f"objective.nll_every = {nll_every}: expected >= 1 (1 = every step)")
        self.nll_stride = nll_stride
        self.nll_every = nll_every
        self.steps = 0  # calls so far, for nll_every
        self.per_token: torch.Tensor | None = None  # the last training-NLL estimate per token
        self.selfnorm = selfnorm
        self._noise: Noise | None = None
        self._noise_from: torch.Tensor | None = None

    def noise(self, head: Head) -> Noise:
        """Q from the unigram the head was handed (built once per distribution)."""
        if head.log_prior is None:
            raise ValueError(
                f"objective.type = {self.name} draws noise from the training unigram, which the head receives only "
                'with head.bias_init = "unigram"'
            )
        if self._noise_from is not head.log_prior:
            self._noise = Noise(head.log_prior, self.noise_power, self.noise_uniform)
            self._noise_from = head.log_prior
        return self._noise

    @abc.abstractmethod
    def position_losses(
        self,
        target: torch.Tensor,
        sampled: torch.Tensor,
        target_log_q: torch.Tensor,
        sampled_log_q: torch.Tensor,
        hits: torch.Tensor,
    ) -> torch.Tensor:
        """Loss ``[N]`` from the targets' scores ``[N]``, the shared samples' scores ``[N, S]``, their log Q (``[N]``
        and ``[S]``), and ``hits [N, S]``: where a sample is the row's own target."""

    def losses(self, head: LinearHead, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss of each position ``[N]``: ``objective.samples`` words drawn from Q, shared by the batch."""
        noise = self.noise(head)
        ids = noise.sample(self.samples)
        return self.position_losses(
            *head.sampled_scores(hidden, targets, ids),
            noise.log_q.index_select(0, targets),
            noise.log_q.index_select(0, ids),
            ids.unsqueeze(0) == targets.unsqueeze(1),
        )

    def state_dict(self) -> dict[str, torch.Tensor]:
        """What a checkpoint must keep of the objective for a resumed run to go on as it would have: nothing for an
        objective whose proposal is fixed (``adaptive_importance_sampling`` keeps its adapted one)."""
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if state:
            raise ValueError(f"objective.type = {self.name} keeps no state, the checkpoint has {sorted(state)}")

    def __call__(self, head: Head, hidden: torch.Tensor, targets: torch.Tensor) -> ObjectiveOutput:
        if not isinstance(head, LinearHead):
            raise ValueError(
                f"objective.type = {self.name} scores a sample of words by dot products: it needs head.type = "
                f"{' or '.join(LINEAR_HEADS)}, got {type(head).__name__}"
            )
        losses = self.losses(head, hidden, targets)
        loss, nll = losses.sum(), None
        if self.selfnorm is not None:
            rows = self.selfnorm.rows(len(targets), hidden.device)
            if rows is None:
                score, log_norms = head.target_terms(hidden, targets)
                nll = (log_norms.sum(-1) - score).sum().detach()
            else:
                _, log_norms = head.target_terms(hidden[rows], targets[rows])
            loss = loss + self.selfnorm(log_norms)
        self.steps += 1
        if nll is None and ((self.steps - 1) % self.nll_every or not len(targets)) and self.per_token is not None:
            nll = self.per_token * len(targets)  # the last estimate per token, for this step's tokens
        elif nll is None:
            with torch.no_grad():
                score, log_norms = head.target_terms(hidden[:: self.nll_stride], targets[:: self.nll_stride])
                self.per_token = (log_norms.sum(-1) - score).mean() if len(score) else torch.zeros(())
                nll = self.per_token * len(targets)
        return ObjectiveOutput(loss, nll)


class ImportanceSampling(SampledObjective):
    name = "importance_sampling"

    def __init__(self, samples: int, exact_target: bool = False, **kwargs):
        super().__init__(samples, **kwargs)
        self.exact_target = exact_target

    def position_losses(self, target, sampled, target_log_q, sampled_log_q, hits):
        log_count = math.log(self.samples)
        if not self.exact_target:
            target = target - (log_count + target_log_q)
        sampled = (sampled - (log_count + sampled_log_q)).masked_fill(hits, float("-inf"))
        return torch.logsumexp(torch.cat([target.unsqueeze(1), sampled], dim=1), dim=1) - target


class NCE(SampledObjective):
    name = "nce"

    def _deltas(self, target, sampled, target_log_q, sampled_log_q):
        """Log-odds that a word came from the data rather than from the k = S noise words: s_w - log(k Q(w))."""
        log_k = math.log(self.samples)
        return target - (log_k + target_log_q), sampled - (log_k + sampled_log_q)

    def position_losses(self, target, sampled, target_log_q, sampled_log_q, hits):
        target, sampled = self._deltas(target, sampled, target_log_q, sampled_log_q)
        return F.softplus(-target) + F.softplus(sampled).sum(1)


class NegativeSampling(SampledObjective):
    name = "negative_sampling"

    def position_losses(self, target, sampled, target_log_q, sampled_log_q, hits):
        return F.softplus(-target) + F.softplus(sampled).sum(1)


class BlackOut(SampledObjective):
    name = "blackout"

    def position_losses(self, target, sampled, target_log_q, sampled_log_q, hits):
        target = target - target_log_q
        sampled = (sampled - sampled_log_q).masked_fill(hits, float("-inf"))
        shared = torch.logsumexp(torch.cat([target.unsqueeze(1), sampled], dim=1), dim=1, keepdim=True)
        return (shared.squeeze(1) - target) - log1mexp(sampled - shared).sum(1)


class BetaNCE(NCE):
    name = "beta_nce"

    def __init__(self, samples: int, beta: float, **kwargs):
        super().__init__(samples, **kwargs)
        if beta <= 0:
            raise ValueError(f"objective.beta = {beta}: expected > 0 (1 = NCE)")
        self.beta = beta

    def position_losses(self, target, sampled, target_log_q, sampled_log_q, hits):
        if self.beta == 1:
            return super().position_losses(target, sampled, target_log_q, sampled_log_q, hits)
        target, sampled = self._deltas(target, sampled, target_log_q, sampled_log_q)

        def loss(log_p):  # (1 - p^(β-1)) / (β - 1), -log p in the limit β -> 1
            return -torch.expm1((self.beta - 1) * log_p) / (self.beta - 1)

        return loss(F.logsigmoid(target)) + loss(F.logsigmoid(-sampled)).sum(1)
