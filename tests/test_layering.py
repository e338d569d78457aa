"""The import rules of DESIGN.md, read from the source: everything imports ``lmserve.…`` (never the bare folder
names, which would load a second copy of a module), ``rescoring`` never imports ``server``, and ``training`` takes
from ``rescoring`` only four torch-free pieces: the bundle format it writes, the atomic writes of every output, the
check of its outputs against each other and its inputs (``outputs``) and how a command line ends (``command``); within
``rescoring``, the engine never imports lm-rescore's command layer (``rescoring/commands/``)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("training", "rescoring", "server", "benchmarks", "tests", "lmserve")


def imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def sources(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def test_no_bare_top_level_imports():
    bare = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for folder in FOLDERS
        for path in sources(folder)
        for line, name in imports(path)
        if name.split(".")[0] in ("training", "rescoring", "server")
    ]
    assert not bare, "import lmserve.<part> instead:\n" + "\n".join(bare)


def test_dependencies_point_one_way():
    wrong = []
    commands = ROOT / "rescoring" / "commands"
    for path in sources("rescoring"):
        command_side = commands in path.parents or path.name == "__main__.py"  # python -m lmserve.rescoring
        upward = ("lmserve.server",) if command_side else ("lmserve.server", "lmserve.rescoring.commands")
        wrong += [f"{path.relative_to(ROOT)}:{n}: {m}" for n, m in imports(path) if m.startswith(upward)]
    for path in sources("training"):
        wrong += [
            f"{path.relative_to(ROOT)}:{n}: {m}"
            for n, m in imports(path)
            if m.startswith(("lmserve.server", "lmserve.rescoring"))
            and m
            not in (
                "lmserve.rescoring.bundle",
                "lmserve.rescoring.atomic",
                "lmserve.rescoring.outputs",
                "lmserve.rescoring.command",
            )
        ]
    assert not wrong, "\n".join(wrong)
