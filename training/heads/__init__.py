"""Output layers by name. A new head is one file here and one line in ``build_head``."""

from __future__ import annotations

from training.config import HeadConfig
from training.heads.adaptive import AdaptiveSoftmax
from training.heads.base import Head
from training.heads.full import FullSoftmax

HEAD_TYPES = ("full", "adaptive")


def build_head(cfg: HeadConfig, in_dim: int, vocab_size: int) -> Head:
    if cfg.type == "full":
        return FullSoftmax(in_dim, vocab_size)
    if cfg.type == "adaptive":
        return AdaptiveSoftmax(in_dim, vocab_size, cfg.cutoffs, cfg.div_value)
    raise ValueError(f"head.type = {cfg.type!r}, expected one of {', '.join(HEAD_TYPES)}")


__all__ = ["AdaptiveSoftmax", "FullSoftmax", "Head", "HEAD_TYPES", "build_head"]
