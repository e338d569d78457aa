"""The decoder state token: all one next-word step needs, carried by the client so that the service keeps no session
and any replica holding the same model can answer any call.

It holds the LSTM state *before* reading the previous word, that word, and the n-gram context. One step then is one
run of the bundle's ``step`` graph: read the previous word, score the candidates; every candidate's new state is the
graph's output state with the candidate as its previous word, so candidates share the LSTM work. A sentence starts
from the zero state with ``<s>`` as its previous word (the empty token).

Layout, version 1 (little-endian; L layers, H state size)::

    offset   size    field
    0        1       version (1)
    1        8       model fingerprint: the first 8 bytes of ``Scorer.fingerprint`` (sha256 of the bundle's files)
    9        1       flags: bit 0 set when an n-gram context follows the LSTM state
    10       4       previous word id, uint32
    14       4·L·H   h, float32 [L, H]
    14+4LH   4·L·H   c, float32 [L, H]
    14+8LH   n       n-gram context (flag bit 0): at most order − 1 words, UTF-8, separated by single spaces
    end − 4  4       CRC-32 of all bytes before it

The fingerprint rejects a token made by another model; the CRC rejects a damaged one. The token is not signed: a
client that forges one only gets scores of a state it made up.
"""

from __future__ import annotations

import functools
import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

VERSION = 1
FINGERPRINT_BYTES = 8
HAS_NGRAM_CONTEXT = 1
_HEADER = struct.Struct("<B8sBI")  # version, fingerprint, flags, previous word id
_CRC = struct.Struct("<I")


