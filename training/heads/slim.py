"""Slim output embeddings (Li et al. 2018, "Slim embedding layers for recurrent neural language models").

Each word's output vector is K sub-vectors of size D/K; sub-vector k is one of the M/K vectors of pool k, by a
random, fixed, balanced assignment (every pool vector serves ⌊V·K/M⌋ or ⌈V·K/M⌉ words). The output matrix then
has M·D/K parameters instead of V·D, plus a full bias per word.

The logits of the whole vocabulary need no V × D matrix either: the dot products of the hidden state's K chunks with
their pools cost M·D/K, and each word's logit is the sum of its K looked-up products (the dynamic programme over K
disjoint pools: O(MD/K + VK) per row). The assignment is a buffer saved with the model; it is drawn from its own
seeded generator so that it does not move the rest of the initialisation.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from training.heads.base import LinearHead

ASSIGNMENT_SEED = 20180201


class SlimSoftmax(LinearHead):
    def __init__(
        self,
        in_dim: int,
        vocab_size: int,
        subvectors: int,
        pool: int,
        log_z: float = 0.0,
        learn_log_z: bool = False,
    ):
        super().__init__(log_z, learn_log_z)
        if subvectors < 1 or in_dim % subvectors:
            raise ValueError(
                f"head.slim_subvectors = {subvectors}: expected a divisor of the head's input size {in_dim}"
            )
        if pool < subvectors or pool % subvectors:
            raise ValueError(
                f"head.slim_pool = {pool}: expected a positive multiple of head.slim_subvectors = {subvectors} "
                "(the M shared sub-vectors, M/K per position)"
            )
        self.vocab_size = vocab_size
        self.subvectors = subvectors
        self.per_pool = pool // subvectors
        bound = 1 / math.sqrt(in_dim)  # nn.Linear's default, for model.init_range = 0
        self.pools = nn.Parameter(torch.empty(subvectors, self.per_pool, in_dim // subvectors).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(vocab_size).uniform_(-bound, bound))
        generator = torch.Generator().manual_seed(ASSIGNMENT_SEED)
        assignment = torch.stack(
            [torch.randperm(vocab_size, generator=generator) % self.per_pool for _ in range(subvectors)], dim=1
        )
        self.register_buffer("assignment", assignment)  # [V, K]: pool k's vector for word w's chunk k
        self.register_buffer("offsets", torch.arange(subvectors) * self.per_pool, persistent=False)

    def output_vectors(self, ids):
        flat = self.pools.reshape(self.subvectors * self.per_pool, -1)
        chosen = self.assignment.index_select(0, ids) + self.offsets  # [S, K] rows of the flattened pools
        vectors = flat.index_select(0, chosen.reshape(-1)).reshape(chosen.shape[0], -1)
        return vectors, self.bias.index_select(0, ids)

    def output_bias(self):
        return self.bias

    def logits(self, hidden):
        chunks = hidden.reshape(-1, self.subvectors, self.pools.shape[2]).transpose(0, 1)  # [K, N, D/K]
        products = torch.bmm(chunks, self.pools.transpose(1, 2))  # [K, N, M/K]
        return self.bias + sum(
            part.index_select(1, chosen) for part, chosen in zip(products, self.assignment.T, strict=True)
        )
