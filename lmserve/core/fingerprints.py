"""Which models a weights file was tuned with, by content: recorded by ``lm-rescore tune`` beside their paths
(``setup.fingerprints``) and compared by ``lm-rescore nbest --weights`` before any model loads.

Weights fit the models they were tuned with and no others: a model rebuilt or replaced at the same path (another
bundle exported there, an n-gram built again) gets the old weights without a word, when the weights file names its
models by path only. So the file records each model's fingerprint:

- a neural LM bundle: the sha256 of its ``manifest.json``, which lists the sha256 of every other file of the bundle
  (and the bundle's loader checks them), so it pins the whole bundle at the cost of hashing one small file;
- an n-gram: the size and sha256 of the file given (a KenLM binary or ARPA model, or a mixture file of ``lm-rescore
  ngram mix``, which pins its components by size and sha256 itself). Sizes are compared first: hashing a model of
  gigabytes is left for when they agree.

A mismatch is an error naming the weights file and the model; ``--accept-changed-models`` uses the models anyway,
with a warning. Weights files without fingerprints (written before they were recorded) are not checked.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path

from lmserve.core.bundle import MANIFEST_FILE, sha256_file

MODELS = {"lm": "neural LM bundle", "ngram": "n-gram"}  # the fields of a weights file's "setup" that name models


def fingerprint(name: str, path: str | Path) -> dict | None:
    """The fingerprint of the model ``name`` ("lm" or "ngram") at ``path``; None when there is nothing to read."""
    path = Path(path)
    if name == "lm":
        manifest = path / MANIFEST_FILE
        return {"manifest_sha256": _sha256(manifest)} if manifest.is_file() else None
    return {"bytes": path.stat().st_size, "sha256": _sha256(path)} if path.is_file() else None


def fingerprints(paths: Mapping[str, str | Path | None]) -> dict[str, dict]:
    """The fingerprints of the local models a setup names (``paths``: its "lm" and "ngram"; none for models that a
    server holds, ``paths["server"]``)."""
    if paths.get("server"):
        return {}
    found = {name: fingerprint(name, paths[name]) for name in MODELS if paths.get(name)}
    return {name: value for name, value in found.items() if value is not None}


def check_fingerprints(
    weights: Path, recorded: Mapping[str, dict] | None, paths: Mapping[str, str | Path | None], accept: bool = False
) -> list[str]:
    """Compare the models at ``paths`` with the fingerprints a weights file recorded; raise ``ValueError`` naming the
    file and the first model that differs, or with ``accept`` return a warning for each."""
    warnings = []
    for name, was in (recorded or {}).items():
        path = paths.get(name)
        if name not in MODELS or not path or not Path(path).exists():
            continue  # not used, or missing (which loading reports)
        now = _cheap_first(name, Path(path), was)
        differs = [key for key in was if was[key] != now.get(key)]
        if not differs:
            continue
        field = differs[0]
        problem = (
            f"{weights}: the {MODELS[name]} {path} is not the one these weights were tuned with (field "
            f"'setup.fingerprints.{name}.{field}' is {was[field]!r}, the model's {now.get(field)!r}): changed or "
            "replaced since"
        )
        if not accept:
            raise ValueError(f"{problem}; tune again, or give --accept-changed-models to use it knowingly")
        warnings.append(f"{problem}; used anyway (--accept-changed-models)")
    return warnings


def _cheap_first(name: str, path: Path, was: dict) -> dict:
    """The fingerprint of ``path``, without hashing an n-gram whose size already differs."""
    if name == "ngram" and path.is_file() and path.stat().st_size != was.get("bytes"):
        return {"bytes": path.stat().st_size}
    return fingerprint(name, path) or {}


def _sha256(path: Path) -> str:
    stat = path.stat()
    return _sha256_of(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=16)
def _sha256_of(path: str, size: int, mtime_ns: int) -> str:
    """Once per file version in a process: a tune run records its models in the weights file and in its report."""
    return sha256_file(Path(path))
