"""Exact cross-entropy, the self-normalisation penalty that rides on any objective, and what objectives return."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmserve.training.heads import Head


class SelfNormPenalty:
    """alpha * sum_k (log Z_k)^2 per position (Devlin et al. 2014), pushing every softmax the head computes towards
    Z = 1 so that the unnormalised score can be used as a log-probability at serving time.

    With gamma < 1 only a random gamma fraction of positions pays it, scaled by 1/gamma so that the expected penalty is
    unchanged (Andreas et al. 2015's infrequent normalisation); objectives that do not otherwise compute Z then
    compute it only on those rows.
    """

    def __init__(self, alpha: float, gamma: float = 1.0):
        if alpha < 0 or not 0 < gamma <= 1:
            raise ValueError(
                f"objective.selfnorm_alpha must be >= 0 and selfnorm_gamma in (0, 1], got {alpha}, {gamma}"
            )
        self.alpha = alpha
        self.gamma = gamma

    def rows(self, n: int, device=None) -> torch.Tensor | None:
        """Positions that pay the penalty this step (None = all)."""
        if self.gamma >= 1:
            return None
        return torch.nonzero(torch.rand(n, device=device) < self.gamma).squeeze(1)

    def __call__(self, log_norms: torch.Tensor) -> torch.Tensor:
        """Summed penalty over the given rows of log normalisers ``[n, K]``."""
        return self.alpha / self.gamma * log_norms.pow(2).sum()


@dataclass
class ObjectiveOutput:
    loss: torch.Tensor  # summed over positions, what the trainer back-propagates after reduction
    # summed negative log-likelihood (detached), for the training perplexity: exact, or for sampled objectives
    # estimated from every objective.nll_stride-th position, so that the step stays independent of |V|
    nll: torch.Tensor


class CrossEntropy:
    """Exact cross-entropy through the head's normalised target log-probabilities."""

    def __init__(self, selfnorm: SelfNormPenalty | None = None):
        self.selfnorm = selfnorm

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Objectives may keep state across steps that a checkpoint saves (``SampledObjective.state_dict``); this one
        keeps none."""
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if state:
            raise ValueError(f"objective.type = cross_entropy keeps no state, the checkpoint has {sorted(state)}")

    def __call__(self, head: Head, hidden: torch.Tensor, targets: torch.Tensor) -> ObjectiveOutput:
        score, log_norms = head.target_terms(hidden, targets)
        nll = (log_norms.sum(-1) - score).sum()
        loss = nll
        if self.selfnorm is not None:
            rows = self.selfnorm.rows(len(targets), hidden.device)
            loss = loss + self.selfnorm(log_norms if rows is None else log_norms[rows])
        return ObjectiveOutput(loss, nll.detach())
