"""Write files and folders so that a reader (or a crash) never sees half of one: a temporary beside the target, synced
to disk, then renamed. Every output of ``rescoring`` (rescored lists and folders, reports, weights, score caches) and
of ``training`` (checkpoints, bundles, prepared datasets, curves) goes through here: torch-free, so both sides share
one definition.

Temporaries are named ``.NAME.PID.RANDOM.tmp`` beside ``NAME``. An exception (Ctrl-C included, and SIGTERM, which
the command lines turn into one) removes its own; a process killed outright (``kill -9``) cannot, so every write
first removes those of ``NAME`` whose process is gone: a left-over lives at most until the next run writes there.

A folder is written whole into a temporary folder and renamed into place; an earlier folder there is renamed aside
first and removed after, so that at every moment ``NAME`` is either the old folder, the new one, or absent.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO, TextIO


def check_writable(path: str | Path, what: str, folder: bool = False) -> None:
    """Fail now, not after hours of work, when ``path`` cannot become an output: a file (or, ``folder``, a folder)
    below an existing file, over a folder (a file), over a file (a folder), or in a folder we may not write to.
    ``what`` names the flag in the message."""
    path = Path(path)
    if path.is_dir() and not folder:
        raise IsADirectoryError(f"{what} {path}: is a folder; expected a file name")
    if path.exists() and not path.is_dir() and folder:
        raise NotADirectoryError(
            f"{what} {path}: is a file; this output is a folder (remove it or choose another name)"
        )
    parent = next(p for p in path.absolute().parents if p.exists())
    if not parent.is_dir():
        raise NotADirectoryError(f"{what} {path}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"{what} {path}: cannot write in {parent}")


def _temporary_name(path: Path) -> dict[str, str]:
    return {"dir": str(path.parent), "prefix": f".{path.name}.{os.getpid()}.", "suffix": ".tmp"}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def remove_leftovers(path: str | Path) -> list[Path]:
    """Remove the temporaries of writes of ``path`` by processes that no longer run; returns what was removed."""
    path = Path(path)
    pattern = re.compile(rf"\.{re.escape(path.name)}\.(\d+)\.[^/]*\.tmp")
    removed = []
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for entry in path.parent.iterdir():
            match = pattern.fullmatch(entry.name)
            if match and int(match[1]) != os.getpid() and not _alive(int(match[1])):
                _remove(entry)
                removed.append(entry)
    return removed


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def replacing(path: str | Path, binary: bool = False) -> Iterator[TextIO | BinaryIO]:
    """A text (or ``binary``) file to write that becomes ``path`` only when the block finishes without an exception."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(path)
    fd, tmp = tempfile.mkstemp(**_temporary_name(path))
    try:
        with os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
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


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with replacing(path, binary=True) as f:
        f.write(data)


def atomic_write_lines(path: str | Path, lines: Iterable[str]) -> None:
    """Each line gets a newline; streamed, so big outputs need not fit in memory."""
    with replacing(path) as f:
        for line in lines:
            f.write(line)
            f.write("\n")


@contextlib.contextmanager
def replacing_folder(path: str | Path) -> Iterator[Path]:
    """A folder to fill that becomes ``path`` (replacing a folder there) only when the block finishes without an
    exception."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"{path}: exists and is not a folder; expected a folder to replace, or nothing")
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(path)
    tmp = Path(tempfile.mkdtemp(**_temporary_name(path)))
    aside = None
    try:
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide outputs from other users
        yield tmp
        _sync_files(tmp)
        if path.exists():
            aside = Path(tempfile.mkdtemp(**_temporary_name(path)))
            os.replace(path, aside)  # (over an empty folder: a rename may replace one)
        os.replace(tmp, path)
    except BaseException:
        if aside is not None and not path.exists():
            os.replace(aside, path)  # the old folder back
            aside = None
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)


def _sync_files(folder: Path) -> None:
    """Every file below ``folder`` on disk before the rename that publishes it (a crash then leaves the old folder or
    a whole new one, never a new one with empty files: a checkpoint is read back hours later)."""
    for file in folder.rglob("*"):
        if file.is_file() and not file.is_symlink():
            with open(file, "rb") as f:
                os.fsync(f.fileno())
