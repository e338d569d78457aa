"""HyPoradise's JSON list (Chen et al., 2023): ``[{"input": [hyps, best first], "output": ref, "score": [...]}, ...]``.

Entries have no ids; an entry's id is its index in the list, as a string. Feature: ``score``, one number per
hypothesis (HyPoradise's Whisper lists: apparently a length-normalised log-probability). ``output`` and ``score``
are optional when reading; the writer writes them when the list has them and keeps nothing else.
"""

from __future__ import annotations

import json
from pathlib import Path

from lmserve.rescoring.atomic import atomic_write_text
from lmserve.rescoring.nbest.files import attach_references, read_text
from lmserve.rescoring.nbest.model import Hypothesis, NBestEntry, NBestList
from lmserve.rescoring.nbest.parsing import NBestFormatError, json_number

NAME = "hyporadise"


def detect(path: Path) -> bool:
    if not (path.is_file() and path.suffix == ".json"):
        return False
    with path.open(encoding="utf-8", errors="replace") as f:
        return f.read(64).lstrip().startswith("[")


def read(path: Path, references: list[Path] | None = None) -> NBestList:
    try:
        data = json.loads(read_text(path))
    except json.JSONDecodeError as e:
        raise NBestFormatError(path, f"column {e.colno}: not valid JSON: {e.msg}", e.lineno) from None
    if not isinstance(data, list):
        raise NBestFormatError(path, f"expected a JSON list of entries, got {type(data).__name__}")
    entries = [read_entry(item, path, i) for i, item in enumerate(data)]
    if references:
        attach_references(entries, references)
    return NBestList(entries, str(path))


def read_entry(item: object, path: Path, i: int) -> NBestEntry:
    if not isinstance(item, dict):
        raise NBestFormatError(path, f"expected an object with 'input', got {type(item).__name__}", entry=i)
    texts = item.get("input")
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise NBestFormatError(
            path, f"expected a list of hypothesis strings, got {texts!r:.80}", entry=i, field="'input'"
        )
    hyps = [
        Hypothesis(text, {}, rank, f"{path}: entry {i}: field 'input[{rank - 1}]'")
        for rank, text in enumerate(texts, 1)
    ]
    if "score" in item:
        scores = item["score"]
        if not isinstance(scores, list) or len(scores) != len(texts):
            got = f"{len(scores)}" if isinstance(scores, list) else repr(scores)
            raise NBestFormatError(path, f"expected {len(texts)} numbers, got {got}", entry=i, field="'score'")
        for k, (hyp, score) in enumerate(zip(hyps, scores, strict=True)):
            hyp.features["score"] = json_number(score, path, None, f"'score[{k}]'", i)
    output = item.get("output")
    if output is not None and not isinstance(output, str):
        raise NBestFormatError(path, f"expected the reference string, got {output!r:.80}", entry=i, field="'output'")
    return NBestEntry(str(i), hyps, [] if output is None else [output], origin=f"{path}: entry {i}")


def write(nbest: NBestList, path: Path) -> None:
    items = []
    for entry in nbest:
        if len(entry.references) > 1:
            raise ValueError(
                f"{path}: HyPoradise holds one reference ('output'), entry {entry.id!r} has {len(entry.references)}"
            )
        item: dict = {"input": [hyp.text for hyp in entry.hypotheses]}
        if entry.references:
            item["output"] = entry.references[0]
        if entry.hypotheses and all("score" in hyp.features for hyp in entry.hypotheses):
            item["score"] = [hyp.features["score"] for hyp in entry.hypotheses]
        items.append(item)
    atomic_write_text(path, json.dumps(items, indent=2, ensure_ascii=False, allow_nan=False) + "\n")
