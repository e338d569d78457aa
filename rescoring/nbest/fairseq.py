"""What ``fairseq-generate`` (and ``fairseq-interactive``) print, read as k-best lists (``--nbest K`` for K > 1):

    S-<i>\\t<source>                  the source sentence (after --remove-bpe/--post-process and detokenisation)
    T-<i>\\t<target>                  the reference, where the data set has one (unknown words as <<unk>>)
    H-<i>\\t<score>\\t<tokens>          a hypothesis as the model's tokens (BPE and all), best first, K of them
    D-<i>\\t<score>\\t<text>            the same hypothesis detokenised
    P-<i>\\t<p1> <p2> ... <eos>        its per-token log-probabilities, base 2 (not read here)

``i`` is the sentence's index in the data set; fairseq prints sentences in batch order (by length), not by ``i``,
so entries are put in order of ``i`` (entry id ``str(i)``, 0-based like fairseq's). Hypotheses come from the
``D-`` lines, or from the ``H-`` lines in output that has no ``D-`` line (older versions). Feature: ``score``, the
number both lines carry: fairseq's hypothesis score converted to base 2, the sum of the token log-probabilities
(end of sentence included) divided by ``length ** --lenpen`` (a length-normalised log-probability, higher is better;
unnormalised with ``--unnormalized``). Everything else is skipped: log lines (``2024-01-01 12:00:00 | INFO |
fairseq_cli.generate | ...``), the closing ``Generate test with beam=5: BLEU4 = ...``, and the ``A-`` (alignment),
``I-`` (steps), ``E-`` (iteration history), ``C-`` (constraints) and ``W-`` (time) lines.

The writer writes ``S-``, ``T-``, ``H-`` and ``D-`` lines (the same text on both: the tokens are not kept); it needs
the ``score`` feature, holds at most one reference and keeps no other feature. Ids are written as they are when all
are sentence numbers, else each entry's position stands in for it, as for Moses.
"""

from __future__ import annotations

import gzip
import re
from pathlib import Path

from lmserve.core.atomic import atomic_write_text
from lmserve.rescoring.nbest.files import attach_references, read_text
from lmserve.rescoring.nbest.model import Hypothesis, NBestEntry, NBestList
from lmserve.rescoring.nbest.parsing import NBestFormatError, parse_number, split_lines

NAME = "fairseq"
LINE = re.compile(r"(?P<kind>[STHDP])-(?P<id>\d+)(?:\t(?P<rest>.*))?")  # the lines read
TAGGED = re.compile(r"[A-Z]-\d+(?:_\d+)?(?:\t|$)")  # any line fairseq tags with a sentence index
DETECT_LINES = 200  # fairseq's log lines before the first sentence (its configuration, the model loading)


def detect(path: Path) -> bool:
    """A file whose first tagged line, past the log lines, is an S-, T-, H- or D- line."""
    if not path.is_file():
        return False
    try:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8-sig", errors="replace") as f:  # (a byte-order mark: no text)
            for _, line in zip(range(DETECT_LINES), f, strict=False):
                if TAGGED.match(line):
                    return line[0] in "STHD"
    except (OSError, EOFError):
        return False
    return False


def read(path: Path, references: list[Path] | None = None) -> NBestList:
    first: dict[int, int] = {}  # i -> the first line of sentence i
    texts: dict[str, dict[int, str]] = {"S": {}, "T": {}}  # the source and the target of each sentence
    hyps: dict[str, dict[int, list[Hypothesis]]] = {"H": {}, "D": {}}
    for lineno, line in enumerate(split_lines(read_text(path)), 1):
        match = LINE.fullmatch(line)
        if match is None:
            if re.match(r"[STHD]-\d+ ", line):
                raise NBestFormatError(path, f"expected a tab after {line.split()[0]!r}, got a space", lineno)
            continue  # a log line, or a line of a kind not read
        kind, i, rest = match["kind"], int(match["id"]), match["rest"] or ""
        first.setdefault(i, lineno)
        if kind in texts:
            if i in texts[kind]:
                raise NBestFormatError(path, f"{kind}-{i} appears again; expected one per sentence", lineno)
            texts[kind][i] = rest.strip()
        elif kind in hyps:
            score, _, text = rest.partition("\t")
            value = parse_number(score, path, lineno, f"2 (score of {kind}-{i})")
            listed = hyps[kind].setdefault(i, [])
            listed.append(Hypothesis(text.strip(), {"score": value}, len(listed) + 1, f"{path}:{lineno}"))
    if hyps["D"]:
        for i in hyps["H"].keys() | hyps["D"].keys():
            h, d = (len(hyps[kind].get(i, [])) for kind in "HD")
            if h and h != d:
                raise NBestFormatError(
                    path, f"sentence {i} has {h} H- lines and {d} D- lines; expected a D- line for each", first[i]
                )
    chosen = hyps["D"] or hyps["H"]
    entries = []
    for i in sorted(first):
        entry = NBestEntry(str(i), chosen.get(i, []), origin=f"{path}:{first[i]}")
        entry.source = texts["S"].get(i)
        entry.references = [texts["T"][i]] if i in texts["T"] else []
        entries.append(entry)
    if references:
        attach_references(entries, references, line_of=lambda k, entry: int(entry.id))
    return NBestList(entries, str(path))


def write(nbest: NBestList, path: Path) -> None:
    numbered = all(entry.id.isascii() and entry.id.isdigit() and str(int(entry.id)) == entry.id for entry in nbest)
    lines = []
    for k, entry in enumerate(nbest):
        i = entry.id if numbered else str(k)
        if len(entry.references) > 1:
            raise ValueError(
                f"{path}: fairseq output holds one reference (T-), entry {entry.id!r} has {len(entry.references)}"
            )
        if entry.source is not None:
            lines.append(f"S-{i}\t{entry.source}\n")
        lines += [f"T-{i}\t{ref}\n" for ref in entry.references]
        for hyp in entry.hypotheses:
            if "score" not in hyp.features:
                raise ValueError(f"{path}: entry {entry.id!r}: fairseq output needs a 'score' feature")
            score = repr(hyp.features["score"])
            lines += [f"H-{i}\t{score}\t{hyp.text}\n", f"D-{i}\t{score}\t{hyp.text}\n"]
        texts = [entry.source or "", *entry.references, *(hyp.text for hyp in entry.hypotheses)]
        if bad := next((text for text in texts if "\n" in text or "\r" in text), None):
            raise ValueError(f"{path}: entry {entry.id!r}: cannot write {bad!r:.60} on one line")
    atomic_write_text(path, "".join(lines))
