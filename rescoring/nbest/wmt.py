"""MT system outputs as k-best lists: a folder in the WMT layout, or plain files, one per system (``read_systems``).

    PREFIX.src.LANG              the source sentences, one a line                 (optional)
    PREFIX.ref.X.LANG            a reference translation, X = A, B, ...           (0 or more)
    PREFIX.hyp.SYSTEM.LANG       one system's translation of each source line    (1 or more)

as WMT ships its test sets (``generaltest2022.zh-en.hyp.JDExploreAcademy.en``); any file may be gzipped (``.gz``).
Every entry of the folder (but hidden ones) must be such a file: a broken link or a folder there is an error naming
it, never a list from the other systems.
Line i of every file is the same segment, entry ``str(i)`` (0-based, as HyPoradise entries are numbered). Systems
agree often (WMT22 zh-en: 12 systems, 10.4 distinct translations a segment), so an entry holds each DISTINCT
translation once, in the order first met going through the systems by name, ranked 1..n. There are no decoder
scores; what the systems say is the features, which every hypothesis carries in full (none is ever missing):

    votes          how many systems produced this exact string (consensus: a strong reranking feature)
    sys_<SYSTEM>   1.0 if that system produced it, else 0.0 (the system's name with characters a feature name may
                   not hold, anything but letters, digits, ``_ . -``, replaced by ``_``: ``sys_Lan-Bridge``)

Strings are compared after stripping the white space around them. ``source`` comes from the src file,
``references`` from the ref files in label order (A, B, ..., Z, AA, ...).

The writer writes the same layout into the folder: PREFIX is the folder's name, the languages the pair it ends with
(``zh-en``, ``generaltest2022.zh-en``), else ``src`` and ``tgt``. Each ``sys_*`` indicator becomes one system's file,
its line i the hypothesis of entry i that system produced, so read -> write -> read gives the same list. Only texts
go into files: ids (positions), ranks and every other feature are not kept (keep a rescored list as JSON Lines). A
list without indicators (not from systems) is written one file per rank, ``PREFIX.hyp.rank1.LANG`` ...: entry i's
k-th hypothesis on line i of rank k's file, its last hypothesis where it has fewer than k.
"""

from __future__ import annotations

import os
import re
import string
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lmserve.rescoring.nbest.files import attach_references, read_text, write_folder
from lmserve.rescoring.nbest.model import Hypothesis, NBestEntry, NBestList
from lmserve.rescoring.nbest.parsing import NBestFormatError, split_lines

NAME = "wmt"
KINDS = ("src", "ref", "hyp")
SYSTEM_FEATURE = "sys_"
NOT_IN_A_NAME = re.compile(r"[^A-Za-z0-9_.-]")  # rescoring.features names: [A-Za-z_][\w.-]*
PAIR = re.compile(r"(?:^|.*[.\-_])([a-z]{2,3})-([a-z]{2,3})")  # a language pair at the end of a folder name
LAYOUT = "PREFIX.src.LANG, PREFIX.ref.X.LANG, PREFIX.hyp.SYSTEM.LANG"


@dataclass(frozen=True)
class WmtFile:
    path: Path
    prefix: str
    kind: str  # src, ref or hyp
    label: str  # the system (hyp) or reference (ref) name; "" for src
    lang: str


def parse_name(path: Path) -> WmtFile | None:
    """A file of the layout, from its name; None for any other name. The first ``.src.``/``.ref.``/``.hyp.`` ends
    the prefix, so that system names may hold dots (``hyp.M2M100_1.2B-B4.en``)."""
    parts = path.name.removesuffix(".gz").split(".")
    kind_at = next((k for k, part in enumerate(parts) if part in KINDS and k > 0), None)
    if kind_at is None:
        return None
    prefix, kind, label, lang = ".".join(parts[:kind_at]), parts[kind_at], parts[kind_at + 1 : -1], parts[-1]
    if len(parts) - kind_at < 2 or (kind == "src") != (not label):
        return None
    return WmtFile(path, prefix, kind, ".".join(label), lang)


def visible_entries(folder: Path) -> list[Path]:
    return sorted(f for f in folder.iterdir() if not f.name.startswith("."))


def visible_files(folder: Path) -> list[Path]:
    return [f for f in visible_entries(folder) if f.is_file()]


def not_a_file(path: Path) -> str | None:
    """What ``path`` is instead of a readable file (a broken link, a folder, ...), None for a file."""
    if path.is_file():
        return None
    if path.is_symlink() and not path.exists():
        return f"a symbolic link to {os.readlink(path)}, which does not exist"
    if path.is_dir():
        return "a folder"
    return "not a regular file" if path.exists() else "missing"


