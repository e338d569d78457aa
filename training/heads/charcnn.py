"""Character-CNN output embeddings (Labeau 2018, thesis ch. 5; after Kim et al. 2016 on the input side).

Each word's output vector is a free word vector concatenated with a vector computed from its spelling: characters
embedded, one bank of convolution filters per width, each filter max-pooled over the word. A rare word, whose own
vector a sampled objective almost never updates, shares the filters with every word spelled like it, so its
score moves with theirs (inflections, compounds, numbers). Labeau trained it with importance sampling and NCE: a
sampled step runs the CNN over the targets and the samples only (~1,000 words), not the vocabulary.

A word outside the vocabulary has a vector too, from its spelling alone (``speller``: no word vector, the bias of a
rare word): the frozen head keeps that speller, and export writes it into the bundle's open-vocabulary graph
(``training.export``), so that the scorer can give such a word its own probability instead of <unk>'s.

Costs: the whole-vocabulary scores (exact training) run the CNN over all V spellings, O(V · max_chars · Σ widths ·
filters) lookups and adds per call (the convolution is summed from per-offset character tables, see
``char_vectors``), on top of the [N, D] x [D, V] product. Evaluation and serving do not:
``frozen()`` precomputes the [V, D] output matrix into a plain full softmax, once per evaluation, and that is what
export writes.
"""

from __future__ import annotations

import abc
import math

import torch
from torch import nn

from lmserve.training.heads.base import LinearHead, Speller
from lmserve.training.heads.full import FullSoftmax, frozen_linear

PAD, BOW, EOW = 0, 1, 2
CHUNK = 8192  # words per CNN pass over the vocabulary: bounds the [chunk, filters, positions] activations
OOV_BIAS_SHARE = 0.1  # an out-of-vocabulary word's bias: the mean of the rarest tenth of the vocabulary's


def char_inventory(words: list[str]) -> dict[str, int]:
    """Character -> id, from ``EOW + 1``; sorted, so the same words give the same ids and a saved model's spellings
    are rebuilt identically."""
    return {c: i for i, c in enumerate(sorted({c for w in words for c in w}), start=EOW + 1)}


def spell(word: str, inventory: dict[str, int], max_chars: int) -> list[int]:
    """``BOW``, the ids of the word's first ``max_chars`` characters, ``EOW``. Characters outside the inventory (only
    an out-of-vocabulary word has them) are left out: the model never saw them."""
    return [BOW, *[inventory[c] for c in word if c in inventory][:max_chars], EOW]


def spelling_table(words: list[str], inventory: dict[str, int], max_chars: int) -> torch.Tensor:
    """``[len(words), max_chars + 2]`` spellings padded with ``PAD``."""
    char_ids = torch.full((len(words), max_chars + 2), PAD, dtype=torch.long)
    for row, word in zip(char_ids, words, strict=True):
        spelled = spell(word, inventory, max_chars)
        row[: len(spelled)] = torch.tensor(spelled)
    return char_ids


def check_charcnn(charcnn_size: int, char_embedding_size: int, widths: list[int], max_chars: int) -> None:
    """The char-CNN's own settings, errors naming their keys (the heads check how it fits their input size)."""
    if charcnn_size < 1:
        raise ValueError(f"head.charcnn_size = {charcnn_size}: expected at least 1 filter")
    if max_chars < 1:
        raise ValueError(f"head.charcnn_max_chars = {max_chars}: expected at least 1")
    if not widths or any(not 0 < w <= max_chars + 2 for w in widths):
        raise ValueError(
            f"head.charcnn_widths = {widths}: expected filter widths between 1 and head.charcnn_max_chars + 2 = "
            f"{max_chars + 2} (the characters and the word's begin and end markers)"
        )
    if charcnn_size % len(widths):
        raise ValueError(
            f"head.charcnn_size = {charcnn_size}: expected a multiple of the {len(widths)} filter widths "
            "(one bank of equal size per width)"
        )
    if char_embedding_size < 1:
        raise ValueError(f"head.char_embedding_size = {char_embedding_size}: expected at least 1")


