"""Kaldi n-best lists as text tables in one folder, as ``lattice-to-nbest | nbest-to-linear`` leave them:

    text      <utt-id>-<n> word1 word2 ...     (n = 1, 2, ...: the rank; the words may be missing)
    ac_cost   <utt-id>-<n> <acoustic cost>
    lm_cost   <utt-id>-<n> <graph/LM cost>
    ref       <utt-id> <reference words>        (optional; ``text.ref`` is read too)

Costs are negated log-likelihoods (smaller is better) and are kept as they are, as the features ``ac_cost`` and
``lm_cost``: no acoustic scale is applied here. Each cost file is optional, but one that is there must have a line
for every hypothesis in ``text``.
"""

from __future__ import annotations

from pathlib import Path

from lmserve.core.command import clip
from lmserve.rescoring.nbest.files import attach_references, read_text, write_folder
from lmserve.rescoring.nbest.model import Hypothesis, NBestEntry, NBestList
from lmserve.rescoring.nbest.parsing import NBestFormatError, parse_number, split_key, split_lines

NAME = "kaldi"
COSTS = ("ac_cost", "lm_cost")
REFERENCE_FILES = ("ref", "text.ref")


def detect(path: Path) -> bool:
    return (path / "text").is_file() and (path / "ac_cost").is_file()


def read_table(path: Path, key_name: str) -> list[tuple[int, str, str]]:
    """(line number, key, rest of the line) of a Kaldi text table."""
    return [(n, *split_key(line, path, n, key_name)) for n, line in enumerate(split_lines(read_text(path)), 1)]


def read(path: Path, references: list[Path] | None = None) -> NBestList:
    entries: dict[str, NBestEntry] = {}
    by_key: dict[str, tuple[int, Hypothesis]] = {}  # hypothesis key -> (its line in text, the hypothesis)
    text_path = path / "text"
    for lineno, key, words in read_table(text_path, "utt-id-rank"):
        utt, _, rank = key.rpartition("-")
        if not utt or not rank.isascii() or not rank.isdigit():
            raise NBestFormatError(text_path, f"expected '<utt-id>-<rank>', got {clip(key)}", lineno, field="1 (key)")
        if key in by_key:
            raise NBestFormatError(
                text_path, f"{clip(key)} appears twice (first on line {by_key[key][0]})", lineno, field="1 (key)"
            )
        hyp = Hypothesis(words, {}, int(rank), f"{text_path}:{lineno}")
        by_key[key] = lineno, hyp
        entries.setdefault(utt, NBestEntry(utt, [], origin=f"{text_path}:{lineno}")).hypotheses.append(hyp)
    for cost in COSTS:
        cost_path = path / cost
        if not cost_path.is_file():
            continue
        for lineno, key, value in read_table(cost_path, "utt-id-rank"):
            if key not in by_key:
                raise NBestFormatError(
                    cost_path, f"{clip(key)} is not a hypothesis in {text_path}", lineno, field="1 (key)"
                )
            by_key[key][1].features[cost] = parse_number(value, cost_path, lineno, "2 (cost)")
        if missing := [(key, lineno) for key, (lineno, hyp) in by_key.items() if cost not in hyp.features]:
            key, lineno = missing[0]
            raise NBestFormatError(text_path, f"{clip(key)} has no line in {cost_path}", lineno, field="1 (key)")
    ordered = list(entries.values())
    for entry in ordered:
        entry.hypotheses.sort(key=lambda hyp: hyp.rank)
    if references:
        attach_references(ordered, references)
    elif ref_path := next((path / name for name in REFERENCE_FILES if (path / name).is_file()), None):
        refs = {key: words for _, key, words in read_table(ref_path, "utt-id")}
        for entry in ordered:
            if entry.id not in refs:
                raise NBestFormatError(ref_path, f"no line for utterance {clip(entry.id)}")
            entry.references = [refs[entry.id]]
    return NBestList(ordered, str(path))


def write(nbest: NBestList, path: Path) -> None:
    """Hypothesis n of an entry (1-based, in list order) is written as ``<id>-<n>``."""
    keyed = [(f"{entry.id}-{n}", hyp) for entry in nbest for n, hyp in enumerate(entry.hypotheses, 1)]
    contents = {"text": "".join(f"{key} {hyp.text}".rstrip() + "\n" for key, hyp in keyed)}
    for cost in COSTS:
        if any(cost in hyp.features for _, hyp in keyed):
            if missing := [key for key, hyp in keyed if cost not in hyp.features]:
                raise ValueError(f"{path}: hypothesis {missing[0]!r} has no {cost!r} feature, others do")
            contents[cost] = "".join(f"{key} {hyp.features[cost]!r}\n" for key, hyp in keyed)
    if any(entry.references for entry in nbest):
        if bad := [entry for entry in nbest if len(entry.references) != 1]:
            raise ValueError(
                f"{path}: 'ref' holds one reference per utterance, {bad[0].id!r} has {len(bad[0].references)}"
            )
        contents["ref"] = "".join(f"{entry.id} {entry.references[0]}\n" for entry in nbest)
    write_folder(path, contents, ["text", *COSTS, *REFERENCE_FILES])
