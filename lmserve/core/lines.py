"""Reading text input one line at a time, as every command does: UTF-8 required, and an error that names the line.

A UTF-8 byte-order mark (what some Windows editors write first) is not part of the first line: kept, it made the
first word of a file another word, and the first segment of one system's file a translation of its own. A binary
file (a NUL byte) and a damaged ``.gz`` (cut short, or not gzip at all) are errors naming the file, not a traceback.
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

BOM = "\ufeff"
BOM_BYTES = BOM.encode("utf-8")
DAMAGED_GZIP = (EOFError, zlib.error, gzip.BadGzipFile)  # what reading a damaged .gz raises


def gzip_problem(error: BaseException, lines_read: int | None = None) -> str:
    """What a ``DAMAGED_GZIP`` exception says about the file, for a message that names it."""
    after = f" after line {lines_read}" if lines_read else ""
    if isinstance(error, gzip.BadGzipFile):
        return f"not gzip-compressed, though its name ends in .gz ({error}); expected gzipped text or another name"
    if isinstance(error, EOFError):
        return f"cut short{after}: the gzip stream ends before its end marker; expected a whole .gz file"
    return f"damaged gzip data{after} ({type(error).__name__}: {error}); expected a whole .gz file"


def strip_bom(text: str) -> str:
    return text[1:] if text.startswith(BOM) else text


def iter_lines(stream: BinaryIO, name: str) -> Iterator[str]:
    """Lines of a binary stream as text, one at a time (corpora need not fit in memory); bad UTF-8, a NUL byte or a
    damaged gzip stream is an error naming the line (``name``: the file, or the flag and the file)."""
    lineno = 0
    try:
        for lineno, raw in enumerate(stream, 1):
            nul = raw.find(b"\0")
            if nul >= 0:
                raise ValueError(
                    f"{name}:{lineno}: a NUL byte at byte {nul}: a binary file, not text; expected text, one sentence "
                    "a line"
                )
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{name}:{lineno}: not valid UTF-8 ({e.reason} at byte {e.start})") from e
            yield (strip_bom(line) if lineno == 1 else line).rstrip("\r\n")
    except DAMAGED_GZIP as e:
        raise ValueError(f"{name}: {gzip_problem(e, lineno)}") from None


def read_lines(stream: BinaryIO, name: str) -> list[str]:
    return list(iter_lines(stream, name))


def file_lines(path: str | Path, flag: str | None = None) -> Iterator[str]:
    """Lines of a plain or gzipped (``.gz``) text file, with :func:`iter_lines`' errors; ``flag`` (``--heldout``)
    goes before the file's name in them."""
    name = f"{flag} {path}" if flag else str(path)
    with (gzip.open if str(path).endswith(".gz") else open)(path, "rb") as f:
        yield from iter_lines(f, name)
