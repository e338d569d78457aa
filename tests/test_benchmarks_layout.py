"""benchmarks/ keeps measurements: every module there writes its result file (``benchmarks.common.write_result``),
but the shared helpers docs/index.md names, which measure nothing themselves."""

import re

from conftest import ROOT


def helpers() -> set[str]:
    row = next(
        line for line in (ROOT / "docs" / "index.md").read_text().splitlines() if line.startswith("| `benchmarks/`")
    )
    return set(re.findall(r"`(\w+)`", row.split("the modules they share")[1]))


def test_every_benchmark_writes_a_result_and_every_helper_exists():
    modules = {p.stem: p.read_text() for p in (ROOT / "benchmarks").glob("*.py") if p.stem != "__init__"}
    shared = helpers()
    assert shared and shared <= set(modules), sorted(shared - set(modules))
    silent = [name for name, text in modules.items() if name not in shared and "write_result(" not in text]
    assert not silent, f"benchmarks that write no result file (or helpers docs/index.md does not name): {silent}"
    writing = [name for name in shared if re.search(r"^\s+write_result\(", modules[name], re.M)]
    assert not writing, f"helpers that write a result (they are benchmarks): {writing}"
