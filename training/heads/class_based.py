"""Class-based softmax (Goodman 2001; Mikolov et al. 2011): p(w | h) = p(class(w) | h) · p(w | class(w), h).

By default classes are frequency bins: ids are sorted by descending frequency (the vocabulary guarantees it,
specials aside), so each class is a contiguous id range, cut where the running sum of sqrt(frequency) crosses a
multiple of 1/C — the binning of Mikolov's rnnlm toolkit. Binning sqrt-frequencies rather than frequencies keeps the
rare-word classes small (PTB, 100 classes: at most 293 words instead of 1633). With ``class_embeddings`` the classes
are clusters of a trained model's embeddings instead, of about equal sqrt-frequency mass (``clustered_classes``), so
that a class holds words used alike rather than words equally frequent.

Internally the words are laid out class after class: ``position`` (a buffer saved with the model; the identity for
frequency bins) maps a word id to its row of the word matrix, every class is a contiguous range of rows, and the
heads' inputs and outputs are in word ids.

A target costs the class softmax and its own class. Training groups a batch's targets by class (``target_terms``);
the exported graphs, which must be branch-free, gather each target's class padded to the largest class instead
(``_in_class``), and score the whole vocabulary through the same padded ``[C, S]`` table (``log_probs``).

Until ``init_bias`` hands over the training unigram, the classes are equal-sized id ranges; the bounds and the
positions are buffers saved with the model, and everything else is derived from them.
"""

from __future__ import annotations

import heapq
import math
from itertools import pairwise

import numpy as np
import torch
from torch import nn

from lmserve.training.heads.base import Head, per_candidate, rowwise_dot
from lmserve.training.heads.tree import clustered_branches, load_embeddings


def frequency_bins(log_prior: torch.Tensor, classes: int) -> torch.Tensor:
    """``classes + 1`` increasing bounds over ids, cutting the running sqrt-frequency mass into equal shares; every
    class keeps at least one word."""
    vocab_size = len(log_prior)
    mass = (0.5 * log_prior.double()).exp().cumsum(0)
    cuts = torch.searchsorted(mass, mass[-1] * torch.arange(1, classes, dtype=torch.float64) / classes, right=True)
    bounds = [0]
    for c, cut in enumerate(cuts.tolist(), start=1):
        bounds.append(min(max(cut, bounds[-1] + 1), vocab_size - (classes - c)))
    return torch.tensor([*bounds, vocab_size])


def clustered_classes(vectors: np.ndarray, log_prior: torch.Tensor, classes: int) -> list[np.ndarray]:
    """``classes`` groups of word ids, similar embeddings together, of about equal sqrt-frequency mass (heaviest
    first): the clustered tree over sqrt-frequencies (``tree.clustered_branches``) cut top-down, always at the
    heaviest subtree that is more than one word, until there are ``classes`` subtrees."""
    weights = (0.5 * log_prior.double()).exp().cpu().numpy()
    vocab_size = len(weights)
    branches = clustered_branches(vectors, weights).tolist()
    mass = np.concatenate([weights, np.zeros(len(branches))])
    for i, (left, right) in enumerate(branches):  # children before parents
        mass[vocab_size + i] = mass[left] + mass[right]
    if not branches:  # a single word
        return [np.arange(vocab_size)]
    splittable, words = [(-mass[-1], len(mass) - 1)], []  # the root: the last node
    while splittable and len(splittable) + len(words) < classes:
        _, node = heapq.heappop(splittable)
        for child in branches[node - vocab_size]:
            if child < vocab_size:
                words.append(child)
            else:
                heapq.heappush(splittable, (-mass[child], child))

    def leaves(node: int) -> list[int]:
        stack, out = [node], []
        while stack:
            n = stack.pop()
            if n < vocab_size:
                out.append(n)
            else:
                stack.extend(branches[n - vocab_size])
        return out

    nodes = sorted([node for _, node in splittable] + words, key=lambda n: -mass[n])
    return [np.sort(leaves(node)) for node in nodes]


