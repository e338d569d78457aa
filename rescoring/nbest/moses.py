"""Moses/Joshua k-best lists: ``<sentence-id> ||| <hypothesis> ||| <features> ||| <total>``, one hypothesis a line.

Features are read in both styles decoders write: sparse ``name=value`` (Joshua, newer Moses: ``lm_0=-27.184``) and
dense ``name= v1 v2 ...`` or ``name: v1 v2 ...`` (older Moses), whose values become ``name_0``, ``name_1``, ...
The fourth field becomes the feature ``total``; further fields (Moses' word alignments) are ignored. Lists are sparse
(Joshua writes ``OOVPenalty`` only where it is not 0): a feature that some lines have and a line leaves out is 0 there,
as the decoder meant it, and is read as 0. The lines of a
sentence are together, best first. References come from separate files (``references=``): line i of each file is a
reference for sentence id i, as with Joshua's ``reference.en.0`` .. ``reference.en.3``.
"""

from __future__ import annotations

from pathlib import Path

from lmserve.core.atomic import atomic_write_text
from lmserve.core.command import clip
from lmserve.rescoring.nbest.files import attach_references, first_line, read_text
from lmserve.rescoring.nbest.model import Hypothesis, NBestEntry, NBestList
from lmserve.rescoring.nbest.parsing import NBestFormatError, parse_number, split_lines, to_number

NAME = "moses"
FEATURES = "3 (features)"


def detect(path: Path) -> bool:
    return path.is_file() and "|||" in first_line(path)


def parse_features(text: str, path: Path, lineno: int) -> dict[str, float]:
    features: dict[str, float] = {}
    label, index = None, 0  # the dense feature whose values are being read
    for token in text.split():
        name, sep, value = token.partition("=")
        if not sep and token.endswith(":"):
            name, sep = token[:-1], ":"
        if sep and not name:
            raise NBestFormatError(path, f"{clip(token)} has no feature name", lineno, field=FEATURES)
        if sep and not value:
            label, index = name, 0
        elif sep:
            number = to_number(value)
            if number is None:
                raise NBestFormatError(path, f"{clip(token)} is not name=number", lineno, field=FEATURES)
            features[name], label = number, None
        elif label is None:
            raise NBestFormatError(
                path, f"{clip(token)} is neither name=number nor a value after 'name='", lineno, field=FEATURES
            )
        else:
            features[f"{label}_{index}"] = parse_number(token, path, lineno, f"{FEATURES}, value {index} of {label!r}")
            index += 1
    return features


def read(path: Path, references: list[Path] | None = None) -> NBestList:
    entries: list[NBestEntry] = []
    seen: set[int] = set()
    for lineno, line in enumerate(split_lines(read_text(path)), 1):
        if not line.strip():
            continue
        fields = [field.strip() for field in line.split("|||")]
        if len(fields) < 3:
            raise NBestFormatError(
                path, f"expected 'id ||| hypothesis ||| features ||| total', got {len(fields)} field(s)", lineno
            )
        try:
            sentence = int(fields[0])
        except ValueError:
            raise NBestFormatError(
                path, f"expected a sentence number, got {clip(fields[0])}", lineno, field="1 (id)"
            ) from None
        features = parse_features(fields[2], path, lineno)
        if len(fields) > 3:
            features["total"] = parse_number(fields[3], path, lineno, "4 (total)")
        if not entries or entries[-1].id != str(sentence):
            if sentence in seen:
                raise NBestFormatError(
                    path,
                    f"sentence {sentence} appears again after other sentences; expected its lines together",
                    lineno,
                    field="1 (id)",
                )
            seen.add(sentence)
            entries.append(NBestEntry(str(sentence), [], origin=f"{path}:{lineno}"))
        hyps = entries[-1].hypotheses
        hyps.append(Hypothesis(fields[1], features, len(hyps) + 1, f"{path}:{lineno}"))
    names = dict.fromkeys(name for entry in entries for hyp in entry.hypotheses for name in hyp.features)
    for entry in entries:  # sparse by definition: a feature a line leaves out is 0 there
        for hyp in entry.hypotheses:
            if len(hyp.features) != len(names):
                hyp.features = {name: hyp.features.get(name, 0.0) for name in names}
    if references:
        attach_references(entries, references, line_of=lambda i, entry: int(entry.id))
    return NBestList(entries, str(path))


def write(nbest: NBestList, path: Path) -> None:
    """Ids are written as they are when all are sentence numbers, else each entry's position stands in for it."""
    numbered = all(entry.id.isdigit() for entry in nbest)
    lines = []
    for i, entry in enumerate(nbest):
        for hyp in entry.hypotheses:
            bad = [name for name in hyp.features if len(name.split()) != 1 or "=" in name or name.endswith(":")]
            if bad or "|||" in hyp.text:
                raise ValueError(
                    f"{path}: entry {entry.id!r}: cannot write {bad[0] if bad else hyp.text!r} in a Moses k-best line"
                )
            features = " ".join(f"{name}={value!r}" for name, value in hyp.features.items() if name != "total")
            total = f" ||| {hyp.features['total']!r}" if "total" in hyp.features else ""
            lines.append(f"{entry.id if numbered else i} ||| {hyp.text} ||| {features}{total}\n")
    atomic_write_text(path, "".join(lines))
