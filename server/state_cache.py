"""The optional server-side state cache: decoder states kept here under short ids, for clients that would rather not
carry state tokens (a 2x1024 LSTM's token is 16 kB; its id is 16 characters).

A state is kept until it has gone unused for ``ttl`` seconds, until the cache needs its room (least recently used
first: the bound is on the bytes of the states' arrays and contexts plus a fixed overhead each, so it holds whatever
the model's size), or until the client releases it. An id that is no longer here is an error that says which of
those happened (:class:`StateIdError`): a client can act on "evicted: the cache was full" (use tokens, a bigger
cache, fewer hypotheses) differently from "expired" or "made by another server".

Ids begin with a tag of this cache (random per server process), so an id made by another replica, or before a
restart, is recognised as such. The cache lives on the server's event loop: no locks.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from lmserve.rescoring.decoder_state import DecoderState

ENTRY_OVERHEAD = 256  # bytes beyond the arrays and the context: the entry, its key, the state object, the dict slot
GONE_REMEMBERED = 1 << 16  # ids whose fate is remembered, for the error message (about 100 bytes each)
TAG_CHARS = 6


class StateIdError(LookupError):
    """A state id the cache does not hold; the message says why and what to do."""


@dataclass(eq=False)
class _Entry:
    model: str  # the served model's name
    fingerprint: bytes  # of the bundle that made the state
    state: DecoderState
    size: int
    used: float  # clock time of the last put or get


class StateCache:
    def __init__(self, max_bytes: int, ttl: float, clock: Callable[[], float] = time.monotonic):
        self.max_bytes = max_bytes
        self.ttl = ttl
        self.clock = clock
        self.tag = secrets.token_hex(TAG_CHARS // 2)
        self.made = 0  # ids given out; the next is made + 1
        self.entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self.bytes = 0
        self.gone: OrderedDict[str, str] = OrderedDict()  # recently removed ids -> why
        self.evicted = 0  # counts, for metrics and benchmarks
        self.expired = 0

    def __len__(self) -> int:
        return len(self.entries)

    @staticmethod
    def size_of(state: DecoderState) -> int:
        context = sum(len(w) + 1 for w in state.ngram_context or ())
        return state.h.nbytes + state.c.nbytes + context + ENTRY_OVERHEAD

    def put(self, model: str, fingerprint: bytes, state: DecoderState) -> str:
        """Keep ``state`` and return its new id; older states make room if needed. A state bigger than the whole
        cache is an error (a configuration that cannot work)."""
        size = self.size_of(state)
        if size > self.max_bytes:
            raise ValueError(
                f"a state of model {model!r} takes {size} bytes, more than the whole state cache "
                f"({self.max_bytes} bytes): raise [state_cache] max_mb or send state tokens"
            )
        now = self.clock()
        self._expire(now)
        while self.bytes + size > self.max_bytes:
            old_id, old = self.entries.popitem(last=False)
            self.bytes -= old.size
            self.evicted += 1
            why = f"evicted: the state cache was full ({self.max_bytes} bytes; least recently used states go first)"
            self._forget(old_id, why)
        self.made += 1
        state_id = f"{self.tag}{self.made:x}"
        self.entries[state_id] = _Entry(model, fingerprint, state, size, now)
        self.bytes += size
        return state_id

    def get(self, state_id: str) -> _Entry:
        """The entry of ``state_id`` (and it becomes the most recently used), or :class:`StateIdError`."""
        now = self.clock()
        self._expire(now)
        entry = self.entries.get(state_id)
        if entry is None:
            raise StateIdError(f"state id {state_id!r}: {self._why(state_id)}")
        entry.used = now
        self.entries.move_to_end(state_id)
        return entry

    def release(self, ids: Iterable[str]) -> int:
        """Drop the states of ``ids`` (unknown ones are ignored); returns how many were dropped."""
        dropped = 0
        for state_id in ids:
            entry = self.entries.pop(state_id, None)
            if entry is not None:
                self.bytes -= entry.size
                dropped += 1
                self._forget(state_id, "released by the client")
        return dropped

    def clear(self) -> None:
        self.entries.clear()
        self.bytes = 0

    def _expire(self, now: float) -> None:
        while self.entries:
            state_id, entry = next(iter(self.entries.items()))
            if now - entry.used <= self.ttl:
                return
            self.entries.popitem(last=False)
            self.bytes -= entry.size
            self.expired += 1
            self._forget(state_id, f"expired: unused for more than the state cache's ttl of {self.ttl:g} s")

    def _forget(self, state_id: str, why: str) -> None:
        self.gone[state_id] = why
        if len(self.gone) > GONE_REMEMBERED:
            self.gone.popitem(last=False)

    def _why(self, state_id: str) -> str:
        advice = "restart the sentence, or send state tokens (cache_states = false)"
        if state_id in self.gone:
            return f"{self.gone[state_id]}; {advice}"
        if not state_id.startswith(self.tag):
            return (
                "not made by this server process (another replica, or before a restart: cached states live on the "
                f"server that made them; keep one stream per utterance); {advice}"
            )
        try:
            number = int(state_id[len(self.tag) :], 16)
        except ValueError:
            number = 0
        if 0 < number <= self.made:
            return f"no longer in the state cache (evicted or expired some time ago); {advice}"
        return f"never made by this server; {advice}"
