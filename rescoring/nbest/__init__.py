"""Hypothesis lists (ASR n-best, MT k-best) in the formats decoders write, all read into one model (``model.py``).

    nbest = read_nbest("dev_other.tar.gz")                     # the format is told from the path
    nbest = read_nbest("output.gold", references=["reference.en.0", "reference.en.1"])
    nbest = read_nbest("wmt22-en/zh-en")                       # a WMT folder: the systems' outputs as k-best lists
    nbest = read_systems(["a.en", "b.en"], source="test.zh")   # the same from plain files, one per system
    write_nbest(nbest, "dev_other.jsonl", "jsonl")

One module per format, each with ``read(path, references)``, ``write(nbest, path)`` and ``detect(path)``; ``FORMATS``
lists them by name, in the order detection tries them. ``references`` (files with one reference a line) replace the
references a format carries itself: line i goes with entry i (Moses, fairseq: with sentence id i). Malformed input
raises ``NBestFormatError`` naming the file, line or entry, and field. Writers replace their files atomically.
"""

from __future__ import annotations

import gzip
import tarfile
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from lmserve.rescoring.nbest import espnet, fairseq, hyporadise, jsonl, kaldi, moses, srilm, wmt
from lmserve.rescoring.nbest.checks import MAX_WORDS, check_list
from lmserve.rescoring.nbest.model import Hypothesis, NBestEntry, NBestList
from lmserve.rescoring.nbest.parsing import NBestFormatError

__all__ = [
    "FOLDER_FORMATS",
    "FORMATS",
    "MAX_WORDS",
    "Hypothesis",
    "NBestEntry",
    "NBestFormat",
    "NBestFormatError",
    "NBestList",
    "detect_format",
    "output_format",
    "read_nbest",
    "read_systems",
    "write_nbest",
]


@dataclass(frozen=True)
class NBestFormat:
    name: str
    read: Callable[[Path, list[Path] | None], NBestList]
    write: Callable[[NBestList, Path], None]
    detect: Callable[[Path], bool]


FORMATS = {
    module.NAME: NBestFormat(module.NAME, module.read, module.write, module.detect)
    for module in (espnet, kaldi, wmt, hyporadise, jsonl, fairseq, moses, srilm)
}  # wmt before srilm, whose folder detection could take a folder of plain lines; fairseq before moses


def detect_format(path: str | Path) -> str:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or folder")
    for name, fmt in FORMATS.items():
        if fmt.detect(path):
            return name
    raise NBestFormatError(
        path, f"cannot tell its n-best format; expected one of {', '.join(FORMATS)}: say which with --format"
    )


FOLDER_FORMATS = ("espnet", "kaldi", "srilm", "wmt")  # written as folders (SRILM: one file per entry)
SUFFIX_FORMATS = {".jsonl": "jsonl", ".json": "hyporadise", ".json.gz": "hyporadise"}  # names that say their format


def output_format(path: str | Path, format: str | None = None) -> str:
    """The format to write ``path`` in: the one its name says (``SUFFIX_FORMATS``) or ``format`` (an
    ``--out-format``), which must agree when both are there; an error when neither is (the input's format is no
    guide: an ESPnet folder named ``out.jsonl`` is what that gave)."""
    implied = next((name for suffix, name in SUFFIX_FORMATS.items() if Path(path).name.endswith(suffix)), None)
    if format is not None:
        lookup(format)
        if implied is not None and implied != format:
            raise ValueError(
                f"--out {path}: the name says {implied}, --out-format says {format}; use a name that fits the format"
            )
        return format
    if implied is None:
        names = ", ".join(f"{suffix} for {name}" for suffix, name in SUFFIX_FORMATS.items())
        raise ValueError(
            f"--out {path}: cannot tell the output format from the name ({names}); give --out-format, one of "
            f"{', '.join(FORMATS)}"
        )
    return implied


def lookup(format: str) -> NBestFormat:
    if format not in FORMATS:
        raise ValueError(f"unknown n-best format {format!r}; expected one of {', '.join(FORMATS)}")
    return FORMATS[format]


# what a damaged file raises from the libraries the readers use (a truncated gzip stream or tarball, a JSON document
# nested too deeply): turned into an error that names the file
DAMAGED = (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile, RecursionError, NotADirectoryError)


def read_nbest(
    path: str | Path,
    format: str | None = None,
    references: str | Path | Sequence[str | Path] | None = None,
    *,
    feature_defaults: Mapping[str, float] | None = None,
    max_words: int = MAX_WORDS,
) -> NBestList:
    """Read and check (``checks.check_list``: ``feature_defaults`` fill in features a hypothesis lacks)."""
    path = Path(path)
    if isinstance(references, str | Path):
        references = [references]
    format = format or detect_format(path)
    try:
        nbest = lookup(format).read(path, [Path(r) for r in references or []] or None)
    except DAMAGED as e:
        raise NBestFormatError(path, f"cannot be read as a {format} list: {type(e).__name__}: {e}") from None
    check_list(nbest, feature_defaults, max_words)
    return nbest


def write_nbest(nbest: NBestList, path: str | Path, format: str) -> None:
    lookup(format).write(nbest, Path(path))


def read_systems(
    paths: Sequence[str | Path],
    source: str | Path | None = None,
    references: str | Path | Sequence[str | Path] | None = None,
    *,
    feature_defaults: Mapping[str, float] | None = None,
    max_words: int = MAX_WORDS,
) -> NBestList:
    """MT outputs in plain files, one per system (line i of each the same segment), as k-best lists of their distinct
    translations (``wmt.read_systems``: features ``votes`` and ``sys_<SYSTEM>``), checked as ``read_nbest`` checks."""
    if isinstance(references, str | Path):
        references = [references]
    paths = [Path(p) for p in paths]
    nbest = wmt.read_systems(paths, None if source is None else Path(source), [Path(r) for r in references or []])
    check_list(nbest, feature_defaults, max_words)
    return nbest