def char_features(char_ids: torch.Tensor, char_embedding: nn.Embedding, convs: nn.ModuleList) -> torch.Tensor:
    """``[S, filters]`` spelling vectors of ``[S, max_chars + 2]`` character ids.

    Padding never counts: its embeddings are zeroed here (the model's uniform initialisation overwrites the
    padding row too), and each filter's max runs over the windows that lie within the word and its markers. A
    word shorter than a filter (a width above its length + 2) keeps the first window only, which then sees the
    whole word zero-padded on the right, as Conv1d's own padding would. tanh after the max (the same as before
    it, being monotonic): bounded like the uniformly initialised word vectors it is concatenated with, where a
    ReLU would let a few filters dominate the scores, and would give a filter negative on every word no gradient.
    """
    length = (char_ids != PAD).sum(1, keepdim=True)  # the word and its markers
    positions = char_ids.shape[1]
    weight = char_embedding.weight
    table = weight * (torch.arange(len(weight), device=weight.device) != PAD).unsqueeze(1)
    pooled = []
    for conv in convs:
        width = conv.kernel_size[0]
        windows = positions - width + 1
        # a filter's response to character c at window offset k, for every c: [width, chars, F]; the convolution
        # is then a sum of ``width`` lookups in these small tables (charcnn-is on PTB trained 16% faster so than
        # with Conv1d, whose oneDNN kernel spent much of its time converting layouts for these tiny channels)
        offsets = torch.einsum("ce,fek->kcf", table, conv.weight)
        out = conv.bias + sum(
            nn.functional.embedding(char_ids[:, k : k + windows], offsets[k]) for k in range(width)
        )  # [S, windows, F]
        last = (length - width).clamp(min=0)  # the last window start to keep
        inside = torch.arange(windows, device=out.device) <= last  # [S, windows]
        pooled.append(out.masked_fill(~inside.unsqueeze(2), float("-inf")).amax(1))
    return torch.tanh(torch.cat(pooled, dim=1))


def oov_bias(bias: torch.Tensor) -> torch.Tensor:
    """The bias an out-of-vocabulary word is scored with: the mean of the rarest ``OOV_BIAS_SHARE`` of the words'
    (ids are in descending frequency), since a word the vocabulary left out is rarer than any it kept. Not the bias
    of ``<unk>``, which holds the mass of every such word together."""
    rare = max(1, int(len(bias) * OOV_BIAS_SHARE))
    return bias[-rare:].mean()


class CharCNNSpeller(Speller):
    """A char-CNN head's output vector of any spelled word: the word's own part (and correction) are those of no word,
    zero, the spelling part is computed from its characters; ``vector_of`` maps the CNN's features to the rest."""

    def __init__(self, inventory, max_chars, char_embedding, convs, vector_of, bias):
        super().__init__(inventory, max_chars)
        self.char_embedding = char_embedding
        self.convs = convs
        self.vector_of = vector_of
        self.register_buffer("bias", bias.detach().reshape(()).clone(), persistent=False)

    def forward(self, char_ids):
        vectors = self.vector_of(char_features(char_ids, self.char_embedding, self.convs))
        return vectors, self.bias.expand(vectors.shape[0])


class _PadLeft(nn.Module):
    """Zeros before the CNN's features: a charcnn head's word-vector part, for a word that has none."""

    def __init__(self, width: int):
        super().__init__()
        self.width = width

    def forward(self, features):
        return nn.functional.pad(features, (self.width, 0))


