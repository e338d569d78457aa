"""Parallel tree softmax (hierarchical softmax over a binary tree; Morin & Bengio 2005, Mnih & Hinton 2009, and the
p-tHSM batching): log p(w | h) = Σ_i log σ(d_i · (θ_iᵀh + b_i)) over the internal nodes i on w's path, d_i = +1
where the path turns right and -1 where it turns left.

Every node is a normalised binary choice, so the leaves sum to one without any normaliser and the score of a target
is its exact log-probability, at a cost of its path length (about log2 |V| nodes for a Huffman tree). The paths of a
batch's targets are padded to the deepest leaf and evaluated together: one gather of node vectors ``[N, L, D]`` and
one batched product with the hidden states.

The tree is a buffer saved with the model, ``branches [V-1, 2]``: internal node i (id V + i) has the two children
``branches[i]`` (ids below V are words; a parent comes after its children, so the root is the last). ``huffman``
trees are Huffman codes of the training unigram (Mikolov et al. 2013), built when ``init_bias`` hands it over;
``clustered`` trees split the words of a trained model's embeddings top-down (Mnih & Hinton 2009), so that similar
words share paths; ``huffman_clustered`` trees keep every word's Huffman path length and arrange the words by those
embeddings; ``balanced`` trees (and every tree before then) are Huffman codes of equal weights. Paths are
derived again after a checkpoint is loaded.
"""

from __future__ import annotations

import heapq

import numpy as np
import torch
from torch import nn

from lmserve.training.heads.base import Head, per_candidate

TREE_TYPES = ("huffman", "clustered", "huffman_clustered", "balanced")


def huffman_branches(weights: np.ndarray) -> torch.Tensor:
    """Huffman tree over ``weights`` (ties broken by id, so the tree is reproducible); the lighter child goes left."""
    vocab_size = len(weights)
    heap = [(float(w), i) for i, w in enumerate(weights)]
    heapq.heapify(heap)
    branches = []
    for node in range(vocab_size, 2 * vocab_size - 1):
        left_weight, left = heapq.heappop(heap)
        right_weight, right = heapq.heappop(heap)
        branches.append((left, right))
        heapq.heappush(heap, (left_weight + right_weight, node))
    return torch.tensor(branches, dtype=torch.long).reshape(-1, 2)


def _top_down(vectors: np.ndarray, goes_left) -> torch.Tensor:
    """A tree split top-down: each node orders its words along their embeddings' principal direction (a few power
    iterations) and ``goes_left(order, projections)`` marks the ones its left child takes."""
    vocab_size = len(vectors)
    start = np.random.default_rng(0).standard_normal(vectors.shape[1])
    branches: list[tuple[int, int]] = []

    def split(ids: np.ndarray) -> int:
        if len(ids) == 1:
            return int(ids[0])
        centred = vectors[ids] - vectors[ids].mean(0)
        direction = start
        for _ in range(8):
            direction = centred.T @ (centred @ direction)
            direction = direction / (np.linalg.norm(direction) + 1e-12)
        projection = centred @ direction
        sort = np.argsort(projection, kind="stable")
        order = ids[sort]
        left = goes_left(order, projection[sort])
        branches.append((split(order[left]), split(order[~left])))  # after its children: children before parents
        return vocab_size + len(branches) - 1

    split(np.arange(vocab_size))
    return torch.tensor(branches, dtype=torch.long).reshape(-1, 2)


def clustered_branches(vectors: np.ndarray, weights: np.ndarray) -> torch.Tensor:
    """Top-down: each node cuts the line of its words where two 1-D clusters are tightest, among the cuts that leave
    each side between a quarter and three quarters of the node's unigram mass (at the half when a single word
    outweighs that): similar words share a path, and frequent words stay near the root, every level taking at least
    a quarter of the mass off."""

    def goes_left(order: np.ndarray, line: np.ndarray) -> np.ndarray:
        mass = np.cumsum(weights[order])[:-1] / weights[order].sum()  # left side's share for cut = 1 .. n-1
        sizes = np.arange(1, len(order))
        sums = np.cumsum(line)[:-1]
        spread = -(sums**2 / sizes + (line.sum() - sums) ** 2 / (len(order) - sizes))  # within-sides sum of squares
        allowed = (mass >= 0.25) & (mass <= 0.75)
        if allowed.any():
            cut = int(sizes[allowed][np.argmin(spread[allowed])])
        else:
            cut = int(sizes[np.argmin(np.abs(mass - 0.5))])
        return np.arange(len(order)) < cut

    return _top_down(vectors, goes_left)


