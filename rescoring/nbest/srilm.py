"""SRILM n-best lists (``nbest-format(5)``), one file per utterance, the three variants SRILM's ``NBestHyp::parse`` reads:

    (no header)     <acoustic> <lm> <num-words> w1 w2 ...       SRILM's own: log10 scores
    NBestList1.0    (<score>) w1 w2 ...                          Decipher: one total score, in bytelog
    NBestList2.0    (<score>) w1 ( st: <s> et: <e> g: <lm> a: <acoustic> ) w2 ( ... ) ...

Features, all converted to log10 as SRILM does: own format ``acoustic``, ``lm``, ``num_words``; 1.0 ``score``;
2.0 ``score`` and the per-word ``acoustic`` and ``lm`` (``a:``/``g:``) summed over the words. In 2.0, tokens that
start before the previous word ended (phones) and HMM-state tokens (``...-<digit>``) are skipped, as SRILM skips them.

A path is one file (one entry) or a folder of them, read in name order; an entry's id is its file name without
``.gz`` and ``.score`` (SRILM's ``<utt-id>.score.gz`` convention). The writer writes SRILM's own format, one
``<id>.score`` file per entry; it needs ``acoustic`` and ``lm`` features.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from lmserve.core.command import clip
from lmserve.rescoring.nbest.files import attach_references, first_line, read_text, write_folder
from lmserve.rescoring.nbest.model import Hypothesis, NBestEntry, NBestList
from lmserve.rescoring.nbest.parsing import NBestFormatError, parse_number, split_lines, to_number

NAME = "srilm"
HEADERS = {"NBestList1.0": 1, "NBestList2.0": 2}
BYTELOG_TO_LOG10 = 1024.0 / 10000.5 / math.log(10)
WORD_INFO = ("(", "st:", None, "et:", None, "g:", None, "a:", None, ")")  # None: a number
STATE_TOKEN = re.compile(r".*-\d")


def detect(path: Path) -> bool:
    if path.is_dir():
        files = nbest_files(path)
        return bool(files) and detect(files[0])
    if not path.is_file():
        return False
    line = first_line(path).split()
    own = len(line) >= 3 and to_number(line[0]) is not None and to_number(line[1]) is not None and _count(line[2])
    return own or (bool(line) and line[0] in HEADERS)


def _count(token: str) -> bool:
    """A word count: ASCII digits only (``str.isdigit`` takes '²', which ``float`` does not)."""
    return token.isascii() and token.isdigit()


def nbest_files(folder: Path) -> list[Path]:
    return sorted(f for f in folder.iterdir() if f.is_file() and not f.name.startswith("."))


def entry_id(path: Path) -> str:
    return path.name.removesuffix(".gz").removesuffix(".score")


def read(path: Path, references: list[Path] | None = None) -> NBestList:
    entries = [read_file(file) for file in (nbest_files(path) if path.is_dir() else [path])]
    if references:
        attach_references(entries, references)
    return NBestList(entries, str(path))


def read_file(path: Path) -> NBestEntry:
    lines = split_lines(read_text(path))
    version = HEADERS.get(lines[0].strip(), 0) if lines else 0
    hyps = []
    for lineno, line in enumerate(lines[1:] if version else lines, 2 if version else 1):
        if line.strip():
            hyps.append(parse_hypothesis(line.split(), version, path, lineno))
            hyps[-1].rank, hyps[-1].origin = len(hyps), f"{path}:{lineno}"
    return NBestEntry(entry_id(path), hyps, origin=str(path))


def parse_hypothesis(tokens: list[str], version: int, path: Path, lineno: int) -> Hypothesis:
    if version == 0 and not tokens[0].startswith("("):
        if len(tokens) < 3 or not _count(tokens[2]):
            field, got = ("3 (number of words)", tokens[2]) if len(tokens) >= 3 else ("3", "an end of line")
            raise NBestFormatError(
                path, f"expected '<acoustic> <lm> <num-words> words...', got {clip(got)}", lineno, field=field
            )
        acoustic = parse_number(tokens[0], path, lineno, "1 (acoustic score)")
        lm = parse_number(tokens[1], path, lineno, "2 (LM score)")
        return Hypothesis(" ".join(tokens[3:]), {"acoustic": acoustic, "lm": lm, "num_words": float(tokens[2])})
    if not (tokens[0].startswith("(") and tokens[0].endswith(")")):
        raise NBestFormatError(path, f"expected '(<bytelog score>)', got {clip(tokens[0])}", lineno, field="1 (score)")
    score = parse_number(tokens[0][1:-1], path, lineno, "1 (score)") * BYTELOG_TO_LOG10
    if version != 2:
        return Hypothesis(" ".join(tokens[1:]), {"score": score})
    words, acoustic, lm = parse_word_info(tokens[1:], path, lineno)
    return Hypothesis(" ".join(words), {"score": score, "acoustic": acoustic, "lm": lm})


def parse_word_info(tokens: list[str], path: Path, lineno: int) -> tuple[list[str], float, float]:
    """Words and summed acoustic and LM scores (log10) of ``w ( st: s et: e g: lm a: ac )`` groups."""
    words, acoustic, lm, previous_end = [], 0.0, 0.0, -math.inf
    for k in range(0, len(tokens), 11):
        token, info = tokens[k], tokens[k + 1 : k + 11]
        field = f"{k + 2} (info of {token!r})"
        if len(info) != 10 or any(want is not None and got != want for want, got in zip(WORD_INFO, info, strict=True)):
            raise NBestFormatError(
                path,
                f"expected '{token} ( st: <start> et: <end> g: <lm> a: <acoustic> )', got {clip(' '.join(info))}",
                lineno,
                field=field,
            )
        start, end, g, a = (parse_number(info[i], path, lineno, f"{field} {info[i - 1]!r}") for i in (2, 4, 6, 8))
        if start > previous_end and not STATE_TOKEN.fullmatch(token):
            words.append(token)
            acoustic += a * BYTELOG_TO_LOG10
            lm += g * BYTELOG_TO_LOG10
            previous_end = end
    return words, acoustic, lm


def write(nbest: NBestList, path: Path) -> None:
    """One ``<id>.score`` file per entry in the folder ``path``; ``.score`` files of an earlier write are removed."""
    contents = {}
    for entry in nbest:
        lines = []
        for hyp in entry.hypotheses:
            if missing := [name for name in ("acoustic", "lm") if name not in hyp.features]:
                raise ValueError(f"{path}: entry {entry.id!r}: SRILM's format needs an {missing[0]!r} feature")
            num_words = int(hyp.features.get("num_words", len(hyp.text.split())))
            lines.append(f"{hyp.features['acoustic']!r} {hyp.features['lm']!r} {num_words} {hyp.text}".rstrip() + "\n")
        contents[f"{entry.id}.score"] = "".join(lines)
    write_folder(path, contents, [f.name for f in path.glob("*.score")] if path.is_dir() else [])