class StateError(ValueError):
    """A state token that this model cannot continue from; the message says why."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class OtherModelState(StateError):
    """A state token made by another model: ``args`` are the message and that model's fingerprint (hex of its first
    bytes), so that a server can tell a state of a model it has since reloaded from a state of a stranger."""

    @property
    def fingerprint(self) -> str:
        return self.args[1]


@dataclass
class DecoderState:
    prev_id: int  # the word the next step reads
    h: np.ndarray  # float32 [L, H], before reading prev_id
    c: np.ndarray
    ngram_context: tuple[str, ...] | None  # None when the model has no n-gram


@functools.cache
def _record(layers: int, hidden: int) -> np.dtype:
    """The fixed-size front of a token (``_HEADER``'s fields, h, c) as one numpy record, so that a batch of states
    packs and unpacks in a few array operations instead of a dozen Python calls per state. (The fingerprint is a
    little-endian integer here, so that a batch compares it in one operation.)"""
    matrix = ("<f4", (layers, hidden))
    return np.dtype(
        [("version", "u1"), ("mark", "<u8"), ("flags", "u1"), ("prev_id", "<u4"), ("h", *matrix), ("c", *matrix)]
    )


def encode(state: DecoderState, fingerprint: bytes) -> bytes:
    return encode_many([state.prev_id], state.h[:, None], state.c[:, None], [state.ngram_context], fingerprint)[0]


def encode_many(
    prev_ids: Sequence[int],
    h: np.ndarray,
    c: np.ndarray,
    contexts: Sequence[tuple[str, ...] | None],
    fingerprint: bytes,
) -> list[bytes]:
    """The tokens of N states: ``prev_ids`` [N], ``h``, ``c`` [L, N, H], an n-gram context (or None) each. Each token
    is one join of its record, its context and its checksum (the checksum runs on over the context instead of over a
    concatenated copy)."""
    layers, _, hidden = h.shape
    records = np.empty(len(contexts), _record(layers, hidden))
    records["version"] = VERSION
    records["mark"] = int.from_bytes(fingerprint[:FINGERPRINT_BYTES], "little")
    records["flags"] = [0 if context is None else HAS_NGRAM_CONTEXT for context in contexts]
    records["prev_id"] = prev_ids
    records["h"] = h.transpose(1, 0, 2)
    records["c"] = c.transpose(1, 0, 2)
    raw, size = memoryview(records.tobytes()), records.itemsize
    crc, pack, tokens = zlib.crc32, _CRC.pack, []
    for i, context in enumerate(contexts):
        body = raw[i * size : (i + 1) * size]
        words = b"" if context is None else " ".join(context).encode("utf-8")
        tokens.append(b"".join((body, words, pack(crc(words, crc(body))))))
    return tokens


def decode(token: bytes, fingerprint: bytes, layers: int, hidden: int, vocab_size: int) -> DecoderState:
    """The state in ``token``, checked against the model that is to continue from it."""
    return _decode_one(token, fingerprint, layers, hidden, vocab_size, "state")


def _decode_one(
    token: bytes, fingerprint: bytes, layers: int, hidden: int, vocab_size: int, where: str
) -> DecoderState:
    """One token, checked field by field: the path of single tokens (a plain ``ScoreNextWords`` call), and the one
    that names what is wrong with a bad token of a batch (``decode_many``). A bad token raises :class:`StateError`
    whose message starts with ``where``."""
    record = _record(layers, hidden)
    mark = fingerprint[:FINGERPRINT_BYTES]
    if len(token) < record.itemsize + _CRC.size:
        raise StateError(
            f"{where}: {len(token)} bytes, expected at least {record.itemsize + _CRC.size} for this model "
            "(pass the state of an earlier response unchanged, or an empty state to start a sentence)"
        )
    if zlib.crc32(memoryview(token)[: -_CRC.size]) != _CRC.unpack_from(token, len(token) - _CRC.size)[0]:
        raise StateError(f"{where}: checksum mismatch (the token was changed or cut; pass it back unchanged)")
    version, theirs, flags, prev_id = _HEADER.unpack_from(token)
    if version != VERSION:
        raise StateError(f"{where}: version {version}, this server reads version {VERSION}")
    if theirs != mark:
        raise OtherModelState(
            f"{where}: made by another model (fingerprint {theirs.hex()}, this model's is {mark.hex()}); "
            "continue a sentence with the model that started it",
            theirs.hex(),
        )
    if flags & ~HAS_NGRAM_CONTEXT:
        raise StateError(f"{where}: unknown flags {flags:#04x}")
    if prev_id >= vocab_size:
        raise StateError(f"{where}: previous word id {prev_id} is outside the vocabulary of {vocab_size}")
    numbers = np.frombuffer(token, "<f4", 2 * layers * hidden, _HEADER.size).reshape(2, layers, hidden)
    if not np.isfinite(numbers).all():
        raise StateError(f"{where}: the LSTM state holds non-finite numbers")
    rest = token[record.itemsize : -_CRC.size]
    context = None
    if flags & HAS_NGRAM_CONTEXT:
        try:
            context = _context(rest)
        except UnicodeDecodeError as e:
            raise StateError(f"{where}: n-gram context is not valid UTF-8 ({e.reason})") from e
    elif rest:
        raise StateError(f"{where}: {len(rest)} bytes after the LSTM state, expected none")
    return DecoderState(prev_id, numbers[0].copy(), numbers[1].copy(), context)


def _context(words: bytes) -> tuple[str, ...]:
    """The n-gram context words of a token (b"": none, KenLM's null context); UnicodeDecodeError if not UTF-8."""
    return tuple(words.decode("utf-8").split(" ")) if words else ()


def decode_many(
    tokens: Sequence[bytes],
    fingerprint: bytes,
    layers: int,
    hidden: int,
    vocab_size: int,
    where: Callable[[int], str] = lambda i: "state",
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[tuple[str, ...] | None]]:
    """The states in ``tokens``, checked against the model that is to continue from them: ``prev_ids`` [N] (int64),
    ``h``, ``c`` [L, N, H] (float32, contiguous) and the n-gram contexts. The checks run over the whole batch in a few
    array operations (per token, Python only slices it, runs its checksum and splits its context); when any fails,
    the tokens are checked one by one in turn (``_decode_one``), so that the :class:`StateError` names the first bad
    token (its message starts with ``where(i)``) and what is wrong with it."""
    record = _record(layers, hidden)
    size, count = record.itemsize, len(tokens)
    lengths = np.fromiter(map(len, tokens), np.int64, count)
    if count and lengths.min() >= size + _CRC.size:
        records = np.frombuffer(b"".join([token[:size] for token in tokens]), record)
        sums = np.frombuffer(b"".join([token[-_CRC.size :] for token in tokens]), "<u4")
        crcs = np.fromiter((zlib.crc32(memoryview(token)[: -_CRC.size]) for token in tokens), np.uint32, count)
        flags = records["flags"]
        good = (
            (crcs == sums).all()
            and (records["version"] == VERSION).all()
            and (records["mark"] == int.from_bytes(fingerprint[:FINGERPRINT_BYTES], "little")).all()
            and (flags <= HAS_NGRAM_CONTEXT).all()
            and (records["prev_id"] < vocab_size).all()
            and np.isfinite(records["h"]).all()
            and np.isfinite(records["c"]).all()
            and ((flags == HAS_NGRAM_CONTEXT) | (lengths == size + _CRC.size)).all()
        )
        if good:
            try:
                contexts = [
                    _context(token[size : -_CRC.size]) if flag else None
                    for token, flag in zip(tokens, flags.tolist(), strict=True)
                ]
            except UnicodeDecodeError:
                good = False
        if good:
            h = np.ascontiguousarray(records["h"].transpose(1, 0, 2))
            c = np.ascontiguousarray(records["c"].transpose(1, 0, 2))
            return records["prev_id"].astype(np.int64), h, c, contexts
    states = [_decode_one(token, fingerprint, layers, hidden, vocab_size, where(i)) for i, token in enumerate(tokens)]
    prev_ids = np.array([s.prev_id for s in states], dtype=np.int64)
    h = np.zeros((layers, count, hidden), np.float32)
    c = np.zeros((layers, count, hidden), np.float32)
    for i, s in enumerate(states):
        h[:, i], c[:, i] = s.h, s.c
    return prev_ids, h, c, [s.ngram_context for s in states]
