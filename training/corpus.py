"""Reading text corpora: plain or gzipped UTF-8, one sentence per line, whitespace tokens.

Sentences are kept as one flat int32 array plus offsets, so a 5M-token corpus costs 20 MB, not a list of lists.
"""

from __future__ import annotations

import gzip
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from training.vocab import Vocabulary


class CorpusError(ValueError):
    """A corpus file is missing or unreadable; the message names the file and line."""


def open_binary(path: str | Path):
    """Open a file for reading, gunzipping it when it starts with the gzip magic bytes (whatever its name)."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            magic = f.read(2)
    except FileNotFoundError as e:
        raise CorpusError(f"{path}: file not found") from e
    return gzip.open(path, "rb") if magic == b"\x1f\x8b" else path.open("rb")


def read_sentences(path: str | Path, lowercase: bool = False) -> Iterator[list[str]]:
    """Yield each line's whitespace tokens (an empty line is an empty sentence)."""
    with open_binary(path) as f:
        lineno = 0
        while True:
            try:
                line = f.readline()
            except (OSError, EOFError) as e:  # truncated or corrupt gzip stream
                raise CorpusError(f"{path}: unreadable after line {lineno}: {e}") from e
            if not line:
                return
            lineno += 1
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as e:
                raise CorpusError(f"{path}:{lineno}: not valid UTF-8 ({e.reason} at byte {e.start})") from e
            yield (text.lower() if lowercase else text).split()


@dataclass
class EncodedCorpus:
    """Sentence i is ``ids[offsets[i]:offsets[i+1]]`` (no <s>/</s>); ``oov`` counts words mapped to <unk>."""

    path: str
    ids: np.ndarray
    offsets: np.ndarray
    oov: int

    @property
    def num_sentences(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_words(self) -> int:
        return len(self.ids)

    @property
    def oov_rate(self) -> float:
        """Share of words (not counting </s>) that are <unk>, whether the text wrote <unk> or the vocabulary lacks them."""
        return self.oov / max(1, self.num_words)

    def sentence(self, i: int) -> np.ndarray:
        return self.ids[self.offsets[i] : self.offsets[i + 1]]

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


def encode_file(path: str | Path, vocab: Vocabulary, lowercase: bool = False) -> EncodedCorpus:
    ids: list[int] = []
    offsets = [0]
    lookup, unk = vocab.index, vocab.unk_id
    for tokens in read_sentences(path, lowercase):
        ids.extend(lookup.get(t, unk) for t in tokens)
        offsets.append(len(ids))
    if len(offsets) == 1:
        raise CorpusError(f"{path}: no lines")
    array = np.asarray(ids, dtype=np.int32)
    return EncodedCorpus(str(path), array, np.asarray(offsets, dtype=np.int64), int((array == unk).sum()))


def file_fingerprint(path: str | Path) -> dict:
    """What a model was trained on, so that a bundle can say so: path, size and sha256 of the file."""
    digest = hashlib.sha256()
    size = 0
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
            size += len(block)
    return {"path": str(path), "bytes": size, "sha256": digest.hexdigest()}
