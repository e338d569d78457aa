"""Full softmax: one linear layer over the whole vocabulary."""

from __future__ import annotations

import torch
from torch import nn

from training.heads.base import Head, rowwise_dot


class FullSoftmax(Head):
    def __init__(self, in_dim: int, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.linear = nn.Linear(in_dim, vocab_size)

    def tie_to(self, embedding: nn.Embedding) -> None:
        """Share the output matrix with the input embedding (Press & Wolf 2017; Inan et al. 2017)."""
        if embedding.weight.shape != self.linear.weight.shape:
            raise ValueError(
                f"cannot tie: embedding is {tuple(embedding.weight.shape)}, output layer "
                f"{tuple(self.linear.weight.shape)} (set model.projection_size to the embedding size)"
            )
        self.linear.weight = embedding.weight

    @torch.no_grad()
    def init_bias(self, log_prior):
        self.linear.bias.copy_(log_prior)

    def target_terms(self, hidden, targets):
        logits = self.linear(hidden)
        score = logits.gather(1, targets[:, None]).squeeze(1)
        return score, torch.logsumexp(logits, dim=-1, keepdim=True)

    def target_logprob(self, hidden, targets):
        # log_softmax, not score - logsumexp: exported to ONNX, LogSoftmax is as accurate as PyTorch while
        # ONNX Runtime's ReduceLogSumExp is ten times less (1e-4 off per token on a 10k vocabulary)
        return self.log_probs(hidden).gather(1, targets[:, None]).squeeze(1)

    def log_probs(self, hidden):
        return torch.log_softmax(self.linear(hidden), dim=-1)

    def target_score(self, hidden, targets):
        return rowwise_dot(self.linear.weight.index_select(0, targets), hidden) + self.linear.bias.index_select(
            0, targets
        )

    def scores(self, hidden):
        return self.linear(hidden)
