"""Leakage guard: how much of a test set's references an LM's training text contains verbatim.

A rescoring gain is worthless when the LM has read the test transcripts; the public record of the field has such
gains traced back to LM text that contained them. ``measure`` answers the question the way LibriSpeech's own LM
corpus was filtered: a reference *occurs* in the text when one of its n-word windows (n = 8 by default) appears there
word for word, and the words of a reference that such windows cover are *covered*. Both shares are reported, with
the references that are covered most (the worst offenders) and where in the text their first window was found.

Why it is built this way:

- The text can be of any size (Gutenberg-large is 80 M words): it is read once, in blocks of lines, and only the
  references' windows are kept in memory (a sorted array of their hashes and a dict of the windows themselves), so
  memory is bounded by the references, not by the text.
- Each block's word hashes (Python's string hash) are combined into window hashes with numpy (a polynomial over
  the n words, wrapping in 64 bits), looked up in the sorted reference hashes with ``searchsorted``, and every hit
  is checked word for word, so a hash collision can never count as a match.
- Windows run across line ends within a file (LM text is cut into sentences differently from how utterances are
  cut), never across files.
- Both sides are lower-cased and split on whitespace after an optional ``core.textnorm`` text normaliser each: the
  references usually need the LM's text normaliser (``lm-rescore tune``/``nbest`` pass the one their LMs use), the
  training text is normally in the model's form already.
- References shorter than n words cannot occur; they stay in the denominators (a share of *all* references), and
  their number is reported.

Stock phrases make some overlap normal: on LibriSpeech dev and the Gutenberg training text about 1% of references
share an 8-word window ("he seemed to be thinking of something else"). ``WARN_SHARE`` is set well above that and
well below what any real leak of a test set gives.
"""

from __future__ import annotations

import bisect
import gzip
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from lmserve.core.lines import BOM_BYTES, DAMAGED_GZIP, gzip_problem

DEFAULT_N = 8
# Warn when more than this share of the references has an n-word window in the LM text (module docstring).
WARN_SHARE = 0.05
_BLOCK_BYTES = 1 << 22  # lines read per block: about 4 MB of text
_MULTIPLIER = np.uint64(0x100000001B3)  # FNV's 64-bit prime: any odd multiplier spreads the words' hashes


def words_of(text: str) -> list[str]:
    """The default view of both sides: lower case, split on whitespace."""
    return text.lower().split()


class NoReferences(ValueError):
    """Nothing to measure: no reference has a word (an overlap of 0.00% of 0 would read as "no leak")."""


@dataclass
class Offender:
    reference: int  # index in the references given
    id: str
    text: str
    covered_words: int
    words: int
    windows_found: int  # occurrences of its windows in the text (a window found twice counts twice)
    first_found: str  # "file:line" of the first window found


@dataclass
class Overlap:
    n: int
    references: int
    reference_words: int
    short_references: int  # fewer than n words: cannot occur
    matched_references: int
    covered_words: int
    text_files: list[str]
    text_words: int
    text_lines: int
    seconds: float
    offenders: list[Offender] = field(default_factory=list)

    @property
    def share_references(self) -> float:
        return self.matched_references / self.references if self.references else 0.0

    @property
    def share_words(self) -> float:
        return self.covered_words / self.reference_words if self.reference_words else 0.0

    @property
    def seconds_per_million_words(self) -> float:
        return self.seconds / (self.text_words / 1e6) if self.text_words else 0.0

    def warning(self, threshold: float = WARN_SHARE) -> str | None:
        """A one-line warning when the share of references found exceeds ``threshold``, else None."""
        if self.share_references <= threshold:
            return None
        return (
            f"possible test-set leak: {self.share_references:.1%} of the references ({self.matched_references} of "
            f"{self.references}) and {self.share_words:.1%} of their words occur as {self.n}-word windows in the "
            f"LM training text {', '.join(self.text_files)} (threshold {threshold:.0%})"
        )

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "share_references": self.share_references,
            "share_words": self.share_words,
            "seconds_per_million_words": self.seconds_per_million_words,
        }

    def summary(self) -> str:
        return (
            f"overlap ({self.n}-word windows): {self.share_references:.2%} of {self.references} references "
            f"({self.short_references} shorter than {self.n} words), {self.share_words:.2%} of {self.reference_words} "
            f"reference words; {self.text_words:,} words of LM text in {self.seconds:.1f} s"
        )


def _window_hashes(word_hashes: np.ndarray, n: int) -> np.ndarray:
    """Hash of every n-word window of a sequence of word hashes (uint64 arithmetic wraps, which is what we want)."""
    count = len(word_hashes) - n + 1
    if count <= 0:
        return np.empty(0, dtype=np.uint64)
    h = word_hashes.astype(np.uint64)
    out = h[:count].copy()
    for k in range(1, n):
        out *= _MULTIPLIER
        out ^= h[k : k + count]
    return out


def _hashes(words: Sequence[str]) -> np.ndarray:
    return np.fromiter(map(hash, words), dtype=np.int64, count=len(words))


