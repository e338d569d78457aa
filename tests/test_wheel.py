"""The wheel works anywhere: built from this checkout, installed without its dependencies into a fresh virtual
environment (which borrows them from this one, so no network is needed), it brings one top-level package, every module
of the checkout, and ``lm-train``, ``lm-rescore`` and ``lm-serve`` that work from a temporary folder on a small model
trained there. The steps are ``benchmarks/wheel_install.py``'s, which also times them.

About 30 s (a wheel build, a venv, a training run, an export and a server): the one test of the installed package.
"""

from pathlib import Path

from benchmarks.wheel_install import SERVE_STEP, check_import, cli_steps, install, pip_show_top_level, write_inputs
from benchmarks.wheel_install import top_level_packages as top_level
from lmserve.rescoring.ngram import find_program

ROOT = Path(__file__).resolve().parents[1]


def checkout_modules() -> set[str]:
    """Where each module of the checkout belongs in the wheel (pyproject.toml maps each folder, not the links)."""
    own = [*(ROOT / "lmserve").glob("*.py"), *(ROOT / "lmserve" / "v1").glob("*.py")]  # (not through the links)
    modules = {p.relative_to(ROOT).as_posix() for p in own}
    for folder in ("training", "rescoring", "server"):
        modules |= {f"lmserve/{p.relative_to(ROOT).as_posix()}" for p in (ROOT / folder).rglob("*.py")}
    return modules


def test_the_wheel_installs_one_package_whose_commands_work_anywhere(tmp_path):
    target = install(tmp_path)
    assert top_level(target.wheel_names) == {"lmserve"}
    assert pip_show_top_level(target.venv) == ["lmserve"]
    missing = checkout_modules() - set(target.wheel_names)
    assert not missing, f"not in the wheel (list the package in pyproject.toml's [tool.setuptools]): {sorted(missing)}"

    where = check_import(target, tmp_path)  # the wheel's code and metadata, not the checkout's editable install
    assert Path(where["file"]).is_relative_to(target.venv) and Path(where["training"]).is_relative_to(target.venv)
    assert Path(where["metadata"]).is_relative_to(target.venv)

    write_inputs(tmp_path / "cwd")
    steps = cli_steps(target, tmp_path / "cwd", find_program("lmplz").parent)
    failed = {name: step["detail"] for name, step in steps.items() if not step["ok"]}
    assert not failed, failed
    assert SERVE_STEP in steps and steps[SERVE_STEP]["exit_status"] == 0
