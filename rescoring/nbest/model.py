"""The one in-memory shape every n-best/k-best format is read into and written from.

A hypothesis is text plus named numeric features (whatever the decoder wrote: ``decoder``/``ctc``/``lm`` for ESPnet,
``lm_0``/``tm_pt_*`` for Joshua, ``ac_cost``/``lm_cost`` for Kaldi...). Rescoring adds features and combines them by
name, so the model does not interpret them; each format module documents the names it reads and writes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass
class Hypothesis:
    text: str  # as given (its words: ``core.words``); may be "" (decoders do emit empty hypotheses)
    features: dict[str, float] = field(default_factory=dict)
    rank: int | None = None  # 1-based position in the decoder's list, where the format says so
    origin: str | None = field(default=None, compare=False, repr=False)  # "file:line: field ..." it was read from


@dataclass
class NBestEntry:
    """One utterance (ASR) or source sentence (MT) with its hypotheses, best first as the decoder ranked them."""

    id: str
    hypotheses: list[Hypothesis]
    references: list[str] = field(default_factory=list)  # 0..n: ASR sets have one, the Joshua MT set four
    source: str | None = None  # the source sentence, for MT
    document: str | None = None  # the talk, chapter or article it belongs to, where the list says (JSON Lines)
    origin: str | None = field(default=None, compare=False, repr=False)  # "file:line" it was read from


@dataclass
class NBestList:
    entries: list[NBestEntry]
    name: str = ""  # where it was read from, for messages and reports
    _index: dict[str, NBestEntry] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[NBestEntry]:
        return iter(self.entries)

    @property
    def num_hypotheses(self) -> int:
        return sum(len(entry.hypotheses) for entry in self.entries)

    def feature_names(self) -> list[str]:
        """Every feature name that occurs, in order of first occurrence (lists may be sparse, as Moses' are)."""
        names: dict[str, None] = {}
        for entry in self.entries:
            for hyp in entry.hypotheses:
                names.update(dict.fromkeys(hyp.features))
        return list(names)

    def by_id(self, entry_id: str) -> NBestEntry:
        """The entry with this id (KeyError if none); the index is rebuilt when the entries have changed."""
        entry = self._index.get(entry_id)
        if entry is None or entry.id != entry_id or len(self._index) != len(self.entries):
            self._index = {}
            for e in reversed(self.entries):  # the first of repeated ids wins
                self._index[e.id] = e
            entry = self._index[entry_id]
        return entry