class ClassSoftmax(Head):
    def __init__(self, in_dim: int, vocab_size: int, classes: int = 0, embeddings: str = ""):
        super().__init__()
        classes = classes or round(math.sqrt(vocab_size))
        if not 1 <= classes <= vocab_size:
            raise ValueError(f"head.classes = {classes}: expected between 1 and the vocabulary size {vocab_size}")
        self.vocab_size = vocab_size
        self.embeddings = embeddings
        self.classes = nn.Linear(in_dim, classes)
        self.words = nn.Linear(in_dim, vocab_size)  # row position[w]: word w's vector and bias inside its class
        equal = torch.linspace(0, vocab_size, classes + 1).round().long()
        self.register_buffer("bounds", equal)
        self.register_buffer("position", torch.arange(vocab_size))
        self._derive()
        # checkpoints from before clustered classes have frequency bins: the identity layout
        self.register_load_state_dict_pre_hook(
            lambda module, state, prefix, *_: state.setdefault(prefix + "position", torch.arange(module.vocab_size))
        )
        self.register_load_state_dict_post_hook(lambda module, _keys: module._derive())

    def _derive(self) -> None:
        """Index tables from ``bounds``: each word's class and slot in a ``[C, S]`` table padded to the largest
        class S, and that table's word ids (padding repeats the class's first word and is masked)."""
        bounds = self.bounds
        sizes = bounds[1:] - bounds[:-1]
        self.max_class_size = int(sizes.max())
        self.bound_list = bounds.tolist()
        self.class_sizes = sizes.tolist()
        slots = torch.arange(self.max_class_size, device=bounds.device)
        valid = slots[None, :] < sizes[:, None]
        word_class = torch.bucketize(torch.arange(self.vocab_size, device=bounds.device), bounds, right=True) - 1
        self.register_buffer("table_valid", valid, persistent=False)
        self.register_buffer("table_ids", torch.where(valid, bounds[:-1, None] + slots, bounds[:-1, None]), False)
        self.register_buffer("word_class", word_class, persistent=False)
        word_slot = word_class * self.max_class_size + torch.arange(self.vocab_size, device=bounds.device)
        self.register_buffer("word_slot", word_slot - bounds.index_select(0, word_class), persistent=False)

    @torch.no_grad()
    def fit_prior(self, log_prior):
        classes = len(self.bounds) - 1
        if self.embeddings:
            vectors = load_embeddings(self.embeddings, self.vocab_size, "head.class_embeddings")
            members = clustered_classes(vectors, log_prior, classes)
            order = torch.from_numpy(np.concatenate(members))
            sizes = torch.tensor([len(m) for m in members])
            self.bounds.copy_(torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)]))
            self.position.copy_(torch.empty_like(order).scatter_(0, order, torch.arange(self.vocab_size)))
        else:
            self.bounds.copy_(frequency_bins(log_prior, classes))
            self.position.copy_(torch.arange(self.vocab_size))
        self._derive()

    @torch.no_grad()
    def set_prior_bias(self, log_prior):
        """Class biases at the class's mass, word biases at the word's share of it."""
        in_rows = torch.empty_like(log_prior).scatter_(0, self.position, log_prior)  # row order
        class_mass = torch.stack([in_rows[a:b].logsumexp(0) for a, b in pairwise(self.bounds.tolist())])
        self.classes.bias.copy_(class_mass)
        self.words.bias.copy_(in_rows - class_mass.index_select(0, self.word_class))

    def _in_class(self, hidden, targets):
        """(class of each target, its position in the class, masked logits ``[N, S]`` of the class's words)."""
        targets = self.position.index_select(0, targets)
        cls = self.word_class.index_select(0, targets)
        start = self.bounds.index_select(0, cls)
        ids = self.table_ids.index_select(0, cls)  # [N, S]
        vectors = self.words.weight.index_select(0, ids.reshape(-1)).reshape(ids.shape[0], ids.shape[1], -1)
        logits = torch.bmm(vectors, hidden.unsqueeze(2)).squeeze(2)
        logits = logits + self.words.bias.index_select(0, ids.reshape(-1)).reshape(ids.shape)
        logits = logits.masked_fill(~self.table_valid.index_select(0, cls), float("-inf"))
        return cls, (targets - start).unsqueeze(1), logits

    def target_terms(self, hidden, targets):
        """Rows grouped by class, one product per class present with that class's slice of the word matrix (a view:
        classes are id ranges). A per-row gather of the class's vectors (``_in_class``, what the exported graphs do,
        being branch-free) copies them once per row: over a 512-position PTB batch that is 20M floats, three times
        slower than the full softmax's product; grouped, each class's vectors are read once."""
        targets = self.position.index_select(0, targets)
        cls = self.word_class.index_select(0, targets)
        order = torch.argsort(cls, stable=True)
        present, counts = torch.unique_consecutive(cls.index_select(0, order), return_counts=True)
        word_scores, in_norms = [], []
        # split, not a slice per class: one backward node that assembles the weight gradient once
        weights, biases = self.words.weight.split(self.class_sizes), self.words.bias.split(self.class_sizes)
        for c, rows in zip(present.tolist(), order.split(counts.tolist()), strict=True):
            logits = nn.functional.linear(hidden.index_select(0, rows), weights[c], biases[c]).float()
            position = targets.index_select(0, rows) - self.bound_list[c]
            word_scores.append(logits.gather(1, position[:, None]).squeeze(1))
            in_norms.append(logits.logsumexp(-1))
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order), device=order.device)
        class_logits = self.classes(hidden).float()  # the loss in float32 under bf16 autocast (tests/test_heads.py)
        score = class_logits.gather(1, cls[:, None]).squeeze(1) + torch.cat(word_scores).index_select(0, inverse)
        in_norm = torch.cat(in_norms).index_select(0, inverse)
        return score, torch.stack([class_logits.logsumexp(-1), in_norm], dim=-1)

    def target_logprob(self, hidden, targets):
        # through log_softmax (see LinearHead.target_logprob for why)
        cls, position, logits = self._in_class(hidden, targets)
        class_logprob = torch.log_softmax(self.classes(hidden), dim=-1).gather(1, cls[:, None]).squeeze(1)
        return class_logprob + torch.log_softmax(logits, dim=-1).gather(1, position).squeeze(1)

    def candidate_logprobs(self, hidden, candidates):
        """Each candidate costs its class, less than the whole distribution for few candidates."""
        return per_candidate(self.target_logprob, hidden, candidates)

    def log_probs(self, hidden):
        classes, size = len(self.bounds) - 1, self.max_class_size
        table = self.words(hidden).index_select(1, self.table_ids.reshape(-1)).reshape(-1, classes, size)
        in_class = torch.log_softmax(table.masked_fill(~self.table_valid, float("-inf")), dim=-1)
        class_logprob = torch.log_softmax(self.classes(hidden), dim=-1)
        in_rows = class_logprob.index_select(1, self.word_class) + in_class.reshape(-1, classes * size).index_select(
            1, self.word_slot
        )
        return in_rows.index_select(1, self.position)

    def target_score(self, hidden, targets):
        targets = self.position.index_select(0, targets)
        cls = self.word_class.index_select(0, targets)
        class_score = rowwise_dot(self.classes.weight.index_select(0, cls), hidden) + self.classes.bias.index_select(
            0, cls
        )
        word_score = rowwise_dot(self.words.weight.index_select(0, targets), hidden) + self.words.bias.index_select(
            0, targets
        )
        return class_score + word_score

    def scores(self, hidden):
        return (self.classes(hidden).index_select(1, self.word_class) + self.words(hidden)).index_select(
            1, self.position
        )