def leaf_depths(branches: torch.Tensor) -> np.ndarray:
    """Every word's path length in a tree given as ``branches`` (children before parents, the root last)."""
    branches = np.asarray(branches)
    vocab_size = len(branches) + 1
    depth = np.zeros(2 * vocab_size - 1, dtype=np.int64)
    for i in reversed(range(len(branches))):
        depth[branches[i]] = depth[vocab_size + i] + 1
    return depth[:vocab_size]


def huffman_clustered_branches(vectors: np.ndarray, weights: np.ndarray) -> torch.Tensor:
    """A Huffman code whose words are placed by their embeddings: every word keeps its Huffman path length (so the
    expected path, the cost of a tree, is the Huffman tree's), but any tree with those depths is an optimal code,
    and this one splits top-down like ``clustered_branches``. A node whose words lie ``r`` levels below it has
    Kraft sum Σ 2^-r = 1 and must send exactly half of it each way: walking its words along their principal
    direction, the left child takes each word that still fits in its half (near neighbours first, then a few small
    words from further along). The walk always fills the half exactly: were it to stop short by c, every word
    smaller than the smallest one it skipped, m > c, was taken, so the taken sum and the half are both multiples of
    m (the shares are powers of two), and so is c."""
    depths = leaf_depths(huffman_branches(weights))

    def goes_left(order: np.ndarray, _line: np.ndarray) -> np.ndarray:
        deepest = int(depths[order].max())
        units = [1 << (deepest - int(d)) for d in depths[order]]  # Kraft shares 2^-r as exact (Python) integers
        half, total = sum(units) // 2, 0
        left = np.zeros(len(order), dtype=bool)
        for i, unit in enumerate(units):
            if total + unit <= half:
                left[i], total = True, total + unit
        return left

    return _top_down(vectors, goes_left)


def load_embeddings(
    path: str, vocab_size: int, key: str = "head.tree_embeddings", names: tuple[str, ...] = ("embedding.weight",)
) -> np.ndarray:
    """The input embeddings ``[V, E]`` of a trained run or checkpoint over the same vocabulary (``key``: the config
    key that named it, for the errors), or the first of the other weights ``names`` that the model has."""
    from safetensors.torch import load_file

    from lmserve.training.checkpoint import resolve_checkpoint  # (imports the model, which imports the heads)

    tensors = load_file(str(resolve_checkpoint(path) / "model.safetensors"))
    found = [name for name in names if name in tensors]
    if not found:
        raise ValueError(f"{key} = {path!r}: its model has none of {', '.join(names)} (slim input embeddings?)")
    weights = tensors[found[0]]
    if weights.shape[0] != vocab_size:
        raise ValueError(
            f"{key} = {path!r}: its embeddings cover {weights.shape[0]} words, the vocabulary has "
            f"{vocab_size} (train it on the same vocabulary, e.g. with vocab.file)"
        )
    return weights.double().numpy()


