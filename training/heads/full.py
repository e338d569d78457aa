"""Full softmax: one linear layer over the whole vocabulary."""

from __future__ import annotations

import copy

import torch
from torch import nn

from lmserve.training.heads.base import LinearHead


class FullSoftmax(LinearHead):
    def __init__(self, in_dim: int, vocab_size: int, log_z: float = 0.0, learn_log_z: bool = False):
        super().__init__(log_z, learn_log_z)
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

    def output_vectors(self, ids):
        return self.linear.weight.index_select(0, ids), self.linear.bias.index_select(0, ids)

    def output_bias(self):
        return self.linear.bias

    def logits(self, hidden):
        return self.linear(hidden)


@torch.no_grad()
def frozen_linear(head: LinearHead, matrix: torch.Tensor) -> FullSoftmax:
    """The head as served: its ``[V, D]`` output matrix computed once into a full softmax with the same scores (so the
    exported graphs hold a matrix and no CNN; Labeau ch. 5 precomputes it for inference alike), keeping the head's
    speller, if any, as ``spelling`` for the words outside the vocabulary."""
    frozen = FullSoftmax(matrix.shape[1], head.vocab_size, float(head.log_z), learn_log_z=False)
    frozen = frozen.to(device=matrix.device, dtype=matrix.dtype)
    frozen.linear.weight.copy_(matrix)
    frozen.linear.bias.copy_(head.output_bias())
    speller = head.speller()
    if speller is not None:
        frozen.spelling = copy.deepcopy(speller)  # a snapshot, as the matrix: training goes on with the head's own
    return frozen.requires_grad_(False)
