"""What every output layer ("head") answers; see DESIGN.md, "The output layer is the heart of it"."""

from __future__ import annotations

import abc

import torch
from torch import nn


def rowwise_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(a * b).sum(-1)`` for ``[N, D]`` rows, as a batched matmul: ONNX Runtime's ReduceSum mis-shapes an empty
    (N = 0) input, which an adaptive cluster with no targets in the batch produces."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).reshape(-1)


class Head(nn.Module, abc.ABC):
    """Turns hidden states ``[N, D]`` into word scores over a vocabulary of ``vocab_size`` ids.

    ``target_terms`` is the one method a head must make cheap: the unnormalised score of each target and the log
    normalisers of the softmaxes on the target's path (one for a flat softmax, head and cluster for adaptive), with
    ``log p = score - log_norms.sum(-1)``. Training objectives, the self-normalisation penalty, ``target_logprob`` and
    the log Z statistics are all built on it.

    A self-normalised model is served with the unnormalised scores alone: ``target_score`` (a few dot products per
    target, no normaliser) and ``scores`` (the whole vocabulary), both consistent with ``target_terms``.
    """

    vocab_size: int

    @abc.abstractmethod
    def target_terms(self, hidden: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(score ``[N]``, log_norms ``[N, K]``) for the given targets."""

    @abc.abstractmethod
    def log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """Exact normalised log-probabilities of the whole vocabulary, ``[N, V]``."""

    @abc.abstractmethod
    def target_score(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The unnormalised score of each target, ``[N]``, at a cost independent of the vocabulary size."""

    @abc.abstractmethod
    def scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """Unnormalised scores of the whole vocabulary, ``[N, V]`` (``target_score`` is their gather)."""

    @abc.abstractmethod
    def init_bias(self, log_prior: torch.Tensor) -> None:
        """Set the output biases so that a zero hidden state predicts ``log_prior`` ([V], normalised) exactly."""

    def candidate_logprobs(self, hidden: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """Exact log-probabilities of ``[B, K]`` candidate next words for ``[B, D]`` hidden states. A flat softmax
        normalises once per row; heads whose ``target_logprob`` is cheaper than the whole distribution override this
        to score each candidate on its own."""
        return self.log_probs(hidden).gather(1, candidates)

    def target_logprob(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Exact log-probability of each target, ``[N]``, without the full-vocabulary softmax where the head allows."""
        score, log_norms = self.target_terms(hidden, targets)
        return score - log_norms.sum(-1)


def per_candidate(score_fn, hidden: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """Apply a per-target ``score_fn(hidden [N, D], targets [N])`` to ``[B, K]`` candidates of ``[B, D]`` rows."""
    rows = hidden.unsqueeze(1) + torch.zeros_like(candidates, dtype=hidden.dtype).unsqueeze(2)  # [B, K, D]
    return score_fn(rows.reshape(-1, hidden.shape[-1]), candidates.reshape(-1)).reshape(candidates.shape)