class _ReferenceWindows:
    """Every n-word window of the references: sorted hashes for the vectorised lookup, the windows themselves for
    the word-for-word check, and per reference which of its windows were found."""

    def __init__(self, references: Sequence[list[str]], n: int):
        self.n = n
        self.where: dict[tuple[str, ...], list[tuple[int, int]]] = {}
        hashes = []
        for r, words in enumerate(references):
            for pos in range(len(words) - n + 1):
                self.where.setdefault(tuple(words[pos : pos + n]), []).append((r, pos))
            hashes.append(_window_hashes(_hashes(words), n))
        self.sorted = np.unique(np.concatenate(hashes)) if hashes else np.empty(0, dtype=np.uint64)
        self.found: dict[tuple[int, int], int] = {}  # (reference, position) -> times found
        self.first: dict[int, str] = {}  # reference -> where its first window was found

    def look_up(self, words: list[str], line_starts: list[int], first_line: int, name: str) -> None:
        if len(self.sorted) == 0:
            return
        windows = _window_hashes(_hashes(words), self.n)
        idx = np.minimum(np.searchsorted(self.sorted, windows), len(self.sorted) - 1)
        for i in np.flatnonzero(self.sorted[idx] == windows).tolist():
            for r, pos in self.where.get(tuple(words[i : i + self.n]), ()):
                self.found[r, pos] = self.found.get((r, pos), 0) + 1
                if r not in self.first:
                    self.first[r] = f"{name}:{first_line + bisect.bisect_right(line_starts, i) - 1}"


def _blocks(path: Path, view: Callable[[str], list[str]]) -> Iterator[tuple[list[str], list[int], int]]:
    """Blocks of a text file (plain or gzipped) as (words, word offset of each line, first line number); a damaged
    .gz is an error naming it, a byte-order mark is no text."""
    with (gzip.open if path.name.endswith(".gz") else open)(path, "rb") as f:
        lineno = 1
        while raws := _read_block(f, path, lineno - 1):
            if lineno == 1 and raws[0].startswith(BOM_BYTES):
                raws[0] = raws[0][len(BOM_BYTES) :]
            words: list[str] = []
            starts: list[int] = []
            for k, raw in enumerate(raws):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ValueError(f"{path}:{lineno + k}: not valid UTF-8 ({e.reason} at byte {e.start})") from e
                starts.append(len(words))
                words.extend(view(line))
            yield words, starts, lineno
            lineno += len(raws)


def _read_block(f, path: Path, lines_read: int) -> list[bytes]:
    try:
        return f.readlines(_BLOCK_BYTES)
    except DAMAGED_GZIP as e:
        raise ValueError(f"{path}: {gzip_problem(e, lines_read)}") from None


def measure(
    references: Sequence[str],
    texts: Sequence[str | Path],
    n: int = DEFAULT_N,
    *,
    ids: Sequence[str] | None = None,
    reference_view: Callable[[str], list[str]] = words_of,
    text_view: Callable[[str], list[str]] = words_of,
    offenders: int = 10,
) -> Overlap:
    """The overlap of ``references`` with the text files ``texts`` (module docstring). ``ids`` name the references
    in the offender list (default: their positions); the views turn a line into words (both are lower-cased)."""
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    start = time.perf_counter()
    paths = [Path(t) for t in texts]
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such LM text file")
    ref_words = [[w.lower() for w in reference_view(r)] for r in references]
    if not any(ref_words):
        raise NoReferences(
            f"no references to check against the LM text: {len(references)} given, none with a word; expected the "
            "references of the test set"
        )
    windows = _ReferenceWindows(ref_words, n)
    text_words = text_lines = 0

    def lowered(line: str) -> list[str]:
        return [w.lower() for w in text_view(line)]

    for path in paths:
        carry: list[str] = []  # the last n - 1 words of the previous block: windows run across blocks
        carry_line = 0  # the line they (approximately: the last of them) come from
        for words, starts, first_line in _blocks(path, lowered):
            text_words += len(words)
            text_lines += len(starts)
            if carry:  # the carried words count as one line before the block's first
                line_starts, first = [0, *(s + len(carry) for s in starts)], carry_line
            else:
                line_starts, first = starts, first_line
            joined = carry + words
            windows.look_up(joined, line_starts, first, str(path))
            carry = joined[-(n - 1) :] if n > 1 else []
            carry_line = first_line + len(starts) - 1
    covered = [set() for _ in ref_words]
    hits = [0] * len(ref_words)
    for (r, pos), times in windows.found.items():
        covered[r].update(range(pos, pos + n))
        hits[r] += times
    matched = [r for r, c in enumerate(covered) if c]
    worst = sorted(matched, key=lambda r: (-len(covered[r]) / len(ref_words[r]), -hits[r], r))[:offenders]
    return Overlap(
        n=n,
        references=len(references),
        reference_words=sum(len(w) for w in ref_words),
        short_references=sum(len(w) < n for w in ref_words),
        matched_references=len(matched),
        covered_words=sum(len(c) for c in covered),
        text_files=[str(p) for p in paths],
        text_words=text_words,
        text_lines=text_lines,
        seconds=time.perf_counter() - start,
        offenders=[
            Offender(
                r,
                ids[r] if ids is not None else str(r),
                references[r],
                len(covered[r]),
                len(ref_words[r]),
                hits[r],
                windows.first[r],
            )
            for r in worst
        ],
    )


def training_texts(manifest: dict) -> list[Path]:
    """The training files a bundle's manifest names (``training.data``, written by ``lm-train export``) that exist on
    this machine with the size recorded there: the text ``lm-rescore tune``/``nbest`` check their references
    against. Files that are missing or have changed are left out."""
    found = []
    for entry in manifest.get("training", {}).get("data", []):
        path = Path(entry.get("path", ""))
        if path.is_file() and path.stat().st_size == entry.get("bytes"):
            found.append(path)
    return found
