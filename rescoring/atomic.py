"""Write files so that a reader (or a crash) never sees half of one: a temporary file beside the target, then rename.

Every output of ``rescoring`` (rescored lists, reports, weights, score caches) goes through here.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TextIO


@contextlib.contextmanager
def replacing(path: str | Path) -> Iterator[TextIO]:
    """A text file to write that becomes ``path`` only when the block finishes without an exception."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            os.fchmod(f.fileno(), 0o644)  # mkstemp's 0600 would hide outputs from other users
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    with replacing(path) as f:
        f.write(text)


def atomic_write_lines(path: str | Path, lines: Iterable[str]) -> None:
    """Each line gets a newline; streamed, so big outputs need not fit in memory."""
    with replacing(path) as f:
        for line in lines:
            f.write(line)
            f.write("\n")
