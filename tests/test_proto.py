"""The committed generated code of the wire contract is what ``make proto`` writes from the .proto today."""

import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_generated_code_is_up_to_date(tmp_path):
    generator = runpy.run_path(str(ROOT / "proto" / "generate.py"))
    written = generator["generate"](tmp_path)
    committed = ROOT / "lmserve" / "v1"
    assert [p.name for p in written] == list(generator["GENERATED"])
    for path in written:
        assert path.read_bytes() == (committed / path.name).read_bytes(), (
            f"lmserve/v1/{path.name} is stale: run `make proto` and commit the result"
        )
