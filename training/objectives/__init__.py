"""Training objectives: how a head is trained, kept apart from the head itself (docs/design.md).

An objective maps (head, hidden ``[N, D]``, targets ``[N]``) to a summed loss over the N positions; the trainer
chooses the reduction. The self-normalisation penalty rides on top of any objective. ``exact`` holds cross-entropy
and the penalty, ``sampled`` the objectives that never compute the normaliser, with two of their own files:
``target_sampling`` (a batch's own vocabulary) and ``adaptive_is`` (a proposal that follows the model). An objective
that keeps state across steps gives it to checkpoints through ``state_dict`` / ``load_state_dict`` (all have them).
"""

from __future__ import annotations

from lmserve.training.config import Config, ObjectiveConfig
from lmserve.training.objectives.adaptive_is import AdaptiveImportanceSampling
from lmserve.training.objectives.exact import CrossEntropy, ObjectiveOutput, SelfNormPenalty
from lmserve.training.objectives.sampled import (
    NCE,
    BetaNCE,
    BlackOut,
    ImportanceSampling,
    NegativeSampling,
    Noise,
    SampledObjective,
)
from lmserve.training.objectives.target_sampling import TargetSampling

SAMPLED_TYPES = {
    cls.name: cls
    for cls in (
        ImportanceSampling,
        NCE,
        NegativeSampling,
        BlackOut,
        BetaNCE,
        TargetSampling,
        AdaptiveImportanceSampling,
    )
}


def build_objective(cfg: ObjectiveConfig):
    selfnorm = SelfNormPenalty(cfg.selfnorm_alpha, cfg.selfnorm_gamma) if cfg.selfnorm_alpha > 0 else None
    if cfg.type == "cross_entropy":
        return CrossEntropy(selfnorm)
    if cfg.type not in SAMPLED_TYPES:
        raise ValueError(f"objective.type = {cfg.type!r}, expected one of cross_entropy, {', '.join(SAMPLED_TYPES)}")
    common = dict(
        noise_power=cfg.noise_power,
        noise_uniform=cfg.noise_uniform,
        nll_stride=cfg.nll_stride,
        nll_every=cfg.nll_every,
        selfnorm=selfnorm,
    )
    if cfg.type == "beta_nce":
        return BetaNCE(cfg.samples, cfg.beta, **common)
    if cfg.type == "importance_sampling":
        return ImportanceSampling(cfg.samples, exact_target=cfg.target_term == "exact", **common)
    if cfg.type == "adaptive_importance_sampling":
        return AdaptiveImportanceSampling(
            cfg.samples, cfg.adapt_rate, exact_target=cfg.target_term == "exact", **common
        )
    return SAMPLED_TYPES[cfg.type](cfg.samples, **common)


def self_normalised(cfg: Config) -> bool:
    """Whether the model's cheap target score is served as its log-probability without being normalised.

    A sampled objective never computes the normaliser of a linear head, and the α penalty is there to make it
    unnecessary: either way the model is meant to be used through its unnormalised scores, and says so, with its
    measured log Z. A tree's scores are exact log-probabilities whatever the objective.
    """
    if cfg.head.type == "tree":
        return False
    return cfg.objective.selfnorm_alpha > 0 or cfg.objective.type in SAMPLED_TYPES


__all__ = [
    "AdaptiveImportanceSampling",
    "BetaNCE",
    "BlackOut",
    "CrossEntropy",
    "ImportanceSampling",
    "NCE",
    "NegativeSampling",
    "Noise",
    "ObjectiveOutput",
    "SAMPLED_TYPES",
    "SampledObjective",
    "SelfNormPenalty",
    "build_objective",
    "self_normalised",
    "TargetSampling",
]
