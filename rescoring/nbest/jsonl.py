"""Our exchange format, JSON Lines, one entry a line (``.jsonl``; read gzipped too, ``.jsonl.gz``); it holds
everything the model does, so round trips are exact:

    {"id": "...", "hypotheses": [{"text": "...", "features": {"name": 1.5}, "rank": 1}], "references": ["..."],
     "source": "...", "document": "..."}

``rank``, ``source`` and ``document`` (the talk, chapter or article of the utterance: ``--context document``) are
written only when set; ``features``, ``references`` may be left out when empty.
"""

from __future__ import annotations

import json
from pathlib import Path

from lmserve.core.atomic import atomic_write_text
from lmserve.core.command import clip
from lmserve.rescoring.nbest.files import attach_references, read_text
from lmserve.rescoring.nbest.model import Hypothesis, NBestEntry, NBestList
from lmserve.rescoring.nbest.parsing import NBestFormatError, json_number, split_lines

NAME = "jsonl"


def detect(path: Path) -> bool:
    return path.is_file() and path.name.endswith((".jsonl", ".jsonl.gz"))  # (read_text reads either)


def read(path: Path, references: list[Path] | None = None) -> NBestList:
    entries = []
    for lineno, line in enumerate(split_lines(read_text(path)), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise NBestFormatError(path, f"column {e.colno}: not valid JSON: {e.msg}", lineno) from None
        entries.append(read_entry(item, path, lineno))
    if references:
        attach_references(entries, references)
    return NBestList(entries, str(path))


def read_entry(item: object, path: Path, lineno: int) -> NBestEntry:
    def expect(ok: bool, field: str, what: str, value: object) -> None:
        if not ok:
            raise NBestFormatError(path, f"expected {what}, got {clip(value)}", lineno, field=field)

    expect(isinstance(item, dict), "(the line)", "an object with 'id' and 'hypotheses'", item)
    entry_id, hyps = item.get("id"), item.get("hypotheses")
    expect(isinstance(entry_id, str), "'id'", "a string", entry_id)
    expect(isinstance(hyps, list), "'hypotheses'", "a list of hypotheses", hyps)
    hypotheses = []
    for k, hyp in enumerate(hyps):
        field = f"hypotheses[{k}]"
        expect(isinstance(hyp, dict) and isinstance(hyp.get("text"), str), f"'{field}'", "an object with 'text'", hyp)
        features, rank = hyp.get("features", {}), hyp.get("rank")
        expect(isinstance(features, dict), f"'{field}.features'", "an object of numbers", features)
        expect(rank is None or type(rank) is int, f"'{field}.rank'", "an integer", rank)
        values = {name: json_number(v, path, lineno, f"'{field}.features.{name}'") for name, v in features.items()}
        hypotheses.append(Hypothesis(hyp["text"], values, rank, f"{path}:{lineno}: field '{field}'"))
    refs, source = item.get("references", []), item.get("source")
    expect(isinstance(refs, list) and all(isinstance(r, str) for r in refs), "'references'", "a list of strings", refs)
    expect(source is None or isinstance(source, str), "'source'", "a string", source)
    document = item.get("document")
    expect(document is None or isinstance(document, str), "'document'", "a string", document)
    return NBestEntry(entry_id, hypotheses, refs, source, document, f"{path}:{lineno}")


def write(nbest: NBestList, path: Path) -> None:
    lines = []
    for entry in nbest:
        hyps = [
            {"text": hyp.text, "features": hyp.features} | ({} if hyp.rank is None else {"rank": hyp.rank})
            for hyp in entry.hypotheses
        ]
        item = {"id": entry.id, "hypotheses": hyps, "references": entry.references}
        if entry.source is not None:
            item["source"] = entry.source
        if entry.document is not None:
            item["document"] = entry.document
        lines.append(json.dumps(item, ensure_ascii=False, allow_nan=False) + "\n")
    atomic_write_text(path, "".join(lines))
