"""Reading text corpora: plain or gzipped UTF-8, one sentence per line, whitespace tokens.

Text becomes token ids in blocks of a few MB (``text_blocks`` → ``tokenise_block``), never as one Python object per
token, so the same code encodes a 5k-line test file in memory (``encode_file``) and a billion-word corpus with worker
processes into a prepared dataset on disk (``training.prepared``). Sentences are kept as one flat id array plus
offsets: a 5M-token corpus costs 10–20 MB, not a list of lists.
"""

from __future__ import annotations

import gzip
import hashlib
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from lmserve.training.vocab import Vocabulary

BLOCK_BYTES = 8 << 20  # text handed to a tokeniser at once: about 1.5M words, cut at a line end

# bytes.split()'s whitespace; a token with any other Unicode space in it is split by str.split() instead
_ASCII_SPACE = np.zeros(256, dtype=bool)
_ASCII_SPACE[list(b" \t\n\r\x0b\x0c")] = True
_MAYBE_SPACE = re.compile(rb"[\x1c-\x1f\x80-\xff]")  # bytes of the other characters str.split() splits at


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
    except IsADirectoryError as e:
        raise CorpusError(f"{path}: is a directory, expected a text file") from e
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
class TextBlock:
    """Whole lines of one file: ``data`` starts at line ``first_line`` (1-based) and ends with its last line's end."""

    path: str
    first_line: int
    data: bytes
    lowercase: bool


def text_blocks(path: str | Path, lowercase: bool = False, block_bytes: int = BLOCK_BYTES) -> Iterator[TextBlock]:
    """A file's lines in blocks of about ``block_bytes``, each cut after a newline; an empty file is an error."""
    first_line, carry, empty = 1, b"", True
    with open_binary(path) as f:
        while True:
            try:
                chunk = f.read(block_bytes)
            except (OSError, EOFError) as e:  # truncated or corrupt gzip stream
                raise CorpusError(f"{path}: unreadable after line {first_line - 1}: {e}") from e
            if not chunk:
                break
            empty = False
            data = carry + chunk
            cut = data.rfind(b"\n") + 1
            if cut == 0:  # no line end yet: keep reading
                carry = data
                continue
            carry = data[cut:]
            yield TextBlock(str(path), first_line, data[:cut], lowercase)
            first_line += data.count(b"\n", 0, cut)
    if empty:
        raise CorpusError(f"{path}: empty file, expected one sentence per line")
    if carry:  # a last line without a newline
        yield TextBlock(str(path), first_line, carry + b"\n", lowercase)


@dataclass
class BlockIds:
    """A block's tokens as ids into its own ``keys`` (first-seen order), with each key's count and each line's
    number of tokens: what a worker sends back, a few bytes per token."""

    keys: list[bytes]
    counts: np.ndarray  # int64, one per key
    ids: np.ndarray  # uint32, one per token
    lengths: np.ndarray  # int64, one per line


def tokenise_block(block: TextBlock) -> BlockIds:
    """Split a block into tokens and give each distinct token a local id (C-level splitting and counting; one dict
    lookup per token is the only Python work per token)."""
    data = block.data
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = block.first_line + data.count(b"\n", 0, e.start)
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1)
        raise CorpusError(f"{block.path}:{line}: not valid UTF-8 ({e.reason} at byte {column})") from e
    if block.lowercase:
        data = text.lower().encode("utf-8")
    tokens = data.split()
    counts = Counter(tokens)
    keys = list(counts)
    if any(_MAYBE_SPACE.search(k) and len(k.decode("utf-8").split()) != 1 for k in keys):
        return _tokenise_lines(block)  # another Unicode space inside a token: split as str.split() does
    lengths = _tokens_per_line(data)
    index = dict(zip(keys, range(len(keys)), strict=True))
    ids = np.fromiter(map(index.__getitem__, tokens), dtype=np.uint32, count=len(tokens))
    return BlockIds(keys, np.fromiter(counts.values(), dtype=np.int64, count=len(keys)), ids, lengths)


def _tokens_per_line(data: bytes) -> np.ndarray:
    """Number of whitespace-separated tokens on each newline-terminated line, counted without a Python loop."""
    raw = np.frombuffer(data, dtype=np.uint8)
    space = _ASCII_SPACE[raw]
    starts = np.flatnonzero(~space & np.concatenate(([True], space[:-1])))  # first byte of each token
    line_ends = np.flatnonzero(raw == ord("\n"))
    return np.bincount(np.searchsorted(line_ends, starts), minlength=len(line_ends)).astype(np.int64)


def _tokenise_lines(block: TextBlock) -> BlockIds:
    """The slow path of ``tokenise_block``, line by line with ``str.split()`` (all Unicode whitespace)."""
    text = block.data.decode("utf-8")
    if block.lowercase:
        text = text.lower()
    index: dict[bytes, int] = {}
    ids: list[int] = []
    lengths: list[int] = []
    for line in text.split("\n")[:-1]:  # the block ends with a newline
        words = line.split()
        lengths.append(len(words))
        ids.extend(index.setdefault(w.encode("utf-8"), len(index)) for w in words)
    array = np.asarray(ids, dtype=np.uint32)
    return BlockIds(list(index), np.bincount(array, minlength=len(index)).astype(np.int64), array, np.array(lengths))


@dataclass
class EncodedCorpus:
    """Sentence i is ``ids[offsets[i]:offsets[i+1]]`` (no <s>/</s>); ``oov`` counts words mapped to <unk>.

    ``ids`` and ``offsets`` are in-memory arrays for a text file and read-only memory maps for a prepared dataset.
    """

    path: str
    ids: np.ndarray
    offsets: np.ndarray
    oov: int
    text_words: int = -1  # subword pieces as ids: the text's words (for perplexity per word); -1: the ids are words

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

    def reversed(self) -> EncodedCorpus:
        """The corpus read backwards, last sentence first and each sentence last word first (``data.direction =
        backward``): views, nothing copied."""
        return replace(self, ids=self.ids[::-1], offsets=self.offsets[-1] - self.offsets[::-1])


def directed(corpus: EncodedCorpus, direction: str) -> EncodedCorpus:
    """``corpus`` in the order a model of ``data.direction`` reads it."""
    return corpus.reversed() if direction == "backward" else corpus


def encode_file(path: str | Path, vocab: Vocabulary, lowercase: bool = False) -> EncodedCorpus:
    """A text file's ids under ``vocab``, in memory (small files; big ones go through ``lm-train prepare``)."""
    lookup, unk = vocab.index, vocab.unk_id
    ids, lengths = [], []
    for block in text_blocks(path, lowercase):
        part = tokenise_block(block)
        mapping = np.fromiter((lookup.get(k.decode("utf-8"), unk) for k in part.keys), np.int32, len(part.keys))
        ids.append(mapping[part.ids])
        lengths.append(part.lengths)
    array = np.concatenate(ids)
    offsets = np.concatenate(([0], np.cumsum(np.concatenate(lengths))))
    return EncodedCorpus(str(path), array, offsets, int((array == unk).sum()))


def file_fingerprint(path: str | Path) -> dict:
    """What a model was trained on, so that a bundle can say so: path, size and sha256 of the file."""
    digest = hashlib.sha256()
    size = 0
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
            size += len(block)
    return {"path": str(path), "bytes": size, "sha256": digest.hexdigest()}
