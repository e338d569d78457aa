"""Slim embeddings (Li et al. 2018, "Slim embedding layers for recurrent neural language models").

Each word's vector is K sub-vectors of size D/K; sub-vector k is one of the M/K vectors of pool k, by a random,
fixed, balanced assignment (every pool vector serves ⌊V·K/M⌋ or ⌈V·K/M⌉ words). The matrix then has M·D/K
parameters instead of V·D. Both ends of the model can be slim: ``SlimSoftmax`` (output vectors, plus a full bias per
word) and ``SlimEmbedding`` (input vectors, ``model.input_slim_pool``), each with its own assignment.

The logits of the whole vocabulary need no V × D matrix: the dot products of the hidden state's K chunks with
their pools cost M·D/K, and each word's logit is the sum of its K looked-up products (the dynamic programme over K
disjoint pools: O(MD/K + VK) per row). An assignment is a buffer saved with the model, drawn from its own seeded
generator so that it does not move the rest of the initialisation.

With ``head.slim_embeddings`` the assignment is clustered instead (Li 2019, thesis ch. 4): the output vectors of a
trained model over the same vocabulary (its full softmax's matrix, else its input embeddings) are cut into the K
chunks, each chunk position is clustered by k-means into M/K groups (``kmeans``), every word takes its chunks'
groups and the pools start at the centroids. Words whose vectors were alike then share sub-vectors, where the random
assignment makes unrelated words share them; clusters are as large as the data makes them, not balanced.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from lmserve.training.heads.base import LinearHead
from lmserve.training.heads.tree import load_embeddings

ASSIGNMENT_SEED = 20180201  # the output vectors'; the input embedding's is the next one


KMEANS_ITERATIONS = 8
KMEANS_ROWS = 4096  # points per distance block: bounds the [rows, clusters] distance matrix


def kmeans(
    points: torch.Tensor, clusters: int, iterations: int = KMEANS_ITERATIONS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd's k-means of ``[V, d]`` points -> (centroids ``[clusters, d]``, each point's cluster ``[V]``).

    Deterministic: the centroids start at the first ``clusters`` points, which for vectors in vocabulary order are the
    most frequent words' (each starts a cluster of its own), and a cluster left empty keeps its centroid."""
    points = points.float()  # distances in float32 (a 50k x 5k product per position and iteration), means in float64
    centroids = points[:clusters].double()
    labels = torch.zeros(len(points), dtype=torch.long)
    for _ in range(iterations):
        single = centroids.float()
        norms = single.pow(2).sum(1)
        labels = torch.cat(
            [(norms - 2 * block @ single.T).argmin(1) for block in points.split(KMEANS_ROWS)]
        )  # ||x||^2 is the same for every centroid of a point
        counts = torch.bincount(labels, minlength=clusters).double()
        sums = torch.zeros_like(centroids).index_add_(0, labels, points.double())
        filled = counts > 0
        centroids[filled] = sums[filled] / counts[filled].unsqueeze(1)
    return centroids.float(), labels


