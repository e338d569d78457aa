"""Word vocabulary with counts.

Ids 0, 1, 2 are <unk>, <s>, </s>; words follow by descending training count (ties by spelling), because adaptive
softmax cutoffs and unigram samplers read frequency order straight off the ids.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path

from lmserve.core.atomic import atomic_write_text
from lmserve.core.bundle import VOCAB_HEADER as HEADER  # checkpoints and bundles share the vocabulary format

BOS, EOS = "<s>", "</s>"


class VocabError(ValueError):
    """A vocabulary file is malformed; the message names the file and line."""


class Vocabulary:
    unk_id, bos_id, eos_id = 0, 1, 2

    def __init__(self, tokens: list[str], counts: list[int]):
        if tokens[1:3] != [BOS, EOS]:
            raise VocabError(f"ids 1 and 2 must be {BOS} and {EOS}, got {tokens[1:3]}")
        self.tokens = tokens
        self.counts = counts
        self.index = {t: i for i, t in enumerate(tokens)}
        if len(self.index) != len(tokens):
            duplicated = next(t for t, n in Counter(tokens).items() if n > 1)
            raise VocabError(f"token {duplicated!r} appears twice")

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def unk(self) -> str:
        return self.tokens[self.unk_id]

    @classmethod
    def build(
        cls, sentences: Iterable[list[str]], min_count: int = 1, max_size: int = 0, unk: str = "<unk>"
    ) -> Vocabulary:
        counts: Counter[str] = Counter()
        num_sentences = 0
        for tokens in sentences:
            counts.update(tokens)
            num_sentences += 1
        return cls.from_counts(counts, num_sentences, min_count, max_size, unk)

    @classmethod
    def from_counts(
        cls, counts: Mapping[str, int], num_sentences: int, min_count: int = 1, max_size: int = 0, unk: str = "<unk>"
    ) -> Vocabulary:
        """Keep words seen at least ``min_count`` times, then the most frequent ones up to ``max_size`` entries in
        all (specials included). The data's own ``unk`` token (PTB writes <unk>) is the <unk> entry, not a word."""
        counts = {w: c for w, c in counts.items() if w not in (BOS, EOS)}
        unk_count = counts.pop(unk, 0)
        words = sorted((w for w, c in counts.items() if c >= min_count), key=lambda w: (-counts[w], w))
        if max_size:
            if max_size <= 3:
                raise VocabError(f"max_size {max_size} leaves no room for words after the 3 specials")
            words = words[: max_size - 3]
        kept = sum(counts[w] for w in words)
        unk_count += sum(counts.values()) - kept
        tokens = [unk, BOS, EOS, *words]
        return cls(tokens, [unk_count, num_sentences, num_sentences, *(counts[w] for w in words)])

    def target_log_prior(self) -> list[float]:
        """Add-one smoothed log unigram probabilities of every id as a *predicted* token (<s> never is one)."""
        counts = [0 if i == self.bos_id else c for i, c in enumerate(self.counts)]
        total = sum(counts) + len(counts)
        return [math.log((c + 1) / total) for c in counts]

    def save(self, path: str | Path) -> None:
        lines = [HEADER] + [f"{t}\t{c}" for t, c in zip(self.tokens, self.counts, strict=True)]
        atomic_write_text(path, "\n".join(lines) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Vocabulary:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except FileNotFoundError as e:
            raise VocabError(f"{path}: vocabulary file not found") from e
        lines = text.splitlines()
        if not lines or lines[0] != HEADER:
            raise VocabError(f"{path}:1: expected the header {HEADER!r}")
        tokens, counts = [], []
        for lineno, line in enumerate(lines[1:], 2):
            fields = line.split("\t")
            if len(fields) != 2 or not fields[0] or any(c.isspace() for c in fields[0]):
                raise VocabError(f"{path}:{lineno}: expected 'token<TAB>count' with a token without spaces")
            try:
                count = int(fields[1])
            except ValueError as e:
                raise VocabError(f"{path}:{lineno}: count {fields[1]!r} is not an integer") from e
            tokens.append(fields[0])
            counts.append(count)
        if len(tokens) < 3:
            raise VocabError(f"{path}: needs at least the 3 specials, has {len(tokens)} entries")
        try:
            return cls(tokens, counts)
        except VocabError as e:
            raise VocabError(f"{path}: {e}") from e
