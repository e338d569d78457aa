"""Adaptive softmax (Grave et al. 2017): frequent words in a head softmax, rare words in clusters behind it.

Ids must be sorted by descending frequency (the vocabulary guarantees it). The head scores the ``cutoffs[0]``
shortlist words plus one logit per tail cluster; cluster i projects the hidden state down by ``div_value ** (i+1)``
before its own softmax, so rare words cost little. ``target_terms`` evaluates the head and only the cluster each
target falls in.
"""

from __future__ import annotations

import torch
from torch import nn

from lmserve.training.heads.base import Head, rowwise_dot


class AdaptiveSoftmax(Head):
    def __init__(self, in_dim: int, vocab_size: int, cutoffs: list[int], div_value: float = 4.0):
        super().__init__()
        if not cutoffs or list(cutoffs) != sorted(set(cutoffs)) or cutoffs[0] <= 0 or cutoffs[-1] >= vocab_size:
            raise ValueError(
                f"head.cutoffs must be increasing ids between 1 and vocab size - 1 ({vocab_size - 1}), got {cutoffs}"
            )
        self.vocab_size = vocab_size
        self.shortlist = cutoffs[0]
        bounds = [*cutoffs, vocab_size]
        self.register_buffer("bounds", torch.tensor(bounds), persistent=False)
        self.head = nn.Linear(in_dim, self.shortlist + len(cutoffs))
        self.tails = nn.ModuleList()
        for i in range(len(cutoffs)):
            size = max(1, int(in_dim // div_value ** (i + 1)))
            self.tails.append(
                nn.Sequential(nn.Linear(in_dim, size, bias=False), nn.Linear(size, bounds[i + 1] - bounds[i]))
            )

    @torch.no_grad()
    def set_prior_bias(self, log_prior):
        """Shortlist words get their prior, cluster logits the cluster's mass, tail words their share of it."""
        self.head.bias[: self.shortlist].copy_(log_prior[: self.shortlist])
        for i, tail in enumerate(self.tails):
            inside = log_prior[self.bounds[i] : self.bounds[i + 1]]
            mass = inside.logsumexp(0)
            self.head.bias[self.shortlist + i] = mass
            tail[1].bias.copy_(inside - mass)

    def _head_index(self, targets):
        """Each target's cluster (0 = shortlist, i = tail cluster i) and its entry in the head softmax: itself in the
        shortlist, else its cluster's logit."""
        cluster = torch.bucketize(targets, self.bounds, right=True)
        return cluster, torch.where(cluster == 0, targets, self.shortlist + cluster - 1)

    def target_terms(self, hidden, targets):
        head_logits = self.head(hidden).float()  # the loss in float32 under bf16 autocast (tests/test_heads.py)
        cluster, head_index = self._head_index(targets)
        score = head_logits.gather(1, head_index[:, None]).squeeze(1)
        tail_norm = torch.zeros_like(score)
        # Branch-free with data-dependent row sets (possibly empty), so that the same code exports to ONNX
        # (NonZero -> Gather -> MatMul -> ScatterElements); the explicit reshapes keep ranks fixed for the exporter.
        for i, tail in enumerate(self.tails):
            rows = torch.nonzero(cluster == i + 1).reshape(-1)
            logits = tail(hidden.index_select(0, rows)).float()
            local = (targets.index_select(0, rows) - self.bounds[i]).reshape(-1, 1)
            score = score + torch.zeros_like(score).scatter(0, rows, logits.gather(1, local).reshape(-1))
            tail_norm = tail_norm + torch.zeros_like(score).scatter(0, rows, logits.logsumexp(-1).reshape(-1))
        return score, torch.stack([torch.logsumexp(head_logits, dim=-1), tail_norm], dim=-1)

    def target_logprob(self, hidden, targets):
        # the head and the target's cluster through log_softmax (see FullSoftmax.target_logprob for why)
        cluster, head_index = self._head_index(targets)
        logprob = torch.log_softmax(self.head(hidden), dim=-1).gather(1, head_index[:, None]).squeeze(1)
        for i, tail in enumerate(self.tails):
            rows = torch.nonzero(cluster == i + 1).reshape(-1)
            local = (targets.index_select(0, rows) - self.bounds[i]).reshape(-1, 1)
            tail_logprob = torch.log_softmax(tail(hidden.index_select(0, rows)), dim=-1).gather(1, local)
            logprob = logprob + torch.zeros_like(logprob).scatter(0, rows, tail_logprob.reshape(-1))
        return logprob

    def candidate_logprobs(self, hidden, candidates):
        """The head softmax once per row, and a cluster's softmax once per row with a candidate in it: less than
        the whole distribution for few candidates, and a row's candidates share its softmaxes (scoring each on its
        own repeated the head per candidate and made a decoder step cost 1.6x a token of a sentence)."""
        batch, width = candidates.shape
        flat = candidates.reshape(-1)
        cluster, head_index = self._head_index(flat)
        logprob = torch.log_softmax(self.head(hidden), dim=-1).gather(1, head_index.reshape(batch, width)).reshape(-1)
        row_of = torch.arange(batch, device=candidates.device).unsqueeze(1).expand(batch, width).reshape(-1)
        for i, tail in enumerate(self.tails):
            inside = (cluster == i + 1).long()
            needed = inside.reshape(batch, width).sum(1) > 0
            rows = torch.nonzero(needed).reshape(-1)
            tail_logprob = torch.log_softmax(tail(hidden.index_select(0, rows)), dim=-1)  # [rows, cluster size]
            slot = torch.cumsum(needed.long(), 0) - 1  # a row's place among ``rows``
            pairs = torch.nonzero(inside).reshape(-1)
            size = tail_logprob.shape[-1]
            at = (
                slot.index_select(0, row_of.index_select(0, pairs)) * size
                + flat.index_select(0, pairs)
                - self.bounds[i]
            )
            picked = tail_logprob.reshape(-1).index_select(0, at)
            logprob = logprob + torch.zeros_like(logprob).scatter(0, pairs, picked)
        return logprob.reshape(batch, width)

    def log_probs(self, hidden):
        head = torch.log_softmax(self.head(hidden), dim=-1)
        parts = [head[:, : self.shortlist]]
        for i, tail in enumerate(self.tails):
            parts.append(head[:, self.shortlist + i, None] + torch.log_softmax(tail(hidden), dim=-1))
        return torch.cat(parts, dim=-1)

    def target_score(self, hidden, targets):
        cluster, head_index = self._head_index(targets)
        score = rowwise_dot(self.head.weight.index_select(0, head_index), hidden) + self.head.bias.index_select(
            0, head_index
        )
        for i, (project, out) in enumerate(self.tails):
            rows = torch.nonzero(cluster == i + 1).reshape(-1)
            local = targets.index_select(0, rows) - self.bounds[i]
            projected = project(hidden.index_select(0, rows))
            tail = rowwise_dot(out.weight.index_select(0, local), projected) + out.bias.index_select(0, local)
            score = score + torch.zeros_like(score).scatter(0, rows, tail.reshape(-1))
        return score

    def scores(self, hidden):
        head = self.head(hidden)
        parts = [head[:, : self.shortlist]]
        for i, tail in enumerate(self.tails):
            parts.append(head[:, self.shortlist + i, None] + tail(hidden))
        return torch.cat(parts, dim=-1)