class SubvectorPools(nn.Module):
    """K pools of M/K sub-vectors and the words' assignment to them; ``where`` names the config keys in errors."""

    def __init__(self, vocab_size: int, dim: int, subvectors: int, pool: int, seed: int, where: str):
        super().__init__()
        if subvectors < 1 or dim % subvectors:
            raise ValueError(f"{where}_subvectors = {subvectors}: expected a divisor of the vector size {dim}")
        if pool < subvectors or pool % subvectors:
            raise ValueError(
                f"{where}_pool = {pool}: expected a positive multiple of {where}_subvectors = {subvectors} "
                "(the M shared sub-vectors, M/K per position)"
            )
        self.subvectors = subvectors
        self.per_pool = pool // subvectors
        bound = 1 / math.sqrt(dim)  # nn.Linear's default, for model.init_range = 0
        self.pools = nn.Parameter(torch.empty(subvectors, self.per_pool, dim // subvectors).uniform_(-bound, bound))
        generator = torch.Generator().manual_seed(seed)
        assignment = torch.stack(
            [torch.randperm(vocab_size, generator=generator) % self.per_pool for _ in range(subvectors)], dim=1
        )
        self.register_buffer("assignment", assignment)  # [V, K]: pool k's vector for word w's chunk k
        self.register_buffer("offsets", torch.arange(subvectors) * self.per_pool, persistent=False)

    @torch.no_grad()
    def cluster(self, vectors: torch.Tensor) -> None:
        """The assignment and the pools from k-means over each chunk position of ``[V, D]`` trained vectors."""
        chunk = self.pools.shape[2]
        for k in range(self.subvectors):
            centroids, labels = kmeans(vectors[:, k * chunk : (k + 1) * chunk], self.per_pool)
            self.pools[k].copy_(centroids)
            self.assignment[:, k] = labels

    def vectors(self, ids: torch.Tensor) -> torch.Tensor:
        """The composed vectors ``[*ids.shape, D]``."""
        flat = self.pools.reshape(self.subvectors * self.per_pool, -1)
        chosen = self.assignment.index_select(0, ids.reshape(-1)) + self.offsets  # [S, K] rows of the flat pools
        return flat.index_select(0, chosen.reshape(-1)).reshape(*ids.shape, -1)

    def products(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden · vectorsᵀ`` for every word, ``[N, V]``, by the dynamic programme."""
        chunks = hidden.reshape(-1, self.subvectors, self.pools.shape[2]).transpose(0, 1)  # [K, N, D/K]
        parts = torch.bmm(chunks, self.pools.transpose(1, 2))  # [K, N, M/K]
        return sum(part.index_select(1, chosen) for part, chosen in zip(parts, self.assignment.T, strict=True))


class SlimEmbedding(SubvectorPools):
    """Slim input embeddings: ``nn.Embedding``'s interface, ``model.input_slim_subvectors`` K ×
    ``model.input_slim_pool`` M."""

    def __init__(self, vocab_size: int, dim: int, subvectors: int, pool: int):
        super().__init__(vocab_size, dim, subvectors, pool, ASSIGNMENT_SEED + 1, "model.input_slim")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.vectors(ids)


class SlimSoftmax(LinearHead):
    def __init__(
        self,
        in_dim: int,
        vocab_size: int,
        subvectors: int,
        pool: int,
        log_z: float = 0.0,
        learn_log_z: bool = False,
        embeddings: str = "",
    ):
        super().__init__(log_z, learn_log_z)
        self.vocab_size = vocab_size
        self.table = SubvectorPools(vocab_size, in_dim, subvectors, pool, ASSIGNMENT_SEED, "head.slim")
        if embeddings and self.table.per_pool > vocab_size:
            raise ValueError(
                f"head.slim_pool = {pool}: k-means of head.slim_embeddings makes {self.table.per_pool} clusters per "
                f"position, more than the {vocab_size} words"
            )
        self.embeddings = embeddings
        bound = 1 / math.sqrt(in_dim)
        self.bias = nn.Parameter(torch.empty(vocab_size).uniform_(-bound, bound))

    def fit_prior(self, log_prior):
        """With ``head.slim_embeddings``, the clustered assignment (when the trainer starts: the model's own uniform
        initialisation is over by then, so the pools keep the centroids)."""
        if self.embeddings:
            dim = self.table.pools.shape[2] * self.table.subvectors
            vectors = load_embeddings(
                self.embeddings, self.vocab_size, "head.slim_embeddings", ("head.linear.weight", "embedding.weight")
            )
            if vectors.shape[1] != dim:
                raise ValueError(
                    f"head.slim_embeddings = {self.embeddings!r}: its vectors have {vectors.shape[1]} dimensions, the "
                    f"slim head's {dim} (cluster the output vectors of a model with the same hidden size)"
                )
            self.table.cluster(torch.from_numpy(vectors).float())

    def output_vectors(self, ids):
        return self.table.vectors(ids), self.bias.index_select(0, ids)

    def output_bias(self):
        return self.bias

    def logits(self, hidden):
        return self.bias + self.table.products(hidden)
