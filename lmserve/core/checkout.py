"""Whether this code runs from a source checkout (the repository, with its ``.cache/`` and ``var/``) or from an
installed package.

Only conveniences of a checkout depend on it: the KenLM programs ``make kenlm`` builds into ``.cache/kenlm/bin``, and
the working directory of the server processes that tests and benchmarks start. An installed package never looks for
files beside itself.
"""

from __future__ import annotations

from pathlib import Path


def source_checkout() -> Path | None:
    """The repository's root when this module is its ``lmserve/core/checkout.py``, else None."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() and (root / "lmserve" / "__init__.py").is_file() else None
