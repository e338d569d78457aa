"""HyPoradise's JSON list (Chen et al., 2023): ``[{"input": [hyps, best first], "output": ref, "score": [...]}, ...]``,
plain or gzipped (``.json.gz``, as the HyPoradise files in shared/data are shipped).

Features, one number per hypothesis where the entry has them: ``score`` (HyPoradise's Whisper lists: apparently a
length-normalised log-probability) and ``am_score`` (the ATIS lists: the first pass's score, high to low). An
entry's id is its ``"id"`` (the ATIS lists: ``"i09067ss"``) when every entry has one and no two are the same, else
its index in the list, as a string. ``id``, ``output``, ``score`` and ``am_score`` are optional when reading; the
writer writes them when the list has them (``id`` where some entry's id is not its index) and keeps nothing else
(``input1``/``input2`` of the CHiME-4, TED-LIUM and Switchboard lists are not read). A ``.gz`` name is written
gzipped.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from lmserve.core.atomic import atomic_write_bytes
from lmserve.core.command import clip
from lmserve.rescoring.nbest.files import attach_references, read_text
from lmserve.rescoring.nbest.model import Hypothesis, NBestEntry, NBestList
from lmserve.rescoring.nbest.parsing import NBestFormatError, json_number

NAME = "hyporadise"
SCORES = ("score", "am_score")  # per-hypothesis number lists, read as features of these names
SUFFIXES = (".json", ".json.gz")


def detect(path: Path) -> bool:
    if not (path.is_file() and path.name.endswith(SUFFIXES)):
        return False
    try:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8-sig", errors="replace") as f:  # (a byte-order mark: no text)
            return f.read(64).lstrip().startswith("[")
    except (OSError, EOFError):  # a .gz that is not gzip
        return False


def read(path: Path, references: list[Path] | None = None) -> NBestList:
    try:
        data = json.loads(read_text(path))
    except json.JSONDecodeError as e:
        raise NBestFormatError(path, f"column {e.colno}: not valid JSON: {e.msg}", e.lineno) from None
    if not isinstance(data, list):
        raise NBestFormatError(path, f"expected a JSON list of entries, got {type(data).__name__}")
    entries = [read_entry(item, path, i) for i, item in enumerate(data)]
    ids = [item.get("id") for item in data]
    if None not in ids and len(set(ids)) == len(ids):
        for entry, entry_id in zip(entries, ids, strict=True):
            entry.id = entry_id
    if references:
        attach_references(entries, references)
    return NBestList(entries, str(path))


def read_entry(item: object, path: Path, i: int) -> NBestEntry:
    if not isinstance(item, dict):
        raise NBestFormatError(path, f"expected an object with 'input', got {type(item).__name__}", entry=i)
    texts = item.get("input")
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise NBestFormatError(
            path, f"expected a list of hypothesis strings, got {clip(texts)}", entry=i, field="'input'"
        )
    hyps = [
        Hypothesis(text, {}, rank, f"{path}: entry {i}: field 'input[{rank - 1}]'")
        for rank, text in enumerate(texts, 1)
    ]
    for name in SCORES:
        if name not in item:
            continue
        scores = item[name]
        if not isinstance(scores, list) or len(scores) != len(texts):
            got = f"{len(scores)}" if isinstance(scores, list) else repr(scores)
            raise NBestFormatError(path, f"expected {len(texts)} numbers, got {got}", entry=i, field=f"'{name}'")
        for k, (hyp, score) in enumerate(zip(hyps, scores, strict=True)):
            hyp.features[name] = json_number(score, path, None, f"'{name}[{k}]'", i)
    entry_id = item.get("id")
    if entry_id is not None and not isinstance(entry_id, str):
        raise NBestFormatError(path, f"expected a string, got {clip(entry_id)}", entry=i, field="'id'")
    output = item.get("output")
    if output is not None and not isinstance(output, str):
        raise NBestFormatError(path, f"expected the reference string, got {clip(output)}", entry=i, field="'output'")
    return NBestEntry(str(i), hyps, [] if output is None else [output], origin=f"{path}: entry {i}")


def write(nbest: NBestList, path: Path) -> None:
    with_ids = any(entry.id != str(i) for i, entry in enumerate(nbest))
    items = []
    for entry in nbest:
        if len(entry.references) > 1:
            raise ValueError(
                f"{path}: HyPoradise holds one reference ('output'), entry {entry.id!r} has {len(entry.references)}"
            )
        item: dict = {"id": entry.id} if with_ids else {}
        item["input"] = [hyp.text for hyp in entry.hypotheses]
        if entry.references:
            item["output"] = entry.references[0]
        for name in SCORES:
            if entry.hypotheses and all(name in hyp.features for hyp in entry.hypotheses):
                item[name] = [hyp.features[name] for hyp in entry.hypotheses]
        items.append(item)
    data = (json.dumps(items, indent=2, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")
    atomic_write_bytes(path, gzip.compress(data, mtime=0) if path.suffix == ".gz" else data)
