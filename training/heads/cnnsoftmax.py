"""CNN-softmax with a correction term (Jozefowicz et al. 2016, "Exploring the limits of language modeling", §3.2;
Ruder's survey; Labeau 2018, ch. 5).

Every output vector is computed: the word's characters go through the same char-CNN as the ``charcnn`` head's
(``charcnn.char_features``: ``head.charcnn_size`` max-pooled filters over ``head.charcnn_widths``), and a linear map
takes those features to the head's input size. A CNN alone makes words spelled alike score alike, which words with
unrelated meanings and close spellings cannot afford; the correction gives each word a small free vector of
``head.correction_size`` dimensions, mapped up by a second shared matrix and added:

    e_w = P · CNN(chars(w)) + M · c_w,        logit_w = h · e_w + b_w

The output layer then holds V · (correction_size + 1) word-specific parameters instead of V · (D + 1), plus the CNN
and the two maps, which do not grow with the vocabulary.

Costs are the char-CNN head's: the whole-vocabulary scores run the CNN over all V spellings (exact training), a
sampled objective runs it over the targets and samples only (Jozefowicz et al. trained it with importance sampling),
and evaluation and export use ``frozen()``, the [V, D] matrix computed once, with the speller beside it for words
outside the vocabulary (their vector is the CNN's alone: no correction, the bias of a rare word).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from lmserve.training.heads.charcnn import CHUNK, EOW, PAD, SpelledHead, char_features, check_charcnn


class CNNSoftmax(SpelledHead):
    def __init__(
        self,
        in_dim: int,
        words: list[str],
        charcnn_size: int,
        char_embedding_size: int,
        widths: list[int],
        max_chars: int,
        correction_size: int,
        log_z: float = 0.0,
        learn_log_z: bool = False,
    ):
        check_charcnn(charcnn_size, char_embedding_size, widths, max_chars)
        if correction_size < 0:
            raise ValueError(f"head.correction_size = {correction_size}: expected >= 0 (0 = no correction)")
        super().__init__(in_dim, words, max_chars, log_z, learn_log_z)
        bound = 1 / math.sqrt(in_dim)  # nn.Linear's default, for model.init_range = 0
        self.char_embedding = nn.Embedding(len(self.inventory) + EOW + 1, char_embedding_size, padding_idx=PAD)
        self.convs = nn.ModuleList(nn.Conv1d(char_embedding_size, charcnn_size // len(widths), w) for w in widths)
        self.project = nn.Linear(charcnn_size, in_dim, bias=False)
        self.correction = (
            nn.Parameter(torch.empty(len(words), correction_size).uniform_(-bound, bound)) if correction_size else None
        )
        self.correct = nn.Linear(correction_size, in_dim, bias=False) if correction_size else None
        self.bias = nn.Parameter(torch.empty(len(words)).uniform_(-bound, bound))

    def spelled_vectors(self, char_ids: torch.Tensor) -> torch.Tensor:
        """``P · CNN(chars)``: the part of the output vectors that comes from the spelling, ``[S, D]``."""
        return self.project(char_features(char_ids, self.char_embedding, self.convs))

    def output_matrix(self) -> torch.Tensor:
        spelled = torch.cat([self.spelled_vectors(chunk) for chunk in self.char_ids.split(CHUNK)])
        return spelled if self.correction is None else spelled + self.correct(self.correction)

    def output_vectors(self, ids):
        # one CNN pass per distinct word: sampled objectives ask for frequent words many times over
        unique, inverse = torch.unique(ids, return_inverse=True)
        vectors = self.spelled_vectors(self.char_ids.index_select(0, unique)).index_select(0, inverse)
        if self.correction is not None:
            vectors = vectors + self.correct(self.correction.index_select(0, ids))
        return vectors, self.bias.index_select(0, ids)

    def spelling_map(self) -> nn.Module:
        """The projected CNN vector of the spelling, no correction."""
        return self.project
