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

Training terms (``target_terms``: the target's score and the normaliser) never build the ``[N, V]`` logits. The
bands' matrix products are |V| · D / Σ |band| · width times cheaper than the full softmax's (6x at Gutenberg 50k),
which leaves the element-wise work over ``[N, V]`` as most of the step: a concatenated copy, the bias add, logsumexp's
passes and temporaries, the gather's ``[N, V]`` zero gradient, each a fresh 70 MB tensor (page faults) on a CPU.
``BandedTerms`` takes rows a cache-sized chunk at a time, band by band, keeps only each row's normaliser and
recomputes the chunk's logits in the backward pass (a third more band products, which are cheap here).
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

    def bands(self) -> list[tuple[int, int, int, int]]:
        """(first id, end id, segment start, width) of each band."""
        return list(zip(self.bounds[:-1], self.bounds[1:], self.starts, self.widths, strict=True))

    def logits(self, hidden):
        parts = [
            torch.addmm(self.bias[a:b], hidden[:, s : s + w], weight.t())
            for (a, b, s, w), weight in zip(self.bands(), self.weights, strict=True)
        ]
        return torch.cat(parts, dim=-1)

    def target_terms(self, hidden, targets):
        # float32 under bf16 autocast, as every head's terms (tests/test_heads.py); the band products are the cheap part
        with torch.autocast(hidden.device.type, enabled=False):
            score, lse = BandedTerms.apply(hidden.float(), targets, self.bands(), self.bias, *self.weights)
        return self._less_log_z(score), self._less_log_z(lse).unsqueeze(1)

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


# Rows per chunk of BandedTerms on a CPU: a chunk's logits (rows x |V| floats) take up to 16 MB, enough rows for
# efficient matrix products, and under glibc's largest mmap threshold (32 MB), so that the chunks reuse heap memory
# instead of page-faulting fresh pages (80 rows at 50k words; in the Gutenberg training step, 4 MB chunks ran 5-15%
# fewer tokens/s, 64 MB ones 25-30% fewer).
# A GPU takes all rows at once (each chunk costs a dozen kernel launches).
CPU_CHUNK_FLOATS = 1 << 22


class BandedTerms(torch.autograd.Function):
    """(target score ``[N]``, log normaliser ``[N]``) of a banded softmax, ``bands`` as ``DSoftmax.bands()``, with
    ``weights[i]`` band i's ``[|band|, width]`` vectors and ``bias`` all ``[V]`` biases; no log_z."""

    @staticmethod
    def chunks(hidden: torch.Tensor, vocab_size: int):
        rows = max(1, CPU_CHUNK_FLOATS // vocab_size) if hidden.device.type == "cpu" else max(1, len(hidden))
        return [slice(lo, lo + rows) for lo in range(0, len(hidden), rows)]

    @staticmethod
    def band_logits(hidden, band, weight, bias, targets):
        """A chunk's logits in one band, and where its targets fall in it (rows, columns)."""
        a, b, start, width = band
        logits = torch.addmm(bias[a:b], hidden[:, start : start + width], weight.t())
        rows = torch.nonzero((targets >= a) & (targets < b)).squeeze(1)
        return logits, rows, targets[rows] - a

    @staticmethod
    def forward(ctx, hidden, targets, bands, bias, *weights):
        score, lse = hidden.new_zeros(len(hidden)), hidden.new_empty(len(hidden))
        for chunk in BandedTerms.chunks(hidden, len(bias)):
            h, t = hidden[chunk], targets[chunk]
            logits = []
            for band, weight in zip(bands, weights, strict=True):
                part, rows, cols = BandedTerms.band_logits(h, band, weight, bias, t)
                score[chunk].index_put_((rows,), part[rows, cols])
                logits.append(part)
            top = torch.stack([part.amax(1) for part in logits], 1).amax(1, keepdim=True)
            total = sum(part.sub_(top).exp_().sum(1) for part in logits)  # in place: the logits are not kept
            lse[chunk] = total.log_() + top.squeeze(1)
        ctx.bands = bands
        ctx.save_for_backward(hidden, targets, bias, lse, *weights)
        return score, lse

    @staticmethod
    def backward(ctx, grad_score, grad_lse):
        """d/dlogits = softmax · grad_lse, plus grad_score at the target: accumulated chunk by chunk into the
        gradients of the hidden state, the band vectors and the biases."""
        hidden, targets, bias, lse, *weights = ctx.saved_tensors
        grad_hidden, grad_bias = torch.zeros_like(hidden), torch.zeros_like(bias)
        grad_weights = [torch.zeros_like(w) for w in weights]
        for chunk in BandedTerms.chunks(hidden, len(bias)):
            h, t, g_score = hidden[chunk], targets[chunk], grad_score[chunk]
            for band, weight, grad_weight in zip(ctx.bands, weights, grad_weights, strict=True):
                a, b, start, width = band
                grad, rows, cols = BandedTerms.band_logits(h, band, weight, bias, t)
                grad.sub_(lse[chunk, None]).exp_().mul_(grad_lse[chunk, None])
                grad.index_put_((rows, cols), g_score[rows], accumulate=True)
                grad_hidden[chunk, start : start + width].addmm_(grad, weight)
                grad_weight.addmm_(grad.t(), h[:, start : start + width])
                grad_bias[a:b].add_(grad.sum(0))
        return grad_hidden, None, None, grad_bias, *grad_weights
