"""Reading text input one line at a time, as every command does: UTF-8 required, and an error that names the line."""

from __future__ import annotations

from collections.abc import Iterator
from typing import BinaryIO


def iter_lines(stream: BinaryIO, name: str) -> Iterator[str]:
    """Lines of a binary stream as text, one at a time (corpora need not fit in memory); bad UTF-8 is an error naming
    the line."""
    for lineno, raw in enumerate(stream, 1):
        try:
            yield raw.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError as e:
            raise ValueError(f"{name}:{lineno}: not valid UTF-8 ({e.reason} at byte {e.start})") from e


def read_lines(stream: BinaryIO, name: str) -> list[str]:
    return list(iter_lines(stream, name))