def detect(path: Path) -> bool:
    if not path.is_dir():
        return False
    return any(".hyp." in f.name for f in visible_entries(path))


def read(path: Path, references: list[Path] | None = None) -> NBestList:
    if not path.is_dir():
        raise NBestFormatError(path, f"expected a folder of system outputs ({LAYOUT})")
    entries = visible_entries(path)
    for entry in entries:  # a system whose file cannot be read is an error, never a list of the other systems
        if problem := not_a_file(entry):
            raise NBestFormatError(entry, f"is {problem}; expected only files of the WMT layout here ({LAYOUT})")
    files = entries
    if not files:
        raise NBestFormatError(path, f"is an empty folder; expected system outputs ({LAYOUT})")
    parsed = []
    for file in files:
        wmt_file = parse_name(file)
        if wmt_file is None:
            raise NBestFormatError(file, f"is not a file of the WMT layout; expected a name {LAYOUT}")
        parsed.append(wmt_file)
    first = parsed[0]
    if other := next((f for f in parsed if f.prefix != first.prefix), None):
        raise NBestFormatError(
            path,
            f"holds files of two sets, {first.prefix!r} ({first.path.name}) and {other.prefix!r} "
            f"({other.path.name}); expected one PREFIX (one test set and language pair a folder)",
        )
    by_kind = {kind: [f for f in parsed if f.kind == kind] for kind in KINDS}
    if not by_kind["hyp"]:
        raise NBestFormatError(path, f"holds no PREFIX.hyp.SYSTEM.LANG file; expected one per system ({LAYOUT})")
    if len(by_kind["src"]) > 1:
        raise NBestFormatError(
            path, f"holds two source files, {by_kind['src'][0].path.name} and {by_kind['src'][1].path.name}"
        )
    targets = by_kind["hyp"] + by_kind["ref"]
    if odd := next((f for f in targets if f.lang != targets[0].lang), None):
        raise NBestFormatError(
            odd.path, f"is in language {odd.lang!r}, {targets[0].path.name} in {targets[0].lang!r}; expected one"
        )
    refs = sorted(by_kind["ref"], key=lambda f: (len(f.label), f.label))
    source = by_kind["src"][0].path if by_kind["src"] else None
    systems: dict[str, Path] = {}
    for f in by_kind["hyp"]:
        if f.label in systems:
            raise NBestFormatError(f.path, f"is system {f.label!r} again, after {systems[f.label].name}")
        systems[f.label] = f.path
    nbest = kbest(systems, source, [f.path for f in refs], str(path))
    if references:
        attach_references(nbest.entries, references)
    return nbest


def read_systems(paths: Sequence[Path], source: Path | None = None, references: list[Path] | None = None) -> NBestList:
    """Plain files, one per system, line i of each the same segment: the system's name is the file's name without
    its last suffix (and without ``.gz``): ``out/online-b.en`` is system ``online-b``."""
    if not paths:
        raise ValueError("read_systems: expected at least one system file")
    systems: dict[str, Path] = {}
    for path in map(Path, paths):
        if problem := not_a_file(path):
            raise NBestFormatError(path, f"is {problem}; expected a file of one system's output, one line a segment")
        name = path.name.removesuffix(".gz")
        name = name.rsplit(".", 1)[0] if "." in name.lstrip(".") else name
        if name in systems:
            raise NBestFormatError(path, f"names system {name!r}, as {systems[name]} does; expected one file a system")
        systems[name] = path
    name = os.path.commonpath([str(p) for p in systems.values()])
    return kbest(systems, source, list(references or []), name)


def feature_name(system: str) -> str:
    return SYSTEM_FEATURE + NOT_IN_A_NAME.sub("_", system)


