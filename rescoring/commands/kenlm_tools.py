"""``lm-rescore ngram install-tools --dest DIR``: build KenLM's ``lmplz`` and ``build_binary``, which estimate the
n-grams that the ``kenlm`` Python module only reads.

The programs are compiled from the kenlm source package on PyPI of the version installed here (or a source archive
given with ``--source``), so that they write the binary format this ``kenlm`` module reads. It takes cmake, a C++
compiler and the boost, zlib, bz2 and lzma headers (on Debian: ``apt-get install`` :data:`DEBIAN_PACKAGES`) and
about three minutes on two cores. Then ``LMSERVE_KENLM_BIN=DIR`` (or DIR on PATH) lets ``lm-rescore ngram build``
find them (``rescoring.ngram.find_program``). In a source checkout, ``make kenlm`` runs this into ``.cache/kenlm/bin``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

PROGRAMS = ("lmplz", "build_binary")
DEBIAN_PACKAGES = (
    "cmake",
    "g++",
    "libboost-program-options-dev",
    "libboost-system-dev",
    "libboost-thread-dev",
    "libboost-test-dev",
    "zlib1g-dev",
    "libbz2-dev",
    "liblzma-dev",
)


class ToolsError(OSError):
    """The programs could not be built; the message says which step failed and its last words."""


def install_tools(dest: str | Path, source: str | Path | None = None, jobs: int = 2) -> list[Path]:
    """Build lmplz and build_binary into ``dest`` (created if needed; each program appears whole or not at all)
    from ``source`` (a kenlm source archive; default: downloaded from PyPI by pip); return their paths."""
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if missing:
        raise ToolsError(
            f"building KenLM's programs needs {' and '.join(missing)} (and the boost, zlib, bz2 and lzma headers); "
            f"on Debian: apt-get install {' '.join(DEBIAN_PACKAGES)}"
        )
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="lmserve-kenlm-") as tmp:
        work = Path(tmp)
        archive = Path(source) if source else _download(work / "download")
        with tarfile.open(archive) as tar:
            tar.extractall(work / "src", filter="data")
        roots = [p for p in (work / "src").iterdir() if (p / "CMakeLists.txt").is_file()]
        if len(roots) != 1:
            raise ToolsError(f"{archive}: expected one kenlm source folder with a CMakeLists.txt inside")
        build = work / "build"
        _run(["cmake", "-S", str(roots[0]), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release"], "cmake configure")
        _run(["cmake", "--build", str(build), "--target", *PROGRAMS, f"-j{jobs}"], "cmake build")
        installed = []
        for name in PROGRAMS:
            partial = dest / f".{name}.partial"
            shutil.copy2(build / "bin" / name, partial)
            partial.replace(dest / name)
            installed.append(dest / name)
    return installed


def _download(folder: Path) -> Path:
    """The kenlm source archive of the installed module's version, fetched by pip."""
    version = importlib.metadata.version("kenlm")
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", "kenlm"]
    if importlib.util.find_spec("setuptools"):  # kenlm's build backend: pip need not fetch it (nor cmake) then
        command.append("--no-build-isolation")
    _run([*command, "--dest", str(folder), f"kenlm=={version}"], f"pip download kenlm=={version}")
    archives = sorted(folder.glob("kenlm-*.tar.gz"))
    if not archives:
        raise ToolsError(f"pip download kenlm=={version} left no kenlm-*.tar.gz in {folder}")
    return archives[0]


def _run(command: list[str], step: str) -> None:
    environment = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=environment)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise ToolsError(f"{step} failed (exit {done.returncode}):\n{tail}")
