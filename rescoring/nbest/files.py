"""Reading text (gzipped or not), writing folders so that a crash never leaves half of one, and reference files.

Text is UTF-8; a byte-order mark before it is not part of it (``core.lines``: it made the first segment of a system's
file a translation of its own, and the first reference one that no hypothesis matched); a damaged ``.gz`` is an
error naming the file.
"""

from __future__ import annotations

import gzip
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from lmserve.core.atomic import replacing_folder
from lmserve.core.command import clip
from lmserve.core.lines import BOM, DAMAGED_GZIP, gzip_problem
from lmserve.rescoring.nbest.model import NBestEntry
from lmserve.rescoring.nbest.parsing import NBestFormatError, split_lines


def read_text(path: Path) -> str:
    data = path.read_bytes()
    if path.suffix == ".gz":
        try:
            data = gzip.decompress(data)
        except DAMAGED_GZIP as e:
            raise NBestFormatError(path, gzip_problem(e)) from None
    return decode(data, path)


def decode(data: bytes, name: object) -> str:
    """UTF-8 text without a byte-order mark before it."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise NBestFormatError(name, f"expected UTF-8 text, byte {e.start} is not", line) from None
    return text[1:] if text.startswith(BOM) else text


def first_line(path: Path) -> str:
    """The first line of a file, for format detection; "" for a file that cannot be read as text."""
    try:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8-sig", errors="replace") as f:  # (a byte-order mark: no text)
            return f.readline().rstrip("\r\n")
    except (OSError, *DAMAGED_GZIP):
        return ""


def write_folder(path: Path, contents: dict[str, str], layout: Iterable[str]) -> None:
    """Write a folder format's files into a new folder that replaces ``path`` whole (``core.atomic``), so that
    the folder is complete or absent and reading it back gives what was written. A folder already at ``path`` is
    replaced only when it holds nothing but files of the format's ``layout`` (an earlier output): anything else there
    is somebody's, and the write is refused."""
    allowed = set(layout)
    files = sorted(f.relative_to(path).as_posix() for f in path.rglob("*") if not f.is_dir()) if path.is_dir() else []
    if foreign := [name for name in files if name not in allowed]:
        raise ValueError(
            f"{path}: holds {foreign[0]!r}, which is not part of this list format's layout; refusing to replace the "
            "folder (write elsewhere, or remove it)"
        )
    with replacing_folder(path) as tmp:
        for name, text in contents.items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp / name).write_text(text, encoding="utf-8", newline="\n")


def read_references(paths: Sequence[Path]) -> list[list[str]]:
    """Line i of every file is a reference for sentence i; several files give several references per sentence."""
    columns = [split_lines(read_text(path)) for path in paths]
    for path, column in zip(paths[1:], columns[1:], strict=True):
        if len(column) != len(columns[0]):
            raise NBestFormatError(
                path, f"has {len(column)} lines, {paths[0]} has {len(columns[0])}: expected one line per sentence"
            )
    return [[line.strip() for line in refs] for refs in zip(*columns, strict=True)]


def attach_references(
    entries: list[NBestEntry], paths: Sequence[Path], line_of: Callable[[int, NBestEntry], int] | None = None
) -> None:
    """Replace the entries' references with those of ``paths``: line ``line_of(i, entry)`` (default: i) for entry i.

    Without ``line_of`` the files must have exactly one line per entry, so that a reference file for another set
    is not silently taken for this one.
    """
    references = read_references(paths)
    if line_of is None and len(references) != len(entries):
        raise NBestFormatError(paths[0], f"has {len(references)} lines, expected one per n-best entry ({len(entries)})")
    for i, entry in enumerate(entries):
        line = i if line_of is None else line_of(i, entry)
        if not 0 <= line < len(references):
            raise NBestFormatError(
                paths[0], f"has {len(references)} lines, entry {clip(entry.id)} needs line {line + 1}"
            )
        entry.references = references[line]
