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

import struct
import zlib
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


def encode(state: DecoderState, fingerprint: bytes) -> bytes:
    flags = HAS_NGRAM_CONTEXT if state.ngram_context is not None else 0
    body = b"".join(
        [
            _HEADER.pack(VERSION, fingerprint[:FINGERPRINT_BYTES], flags, state.prev_id),
            np.ascontiguousarray(state.h, dtype="<f4").tobytes(),
            np.ascontiguousarray(state.c, dtype="<f4").tobytes(),
            " ".join(state.ngram_context).encode("utf-8") if state.ngram_context is not None else b"",
        ]
    )
    return body + _CRC.pack(zlib.crc32(body))


def decode(token: bytes, fingerprint: bytes, layers: int, hidden: int, vocab_size: int) -> DecoderState:
    """The state in ``token``, checked against the model that is to continue from it."""
    arrays = 4 * layers * hidden
    if len(token) < _HEADER.size + 2 * arrays + _CRC.size:
        raise StateError(
            f"state: {len(token)} bytes, expected at least {_HEADER.size + 2 * arrays + _CRC.size} for this model "
            "(pass the state of an earlier response unchanged, or an empty state to start a sentence)"
        )
    body, (crc,) = token[: -_CRC.size], _CRC.unpack(token[-_CRC.size :])
    if zlib.crc32(body) != crc:
        raise StateError("state: checksum mismatch (the token was changed or cut; pass it back unchanged)")
    version, mark, flags, prev_id = _HEADER.unpack_from(body)
    if version != VERSION:
        raise StateError(f"state: version {version}, this server reads version {VERSION}")
    if mark != fingerprint[:FINGERPRINT_BYTES]:
        raise OtherModelState(
            f"state: made by another model (fingerprint {mark.hex()}, this model's is "
            f"{fingerprint[:FINGERPRINT_BYTES].hex()}); continue a sentence with the model that started it",
            mark.hex(),
        )
    if flags & ~HAS_NGRAM_CONTEXT:
        raise StateError(f"state: unknown flags {flags:#04x}")
    if prev_id >= vocab_size:
        raise StateError(f"state: previous word id {prev_id} is outside the vocabulary of {vocab_size}")
    start = _HEADER.size
    h = np.frombuffer(body, dtype="<f4", count=layers * hidden, offset=start).reshape(layers, hidden)
    c = np.frombuffer(body, dtype="<f4", count=layers * hidden, offset=start + arrays).reshape(layers, hidden)
    if not (np.isfinite(h).all() and np.isfinite(c).all()):
        raise StateError("state: the LSTM state holds non-finite numbers")
    rest = body[start + 2 * arrays :]
    context = None
    if flags & HAS_NGRAM_CONTEXT:
        try:
            context = tuple(rest.decode("utf-8").split(" ")) if rest else ()
        except UnicodeDecodeError as e:
            raise StateError(f"state: n-gram context is not valid UTF-8 ({e.reason})") from e
    elif rest:
        raise StateError(f"state: {len(rest)} bytes after the LSTM state, expected none")
    return DecoderState(prev_id, h.astype(np.float32), c.astype(np.float32), context)
