"""Open-vocabulary bundles (format 3, ``vocab.type = "subword"``): words spelled as sentencepiece pieces.

The LSTM reads and scores pieces; everything the scorer hands out is per *word*: a word is spelled alone (never
across a word boundary, as ``lm-train prepare`` spelled the training text) and its score is the sum of its pieces'
scores, so per-word scores, sentence scores, n-best prefix sharing and decoder steps keep their word-level meaning.
Nothing is out of vocabulary: the model falls back to UTF-8 byte pieces for characters it never saw. Only the text's
own unknown-word token (the bundle's ``<unk>``) is the single piece ``<unk>``, and ``</s>`` is the piece ``</s>``.
"""

from __future__ import annotations

import numpy as np
import sentencepiece as spm

from lmserve.core.bundle import Bundle, BundleError

CACHE_WORDS = 1 << 20  # spellings kept; the cache starts again when full (a server sees an open set of words)


class EveryWord:
    """The word list of an open vocabulary: every word is in it (``w in scorer.known_words`` is always true)."""

    def __contains__(self, word: object) -> bool:
        return True


class WordPieces:
    """A bundle's sentencepiece model: words -> piece ids of the bundle vocabulary."""

    def __init__(self, bundle: Bundle):
        path = bundle.subword_model
        try:
            self.processor = spm.SentencePieceProcessor(model_file=str(path))
        except (OSError, RuntimeError) as e:
            raise BundleError(f"{path}: sentencepiece cannot load the model: {e}") from e
        index = {token: i for i, token in enumerate(bundle.tokens)}
        size = self.processor.get_piece_size()
        pieces = [self.processor.id_to_piece(i) for i in range(3, size)]
        missing = [p for p in pieces if p not in index]
        if size != len(bundle.tokens) or missing:
            raise BundleError(
                f"{path}: {size} pieces, {bundle.path / bundle.manifest['vocab']['file']} lists {len(bundle.tokens)}"
                + (f" and lacks {missing[:5]}" if missing else "")
                + ": the model and the vocabulary must come from the same export"
            )
        self.to_vocab = np.array([0, 1, 2, *(index[p] for p in pieces)], dtype=np.int64)
        self.unk_word, self.eos_word = bundle.tokens[0], bundle.tokens[2]
        self._cache: dict[str, tuple[int, ...]] = {}

    def spell(self, word: str) -> tuple[int, ...]:
        """The piece ids of one word."""
        pieces = self._cache.get(word)
        if pieces is None:
            if word == self.unk_word:
                pieces = (0,)
            elif word == self.eos_word:
                pieces = (2,)
            else:
                pieces = tuple(self.to_vocab[self.processor.encode(word)].tolist())
            if len(self._cache) >= CACHE_WORDS:
                self._cache.clear()
            self._cache[word] = pieces
        return pieces

    def word_scores(self, words: list[str], piece_scores: np.ndarray) -> np.ndarray:
        """Scores of ``words`` and </s> from the scores of their pieces and </s> (the sum of each word's pieces)."""
        lengths = np.fromiter((len(self.spell(w)) for w in words), dtype=np.int64, count=len(words))
        out = np.empty(len(words) + 1, dtype=np.float32)
        if len(words):
            out[:-1] = np.add.reduceat(piece_scores[:-1].astype(np.float64), np.cumsum(lengths) - lengths)
        out[-1] = piece_scores[-1]
        return out
