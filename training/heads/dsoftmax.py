"""Differentiated softmax (Chen, Grangier & Auli 2016, "Strategies for training large vocabulary neural language
models"): one softmax over the whole vocabulary, whose output vectors are narrower for rarer words.

Ids are sorted by descending frequency (the vocabulary guarantees it), so the frequency bands are id ranges cut at
``head.cutoffs`` (as adaptive softmax's). Band i's words have output vectors of ``head.band_widths[i]`` dimensions
(non-increasing), which see only a segment of the hidden state: with ``head.band_layout = "disjoint"`` (the paper's)
the segments partition it, so the widths add up to the head's input size; with ``"nested"`` every band reads the
first ``width`` dimensions, so that the first band, the frequent words, sees all of it. A word's logit is its
segment of the hidden state times its vector, plus its bias: the logits of the whole vocabulary cost
Σ_i |band i| · width_i multiply-adds per position instead of |V| · D, and there are as many parameters.

Evaluation is exact (one normalised softmax over every word), and the head is a ``LinearHead``: its output vectors,
zero outside the band's segment, serve sampled objectives and the exported self-normalised graphs alike.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from lmserve.training.heads.base import LinearHead

BAND_LAYOUTS = ("disjoint", "nested")


def check_bands(in_dim: int, vocab_size: int, cutoffs: list[int], widths: list[int], layout: str) -> None:
    """The errors name the config keys: ``head.cutoffs``, ``head.band_widths`` and ``head.band_layout``."""
    if layout not in BAND_LAYOUTS:
        raise ValueError(f"head.band_layout = {layout!r}, expected one of {', '.join(BAND_LAYOUTS)}")
    if not cutoffs or list(cutoffs) != sorted(set(cutoffs)) or cutoffs[0] <= 0 or cutoffs[-1] >= vocab_size:
        raise ValueError(
            f"head.cutoffs = {cutoffs}: the first ids of the frequency bands after the first, expected increasing ids "
            f"between 1 and vocab size - 1 ({vocab_size - 1})"
        )
    if len(widths) != len(cutoffs) + 1:
        raise ValueError(
            f"head.band_widths = {widths}: expected one width per band, {len(cutoffs) + 1} for head.cutoffs = {cutoffs}"
        )
    if any(w < 1 for w in widths) or list(widths) != sorted(widths, reverse=True):
        raise ValueError(f"head.band_widths = {widths}: expected positive widths that shrink (or stay) for rarer bands")
    if layout == "disjoint" and sum(widths) != in_dim:
        raise ValueError(
            f"head.band_widths = {widths} add up to {sum(widths)}: with head.band_layout = disjoint the bands "
            f"partition the hidden state, expected a sum of {in_dim} (the head's input size)"
        )
    if layout == "nested" and widths[0] != in_dim:
        raise ValueError(
            f"head.band_widths = {widths}: with head.band_layout = nested the first band reads the whole hidden "
            f"state, expected a first width of {in_dim} (the head's input size)"
        )


class DSoftmax(LinearHead):
    def __init__(
        self,
        in_dim: int,
        vocab_size: int,
        cutoffs: list[int],
        widths: list[int],
        layout: str = "disjoint",
        log_z: float = 0.0,
        learn_log_z: bool = False,
    ):
        super().__init__(log_z, learn_log_z)
        check_bands(in_dim, vocab_size, cutoffs, widths, layout)
        self.vocab_size = vocab_size
        self.in_dim = in_dim
        self.widths = list(widths)
        bounds = [0, *cutoffs, vocab_size]
        self.bounds = bounds
        self.starts = [0] * len(widths) if layout == "nested" else [sum(widths[:i]) for i in range(len(widths))]
        self.register_buffer("band_bounds", torch.tensor(bounds), persistent=False)
        bound = 1 / math.sqrt(in_dim)  # nn.Linear's default, for model.init_range = 0
        self.weights = nn.ParameterList(
            nn.Parameter(torch.empty(b - a, w).uniform_(-bound, bound))
            for a, b, w in zip(bounds[:-1], bounds[1:], widths, strict=True)
        )
        self.bias = nn.Parameter(torch.empty(vocab_size).uniform_(-bound, bound))

    def segment(self, hidden: torch.Tensor, band: int) -> torch.Tensor:
        return hidden[:, self.starts[band] : self.starts[band] + self.widths[band]]

    def logits(self, hidden):
        parts = [nn.functional.linear(self.segment(hidden, i), w) for i, w in enumerate(self.weights)]
        return torch.cat(parts, dim=-1) + self.bias

    def output_vectors(self, ids):
        """Each word's vector placed at its band's segment of a ``[S, D]`` row, zeros elsewhere. Branch-free over
        possibly empty bands, so that it exports (as ``AdaptiveSoftmax.target_terms``)."""
        band = torch.bucketize(ids, self.band_bounds, right=True) - 1
        # shaped from ``ids``, not from len(ids), which the ONNX tracer would freeze into a constant
        vectors = torch.zeros_like(ids, dtype=self.bias.dtype).unsqueeze(1).expand(-1, self.in_dim)
        for i, weight in enumerate(self.weights):
            rows = torch.nonzero(band == i).reshape(-1)
            inside = weight.index_select(0, ids.index_select(0, rows) - self.bounds[i])
            placed = nn.functional.pad(inside, (self.starts[i], self.in_dim - self.starts[i] - self.widths[i]))
            at = rows.unsqueeze(1).expand(-1, self.in_dim)
            vectors = vectors + torch.zeros_like(vectors).scatter(0, at, placed)
        return vectors, self.bias.index_select(0, ids)

    def output_bias(self):
        return self.bias
