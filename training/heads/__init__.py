"""Output layers by name. A new head is one file here and one line in ``build_head``."""

from __future__ import annotations

from lmserve.training.config import HeadConfig
from lmserve.training.heads.adaptive import AdaptiveSoftmax
from lmserve.training.heads.base import Head, LinearHead, Speller
from lmserve.training.heads.charcnn import CharCNNSoftmax
from lmserve.training.heads.class_based import ClassSoftmax
from lmserve.training.heads.cnnsoftmax import CNNSoftmax
from lmserve.training.heads.dsoftmax import DSoftmax
from lmserve.training.heads.full import FullSoftmax
from lmserve.training.heads.slim import SlimSoftmax
from lmserve.training.heads.tree import TREE_TYPES, TreeSoftmax

HEAD_TYPES = ("full", "adaptive", "class", "tree", "slim", "charcnn", "dsoftmax", "cnnsoftmax")


def build_head(cfg: HeadConfig, in_dim: int, vocab_size: int, words: list[str] | None = None) -> Head:
    """``words``, the vocabulary's tokens by id, is needed by heads built from spellings (charcnn, cnnsoftmax) only."""
    if cfg.type == "full":
        head = FullSoftmax(in_dim, vocab_size, cfg.log_z, cfg.learn_log_z)
    elif cfg.type == "adaptive":
        head = AdaptiveSoftmax(in_dim, vocab_size, cfg.cutoffs, cfg.div_value)
    elif cfg.type == "class":
        head = ClassSoftmax(in_dim, vocab_size, cfg.classes, cfg.class_embeddings)
    elif cfg.type == "tree":
        head = TreeSoftmax(in_dim, vocab_size, cfg.tree, cfg.tree_embeddings)
    elif cfg.type == "slim":
        head = SlimSoftmax(
            in_dim, vocab_size, cfg.slim_subvectors, cfg.slim_pool, cfg.log_z, cfg.learn_log_z, cfg.slim_embeddings
        )
    elif cfg.type == "dsoftmax":
        head = DSoftmax(in_dim, vocab_size, cfg.cutoffs, cfg.band_widths, cfg.band_layout, cfg.log_z, cfg.learn_log_z)
    elif cfg.type in ("charcnn", "cnnsoftmax"):
        if words is None or len(words) != vocab_size:
            raise ValueError(
                f"head.type = {cfg.type}: the head is built from the vocabulary's spellings; pass its words"
            )
        cnn = (in_dim, words, cfg.charcnn_size, cfg.char_embedding_size, cfg.charcnn_widths, cfg.charcnn_max_chars)
        if cfg.type == "cnnsoftmax":
            head = CNNSoftmax(*cnn, cfg.correction_size, cfg.log_z, cfg.learn_log_z)
        else:
            head = CharCNNSoftmax(*cnn, cfg.log_z, cfg.learn_log_z)
    else:
        raise ValueError(f"head.type = {cfg.type!r}, expected one of {', '.join(HEAD_TYPES)}")
    return head


__all__ = [
    "AdaptiveSoftmax",
    "CharCNNSoftmax",
    "ClassSoftmax",
    "CNNSoftmax",
    "DSoftmax",
    "FullSoftmax",
    "Head",
    "HEAD_TYPES",
    "LinearHead",
    "SlimSoftmax",
    "Speller",
    "TREE_TYPES",
    "TreeSoftmax",
    "build_head",
]
