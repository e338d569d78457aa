"""Target sampling (Jean, Cho, Memisevic & Bengio 2015, "On using very large target vocabulary for neural machine
translation"): the softmax of each step over a vocabulary of the batch's own, not over a sample drawn for it alone.

Jean et al. partition the training data and give each part the set V' of its target words, topped up to a fixed
size; the softmax of every position of the part runs over V'. Here a part is one training batch: V' is the batch's
distinct targets together with ``objective.samples`` words drawn from the proposal Q (``Noise``: the unigram to the
power ``noise_power``, mixed with the uniform by ``noise_uniform``). Every position shares V', so a step costs one
``[N, D] x [D, |V'|]`` product, and every target is some other position's negative.

V' is a random set, and its words are not equally likely to be in it: a frequent word is in almost every batch's
targets, a rare one only in the batch that holds it. Each word's importance weight is the inverse of its probability
of being in V' besides a position's own target, π(w) = 1 - (1 - u(w))^(N-1) · (1 - Q(w))^S for the other N - 1
positions, taken as drawn from the training unigram u, and S draws from Q, and a position's loss is

    -s_t + log( e^{s_t} + Σ_{w ∈ V', w ≠ t} e^{s_w} / π(w) )

the target's exact term beside the Horvitz-Thompson estimate of the rest of the normaliser, unbiased over the
draw of V' (``importance_sampling`` with ``target_term = "exact"`` is the same with V' the samples alone and
S·Q(w) in place of π(w)).
"""

from __future__ import annotations

import torch

from lmserve.training.heads import LinearHead
from lmserve.training.objectives.sampled import ImportanceSampling, log1mexp


class TargetSampling(ImportanceSampling):
    name = "target_sampling"

    def __init__(self, samples: int, **kwargs):
        super().__init__(samples, exact_target=True, **kwargs)

    def batch_vocabulary(self, head: LinearHead, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(V' ``[S']``: the batch's distinct targets and draws from Q, log π of each ``[S']``: the probability that
        it is in V' given that one position's target is another word)."""
        noise = self.noise(head)
        ids = torch.unique(torch.cat([targets, noise.sample(self.samples)]))
        log_u = head.log_prior.index_select(0, ids).double()
        log_q = noise.log_q.index_select(0, ids).double()
        # log P(w not in V'): no target among the other N - 1 is w, nor any of the S draws
        log_miss = (len(targets) - 1) * torch.log1p(-log_u.exp()) + self.samples * torch.log1p(-log_q.exp())
        return ids, log1mexp(log_miss.clamp(max=-1e-12)).float()

    def losses(self, head, hidden, targets):
        ids, log_pi = self.batch_vocabulary(head, targets)
        target, sampled = head.sampled_scores(hidden, targets, ids)
        hits = ids.unsqueeze(0) == targets.unsqueeze(1)
        return self.position_losses(target, sampled, None, log_pi, hits)

    def position_losses(self, target, sampled, target_log_q, sampled_log_q, hits):
        """``sampled_log_q`` is log π here, the log-probability of each word of V' to be in it."""
        sampled = (sampled - sampled_log_q).masked_fill(hits, float("-inf"))
        return torch.logsumexp(torch.cat([target.unsqueeze(1), sampled], dim=1), dim=1) - target