def kbest(systems: dict[str, Path], source: Path | None, references: list[Path], name: str) -> NBestList:
    """What the folder and the plain files share: one line per segment in every file, distinct strings, votes."""
    ordered = sorted(systems)
    features: dict[str, str] = {}  # feature name -> system
    for system in ordered:
        feature = feature_name(system)
        if feature in features:
            raise NBestFormatError(
                systems[system],
                f"system {system!r} and system {features[feature]!r} both become feature {feature!r}; "
                "expected system names that differ in letters, digits, '_', '.' or '-'",
            )
        features[feature] = system
    files = [systems[system] for system in ordered] + ([source] if source else []) + references
    columns = {file: split_lines(read_text(file)) for file in files}  # (UTF-8 without a byte-order mark)
    lengths = {file: len(lines) for file, lines in columns.items()}
    counts = Counter(lengths.values())  # the odd file out is the one blamed: the count most files have is right
    base = next(file for file in files if counts[lengths[file]] == max(counts.values()))
    for file in files:
        if lengths[file] != lengths[base]:
            raise NBestFormatError(
                file,
                f"has {lengths[file]} lines, {base} has {lengths[base]}: expected one line per segment in every file",
                min(lengths[file], lengths[base]) + 1,
            )
    names = list(features)
    entries = []
    for i in range(lengths[base]):
        hyps: dict[str, Hypothesis] = {}
        for feature in names:
            file = systems[features[feature]]
            text = columns[file][i].strip()
            hyp = hyps.get(text)
            if hyp is None:
                hyp = hyps[text] = Hypothesis(text, {"votes": 0.0} | dict.fromkeys(names, 0.0), len(hyps) + 1)
                hyp.origin = f"{file}:{i + 1}"
            hyp.features["votes"] += 1.0
            hyp.features[feature] = 1.0
        entry = NBestEntry(str(i), list(hyps.values()), origin=f"{name}: segment {i} (line {i + 1})")
        entry.references = [columns[ref][i].strip() for ref in references]
        if source is not None:
            entry.source = columns[source][i].strip()
        entries.append(entry)
    return NBestList(entries, name)


def reference_label(k: int) -> str:
    """A, B, ..., Z, AA, AB, ...: the X of ``ref.X``, k from 0."""
    letters = string.ascii_uppercase
    return letters[k] if k < 26 else reference_label(k // 26 - 1) + letters[k % 26]


def system_lines(nbest: NBestList, path: Path) -> dict[str, list[str]]:
    """{system: its line for each entry}, from the ``sys_*`` indicators; {rank1: ..} for a list without them."""
    features = [name for name in nbest.feature_names() if name.startswith(SYSTEM_FEATURE)]
    if not features:
        ranks = max(len(entry.hypotheses) for entry in nbest)
        return {
            f"rank{k}": [entry.hypotheses[min(k, len(entry.hypotheses)) - 1].text for entry in nbest]
            for k in range(1, ranks + 1)
        }
    lines: dict[str, list[str]] = {feature.removeprefix(SYSTEM_FEATURE): [] for feature in features}
    for entry in nbest:
        for k, hyp in enumerate(entry.hypotheses, 1):
            if not any(hyp.features.get(feature) == 1.0 for feature in features):
                raise ValueError(
                    f"{path}: entry {entry.id!r}: hypothesis {k} came from no system (every sys_* feature is 0 or "
                    "missing); the WMT layout holds only the systems' outputs"
                )
        for feature, column in zip(features, lines.values(), strict=True):
            produced = [hyp.text for hyp in entry.hypotheses if hyp.features.get(feature) == 1.0]
            if len(produced) != 1:
                raise ValueError(
                    f"{path}: entry {entry.id!r}: {len(produced)} hypotheses have {feature} = 1; expected exactly "
                    "one (each system translated each segment once)"
                )
            column.append(produced[0])
    return lines


def write(nbest: NBestList, path: Path) -> None:
    if not nbest.entries:
        raise ValueError(f"{path}: no entries to write; the WMT layout needs at least one segment")
    counts = {len(entry.references) for entry in nbest}
    if len(counts) > 1:
        raise ValueError(
            f"{path}: entries have {' and '.join(map(str, sorted(counts)))} references; the WMT layout holds one file "
            "per reference, so every entry needs the same number"
        )
    sources = [entry.source for entry in nbest]
    if None in sources and any(s is not None for s in sources):
        entry = next(e for e in nbest if e.source is None)
        raise ValueError(f"{path}: entry {entry.id!r} has no source, others have; expected all or none")
    pair = PAIR.fullmatch(path.name)
    src_lang, tgt_lang = (pair[1], pair[2]) if pair else ("src", "tgt")
    prefix = path.name
    columns = {f"{prefix}.hyp.{system}.{tgt_lang}": lines for system, lines in system_lines(nbest, path).items()}
    for k in range(counts.pop()):
        columns[f"{prefix}.ref.{reference_label(k)}.{tgt_lang}"] = [entry.references[k] for entry in nbest]
    if sources[0] is not None:
        columns[f"{prefix}.src.{src_lang}"] = sources
    contents = {}
    for file, lines in columns.items():
        if bad := next((line for line in lines if "\n" in line or "\r" in line), None):
            raise ValueError(f"{path}: cannot write {bad!r:.60} on one line of {file}")
        contents[file] = "".join(line + "\n" for line in lines)
    earlier = [f.name for f in visible_files(path) if parse_name(f)] if path.is_dir() else []
    write_folder(path, contents, earlier)