class TreeSoftmax(Head):
    def __init__(self, in_dim: int, vocab_size: int, tree: str = "huffman", embeddings: str = ""):
        super().__init__()
        if tree not in TREE_TYPES:
            raise ValueError(f"head.tree = {tree!r}, expected one of {', '.join(TREE_TYPES)}")
        if tree in ("clustered", "huffman_clustered") and not embeddings:
            raise ValueError(f"head.tree = {tree} needs head.tree_embeddings: a trained run over the same vocabulary")
        if vocab_size < 2:
            raise ValueError(f"a tree softmax needs at least 2 words, the vocabulary has {vocab_size}")
        self.vocab_size = vocab_size
        self.tree = tree
        self.embeddings = embeddings
        self.nodes = nn.Linear(in_dim, vocab_size - 1)
        self.register_buffer("branches", huffman_branches(np.ones(vocab_size)))
        self._derive_paths()
        self.register_load_state_dict_post_hook(lambda module, _keys: module._derive_paths())

    def _derive_paths(self) -> None:
        """``path_nodes [V, L]`` (internal node indices) and ``path_signs [V, L]`` (+1 right, -1 left, 0 padding)
        from ``branches``, walking up from every leaf at once."""
        vocab_size = self.vocab_size
        branches = self.branches.cpu()
        parent = torch.full((2 * vocab_size - 1,), -1, dtype=torch.long)
        side = torch.zeros(2 * vocab_size - 1)
        internal = torch.arange(vocab_size - 1)
        parent[branches[:, 0]], side[branches[:, 0]] = internal, -1.0
        parent[branches[:, 1]], side[branches[:, 1]] = internal, 1.0
        node, nodes, signs = torch.arange(vocab_size), [], []
        while bool((parent[node] >= 0).any()):
            up = parent[node]
            active = up >= 0
            nodes.append(torch.where(active, up, 0))
            signs.append(torch.where(active, side[node], 0.0))
            node = torch.where(active, up + vocab_size, node)
        device = self.branches.device
        self.register_buffer("path_nodes", torch.stack(nodes, 1).to(device), persistent=False)
        self.register_buffer("path_signs", torch.stack(signs, 1).to(device), persistent=False)

    @torch.no_grad()
    def fit_prior(self, log_prior):
        weights = log_prior.double().exp().cpu().numpy()
        if self.tree == "huffman":
            self.branches.copy_(huffman_branches(weights))
        elif self.tree == "clustered":
            self.branches.copy_(clustered_branches(load_embeddings(self.embeddings, self.vocab_size), weights))
        elif self.tree == "huffman_clustered":
            self.branches.copy_(huffman_clustered_branches(load_embeddings(self.embeddings, self.vocab_size), weights))
        self._derive_paths()

    @torch.no_grad()
    def set_prior_bias(self, log_prior):
        """Each node's bias at log(mass right / mass left): a zero state then walks down to the prior exactly."""
        vocab_size = self.vocab_size
        mass = np.zeros(2 * vocab_size - 1)
        mass[:vocab_size] = log_prior.double().exp().cpu().numpy()
        branches = self.branches.cpu().numpy()
        for i, (left, right) in enumerate(branches):  # children before parents
            mass[vocab_size + i] = mass[left] + mass[right]
        bias = np.log(mass[branches[:, 1]]) - np.log(mass[branches[:, 0]])
        self.nodes.bias.copy_(torch.from_numpy(bias))

    def target_terms(self, hidden, targets):
        """(exact log-probability, a zero log normaliser): there is nothing to normalise."""
        nodes = self.path_nodes.index_select(0, targets)  # [N, L]
        signs = self.path_signs.index_select(0, targets)
        vectors = self.nodes.weight.index_select(0, nodes.reshape(-1)).reshape(nodes.shape[0], nodes.shape[1], -1)
        logits = torch.bmm(vectors, hidden.unsqueeze(2)).squeeze(2).float()  # float32 under autocast (Head)
        logits = logits + self.nodes.bias.index_select(0, nodes.reshape(-1)).reshape(nodes.shape)
        logprob = (nn.functional.logsigmoid(signs * logits) * signs.abs()).sum(-1)
        return logprob, torch.zeros_like(logprob).unsqueeze(1)

    def target_logprob(self, hidden, targets):
        return self.target_terms(hidden, targets)[0]

    def target_score(self, hidden, targets):
        return self.target_logprob(hidden, targets)

    def candidate_logprobs(self, hidden, candidates):
        """Each candidate costs its path, less than the whole distribution for few candidates."""
        return per_candidate(self.target_logprob, hidden, candidates)

    def log_probs(self, hidden):
        """Every node's logit at once, then one path step of every word at a time: memory ``[N, V]``, not
        ``[N, V, L]``."""
        logits = self.nodes(hidden)
        return sum(
            nn.functional.logsigmoid(signs * logits.index_select(1, nodes)) * signs.abs()
            for nodes, signs in zip(self.path_nodes.T, self.path_signs.T, strict=True)
        )

    def scores(self, hidden):
        return self.log_probs(hidden)
