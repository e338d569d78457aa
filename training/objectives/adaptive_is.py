"""Adaptive importance sampling (Bengio & Senécal 2008, "Adaptive importance sampling to accelerate training of a
neural probabilistic language model"): the sampled softmax of ``importance_sampling`` with a proposal that follows
the model.

Importance sampling estimates the normaliser best when the proposal Q is close to the model's own distribution;
a fixed unigram is close to it only at the start. Bengio & Senécal adapt Q during training from the importance
weights the step computes anyway: each position's self-normalised weights over the samples,
ω_nj = e^{s_nj - log Q(j)} / Σ_k e^{s_nk - log Q(k)}, estimate the model's p(· | h_n) on the words drawn, and their
mean over the batch estimates the model's unigram distribution p̄(w) = E_h[p(w | h)]. Q's base distribution moves
towards it by ``objective.adapt_rate`` a step,

    base ← (1 - rate) · base + rate · mean_n Σ_j ω_nj [j = w],

starting from the fixed proposal (the unigram to the power ``noise_power``) and always mixed with the uniform by
``noise_uniform``, so that no word's Q falls to 0. (Their proposal is an adapted n-gram; this is its unigram case,
which one ``[N, D] x [D, S]`` product per step can sample from, shared by the batch.) The adapted base is training
state: checkpoints keep it (``state_dict``), and under torchrun the ranks average their estimates so that they all
draw from the same Q.
"""

from __future__ import annotations

import torch

from lmserve.training.objectives.sampled import ImportanceSampling


class AdaptiveImportanceSampling(ImportanceSampling):
    name = "adaptive_importance_sampling"

    def __init__(self, samples: int, adapt_rate: float, **kwargs):
        super().__init__(samples, **kwargs)
        if not 0 <= adapt_rate <= 1:
            raise ValueError(f"objective.adapt_rate = {adapt_rate}: expected a step in [0, 1]")
        self.adapt_rate = adapt_rate
        self.base: torch.Tensor | None = None  # the adapted distribution before the uniform mixture, [V]

    def noise(self, head):
        fresh = self._noise_from is not head.log_prior
        noise = super().noise(head)
        if self.base is None:  # the start: the fixed proposal's base, unigram ** noise_power
            base = self.noise_power * head.log_prior.double()
            self.base = (base - base.logsumexp(0)).exp()
        elif fresh:  # a base restored from a checkpoint (or adapted for another unigram's vocabulary)
            if len(self.base) != len(head.log_prior):
                raise ValueError(
                    f"objective.type = {self.name}: the adapted proposal covers {len(self.base)} words, the "
                    f"vocabulary {len(head.log_prior)}"
                )
            noise.set(self.base.clamp(min=1e-300).log(), self.noise_uniform)
        return noise

    def losses(self, head, hidden, targets):
        noise = self.noise(head)
        ids = noise.sample(self.samples)
        target, sampled = head.sampled_scores(hidden, targets, ids)
        sampled_log_q = noise.log_q.index_select(0, ids)
        hits = ids.unsqueeze(0) == targets.unsqueeze(1)
        losses = self.position_losses(target, sampled, noise.log_q.index_select(0, targets), sampled_log_q, hits)
        if self.adapt_rate > 0:
            self.adapt(noise, ids, sampled.detach(), sampled_log_q)
        return losses

    @torch.no_grad()
    def adapt(self, noise, ids: torch.Tensor, sampled: torch.Tensor, sampled_log_q: torch.Tensor) -> None:
        """Move Q's base towards the model's unigram as this step's importance weights estimate it."""
        weights = torch.softmax(sampled.double() - sampled_log_q.double(), dim=1)  # [N, S], rows sum to 1
        estimate = torch.zeros_like(self.base).index_add_(0, ids, weights.mean(0))
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(estimate)
            estimate /= torch.distributed.get_world_size()
        self.base = (1 - self.adapt_rate) * self.base + self.adapt_rate * estimate
        noise.set(self.base.clamp(min=1e-300).log(), self.noise_uniform)

    def state_dict(self):
        return {} if self.base is None else {"proposal_base": self.base}

    def load_state_dict(self, state):
        unknown = set(state) - {"proposal_base"}
        if unknown:
            raise ValueError(f"objective.type = {self.name}: unexpected state {sorted(unknown)} in the checkpoint")
        if "proposal_base" in state:
            self.base = state["proposal_base"].double()
            self._noise_from = None  # the next step's proposal is rebuilt from it
