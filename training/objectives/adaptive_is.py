"""Adaptive importance sampling (Bengio & Senécal 2008, "Adaptive importance sampling to accelerate training of a
neural probabilistic language model"): the sampled softmax of ``importance_sampling`` with a proposal that follows
the model.

Importance sampling estimates the normaliser best when the proposal Q is close to the model's own distribution;
a fixed unigram is close to it only at the start. Bengio & Senécal adapt Q during training from the importance
weights the step computes anyway: each position's self-normalised weights over the samples,
ω_nj = e^{s_nj - log Q(j)} / Σ_k e^{s_nk - log Q(k)}, estimate the model's p(· | h_n) on the words drawn, and their
mean over the batch estimates the model's unigram distribution p̄(w) = E_h[p(w | h)]. The estimate of p̄ moves
towards it by ``objective.adapt_rate`` a step,

    p̄ ← (1 - rate) · p̄ + rate · mean_n Σ_j ω_nj [j = w],

starting from the training unigram, and Q is built from it as the fixed proposal is built from the training
unigram: p̄ to the power ``noise_power``, normalised, mixed with the uniform by ``noise_uniform`` (so that no word's Q
falls to 0). The power matters: a proposal that follows p̄ itself concentrates its samples on frequent words as
training goes on, and rare words are seldom offered as negatives, as with the plain unigram proposal: with the
power adaptive IS beats fixed IS, and without it falls behind (Gutenberg 50k, 1M tokens:
docs/benchmarks/output-layers.md, ``output_layers_v2.json``). (Bengio & Senécal's proposal is an adapted n-gram;
this is its unigram case, which one ``[N, D] x [D, S]`` product per step can sample from, shared by the batch.) The
estimate is training state: checkpoints keep it (``state_dict``), and under torchrun the ranks average their
estimates so that they all draw from the same Q.
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
        self.unigram: torch.Tensor | None = None  # the estimate of the model's unigram distribution, [V]

    def noise(self, head):
        fresh = self._noise_from is not head.log_prior
        noise = super().noise(head)
        if self.unigram is None:  # the start: the training unigram, whose proposal the fixed one already is
            self.unigram = head.log_prior.double().softmax(0)
        elif fresh:  # an estimate restored from a checkpoint (or made for another unigram's vocabulary)
            if len(self.unigram) != len(head.log_prior):
                raise ValueError(
                    f"objective.type = {self.name}: the adapted proposal covers {len(self.unigram)} words, the "
                    f"vocabulary {len(head.log_prior)}"
                )
            self.follow(noise)
        return noise

    def follow(self, noise) -> None:
        """Q from the estimate, as the fixed proposal is made from the training unigram."""
        base = self.noise_power * self.unigram.clamp(min=1e-300).log()
        noise.set(base - base.logsumexp(0), self.noise_uniform)

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
        """Move the estimate towards the model's unigram as this step's importance weights see it, and Q with it."""
        weights = torch.softmax(sampled.double() - sampled_log_q.double(), dim=1)  # [N, S], rows sum to 1
        estimate = torch.zeros_like(self.unigram).index_add_(0, ids, weights.mean(0))
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(estimate)
            estimate /= torch.distributed.get_world_size()
        self.unigram = (1 - self.adapt_rate) * self.unigram + self.adapt_rate * estimate
        self.follow(noise)

    def state_dict(self):
        return {} if self.unigram is None else {"unigram_estimate": self.unigram}

    def load_state_dict(self, state):
        unknown = set(state) - {"unigram_estimate"}
        if unknown:
            raise ValueError(f"objective.type = {self.name}: unexpected state {sorted(unknown)} in the checkpoint")
        if "unigram_estimate" in state:
            self.unigram = state["unigram_estimate"].double()
            self._noise_from = None  # the next step's proposal is rebuilt from it
