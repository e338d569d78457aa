"""The outputs of a command, checked before any work: each one writable, and apart from every other output and from
everything the command reads. Every command that writes files calls :func:`check_outputs` once (``lm-rescore``,
``lm-train``, ``lm-serve client``).

Outputs are written whole and renamed into place (``core.atomic``), so two outputs at one path leave only the one
written last, and an output at an input's path replaces what was read: ``lm-rescore nbest in.jsonl --out in.jsonl``
replaced the list it reranked, ``--out x.jsonl --report x.jsonl`` kept the report and lost the reranked list, and
``merge --out`` could overwrite a shard's output. Nesting counts as well: a folder output (an ESPnet dump, a bundle)
is replaced whole with whatever lies inside it, and a file written inside an input folder changes that input (a WMT
folder would gain a system).

Paths are compared as the file system sees them: resolved (symbolic links followed, ``..`` gone), and where both
exist by identity (hard links, names that differ only in case on a case-insensitive file system). A clash is an
error naming both flags and both paths.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path

from lmserve.core.atomic import check_writable

PathLike = str | Path
Paths = PathLike | Iterable[PathLike] | None  # one path, several (``--references A B``), or none given


class OutputClash(ValueError):
    """Two outputs, or an output and an input, at one path or one inside the other."""


def check_outputs(
    outputs: Mapping[str, Paths], inputs: Mapping[str, Paths] | None = None, folders: Collection[str] = ()
) -> None:
    """Raise :class:`OutputClash` (or the ``OSError`` of ``atomic.check_writable``) unless every output can be
    written without touching another output or an input.

    ``outputs`` and ``inputs`` map the flag or argument that names each (``"--out"``, ``"LIST"``, ``"--references"``)
    to its path, several paths, or None when it was not given; ``"-"`` (standard input) is no path. ``folders``: the
    names of the outputs that are folders."""
    written = [(name, Path(p)) for name, value in outputs.items() for p in _paths(value)]
    read = [(name, Path(p)) for name, value in (inputs or {}).items() for p in _paths(value)]
    for name, path in written:
        check_writable(path, name, folder=name in folders)
    for i, (name, path) in enumerate(written):
        for other, other_path in written[i + 1 :]:
            clash = _relation(path, other_path)
            if clash:
                raise OutputClash(
                    f"{name} {path} {clash} {other} {other_path}: each output needs a path of its own (the one "
                    "written last would replace the other)"
                )
        for other, other_path in read:
            clash = _relation(path, other_path)
            if clash:
                raise OutputClash(
                    f"{name} {path} {clash} {other} {other_path}, which this command reads: writing it would replace "
                    "or change that input; give the output another path"
                )


def _paths(value: Paths) -> list[PathLike]:
    if value is None:
        return []
    if isinstance(value, str | Path):
        value = [value]
    return [p for p in value if p is not None and str(p) not in ("", "-")]


def _relation(a: Path, b: Path) -> str | None:
    """How ``a`` stands to ``b``: "is" (the same file or folder), "is inside" or "holds"; None when apart."""
    real_a, real_b = a.resolve(), b.resolve()
    if real_a == real_b or (a.exists() and b.exists() and os.path.samefile(a, b)):
        return "is the same path as"
    if real_a.is_relative_to(real_b) or _inside_existing(a, b):
        return "is inside"
    if real_b.is_relative_to(real_a) or _inside_existing(b, a):
        return "holds"
    return None


def _inside_existing(a: Path, folder: Path) -> bool:
    """Whether an existing parent of ``a`` is the folder ``folder`` (by identity: another name for it)."""
    if not folder.is_dir():
        return False
    return any(p.exists() and os.path.samefile(p, folder) for p in a.resolve().parents)
