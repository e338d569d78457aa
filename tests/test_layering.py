"""The import rules of docs/design.md, read from the source: everything imports ``lmserve.…`` (never the bare folder
names, which would load a second copy of a module); ``lmserve.core`` imports none of the parts; ``training`` imports
only the core; ``rescoring`` imports the core, never ``server``; ``server`` imports the core and the rescoring engine,
never a command-line module of another part; within ``rescoring`` the engine never imports lm-rescore's command layer
(``rescoring/commands/``)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("training", "rescoring", "server", "benchmarks", "tests", "lmserve")
PARTS = ("lmserve.training", "lmserve.rescoring", "lmserve.server")


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


def violations(folder: str, forbidden) -> list[str]:
    """``path:line: module`` for each import in ``folder`` for which ``forbidden(path, module)`` holds."""
    return [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for path in sources(folder)
        for line, name in imports(path)
        if forbidden(path, name)
    ]


def is_command_module(name: str) -> bool:
    """A part's command-line layer: lm-rescore's ``commands``, ``lmserve.<part>.cli`` and ``__main__``."""
    return name.startswith("lmserve.rescoring.commands") or name.split(".")[-1] in ("cli", "__main__")


def test_no_bare_top_level_imports():
    bare = [
        v
        for folder in FOLDERS
        for v in violations(folder, lambda p, n: n.split(".")[0] in ("training", "rescoring", "server", "core"))
    ]
    assert not bare, "import lmserve.<part> instead:\n" + "\n".join(bare)


def test_core_imports_no_part():
    wrong = violations("lmserve/core", lambda p, n: n.startswith(PARTS))
    assert not wrong, "\n".join(wrong)


def test_training_imports_only_the_core():
    wrong = violations("training", lambda p, n: n.startswith(("lmserve.rescoring", "lmserve.server")))
    assert not wrong, "\n".join(wrong)


def test_rescoring_engine_stays_below_its_commands_and_the_server():
    commands = ROOT / "rescoring" / "commands"

    def forbidden(path: Path, name: str) -> bool:
        command_side = commands in path.parents or path.name == "__main__.py"  # python -m lmserve.rescoring
        return name.startswith("lmserve.server") or (not command_side and is_command_module(name))

    wrong = violations("rescoring", forbidden)
    assert not wrong, "\n".join(wrong)


def test_server_imports_no_command_module_of_another_part():
    def forbidden(path: Path, name: str) -> bool:
        return name.startswith("lmserve.training") or (name.startswith("lmserve.rescoring") and is_command_module(name))

    wrong = violations("server", forbidden)
    assert not wrong, "\n".join(wrong)


def test_the_checks_see_a_violation(tmp_path):
    """The rules above read real imports: a module that breaks one is reported."""
    bad = tmp_path / "bad.py"
    bad.write_text("from lmserve.rescoring.commands.cli import main\nimport lmserve.training.cli\n")
    names = [name for _, name in imports(bad)]
    assert [n for n in names if is_command_module(n)] == names