class SpelledHead(LinearHead):
    """What the char-CNN heads share: the vocabulary's spellings and the whole-vocabulary scores, frozen form and
    speller built from ``output_matrix`` and ``spelling_map``, which each head defines (parameters are made by the
    heads themselves, in the order that fixes their random initialisation)."""

    def __init__(self, in_dim: int, words: list[str], max_chars: int, log_z: float, learn_log_z: bool):
        super().__init__(log_z, learn_log_z)
        self.vocab_size = len(words)
        self.in_dim = in_dim
        self.inventory = char_inventory(words)
        self.max_chars = max_chars
        self.register_buffer("char_ids", spelling_table(words, self.inventory, max_chars))  # [V, max_chars + 2]

    @abc.abstractmethod
    def output_matrix(self) -> torch.Tensor:
        """The ``[V, D]`` output vectors of the whole vocabulary."""

    @abc.abstractmethod
    def spelling_map(self) -> nn.Module:
        """The CNN's features of a spelling -> an out-of-vocabulary word's output vector (the speller's)."""

    def output_bias(self):
        return self.bias

    def logits(self, hidden):
        return nn.functional.linear(hidden, self.output_matrix(), self.bias)

    @torch.no_grad()
    def frozen(self) -> FullSoftmax:
        """The head as served: the output matrix computed once into a full softmax with the same scores, so that
        the exported graph holds a [V, D] matrix and no CNN (Labeau ch. 5 precomputes it for inference alike)."""
        return frozen_linear(self, self.output_matrix())

    def speller(self) -> CharCNNSpeller:
        """An out-of-vocabulary word's vector: the CNN's features of its spelling through ``spelling_map``, with the
        bias of a rare word."""
        return CharCNNSpeller(
            self.inventory, self.max_chars, self.char_embedding, self.convs, self.spelling_map(), oov_bias(self.bias)
        )


class CharCNNSoftmax(SpelledHead):
    def __init__(
        self,
        in_dim: int,
        words: list[str],
        charcnn_size: int,
        char_embedding_size: int,
        widths: list[int],
        max_chars: int,
        log_z: float = 0.0,
        learn_log_z: bool = False,
    ):
        if not 0 < charcnn_size < in_dim:
            raise ValueError(
                f"head.charcnn_size = {charcnn_size}: expected between 0 and the head's input size {in_dim} "
                "(the rest of each output vector is the word's own vector)"
            )
        check_charcnn(charcnn_size, char_embedding_size, widths, max_chars)
        super().__init__(in_dim, words, max_chars, log_z, learn_log_z)
        bound = 1 / math.sqrt(in_dim)  # nn.Linear's default, for model.init_range = 0
        self.word_vectors = nn.Parameter(torch.empty(len(words), in_dim - charcnn_size).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(len(words)).uniform_(-bound, bound))
        self.char_embedding = nn.Embedding(len(self.inventory) + EOW + 1, char_embedding_size, padding_idx=PAD)
        self.convs = nn.ModuleList(nn.Conv1d(char_embedding_size, charcnn_size // len(widths), w) for w in widths)

    def char_vectors(self, char_ids: torch.Tensor) -> torch.Tensor:
        """``[S, charcnn_size]`` spelling vectors of ``[S, max_chars + 2]`` character ids (``char_features``)."""
        return char_features(char_ids, self.char_embedding, self.convs)

    def output_matrix(self) -> torch.Tensor:
        chars = torch.cat([self.char_vectors(chunk) for chunk in self.char_ids.split(CHUNK)])
        return torch.cat([self.word_vectors, chars], dim=1)

    def output_vectors(self, ids):
        # sampled objectives ask for targets and samples, frequent words many times over: one CNN pass per word
        unique, inverse = torch.unique(ids, return_inverse=True)
        chars = self.char_vectors(self.char_ids.index_select(0, unique)).index_select(0, inverse)
        vectors = torch.cat([self.word_vectors.index_select(0, ids), chars], dim=1)
        return vectors, self.bias.index_select(0, ids)

    def spelling_map(self) -> nn.Module:
        """No word vector (zeros) before the CNN's vector of the spelling."""
        return _PadLeft(self.word_vectors.shape[1])
