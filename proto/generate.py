"""Generate the Python code of the wire contract (``make proto``): ``lmserve/v1/lmserve.proto`` -> ``server/lmserve_pb``.

The generated files are committed, so the server runs without grpcio-tools; ``tests/test_proto.py`` regenerates them
into a temporary folder and fails when the committed ones differ. The output depends on the protoc inside grpcio-tools,
hence the exact pin in pyproject.toml.

protoc names Python modules after the proto path, so the gRPC module imports ``from lmserve.v1 import lmserve_pb2``;
that import is rewritten to a relative one, so the package can live under ``server/`` while the proto keeps its
versioned package path (which reflection and grpcurl show).

    python proto/generate.py [OUT]      # default OUT: server/lmserve_pb
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PROTO = "lmserve/v1/lmserve.proto"
DEFAULT_OUT = PROTO_ROOT.parent / "server" / "lmserve_pb"
GENERATED = ("lmserve_pb2.py", "lmserve_pb2.pyi", "lmserve_pb2_grpc.py")
ABSOLUTE_IMPORT = "from lmserve.v1 import lmserve_pb2 as"
RELATIVE_IMPORT = "from . import lmserve_pb2 as"


def generate(out: Path = DEFAULT_OUT) -> list[Path]:
    """Write the generated modules into ``out`` (created if needed); return their paths."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        args = ["protoc", f"-I{PROTO_ROOT}", f"--python_out={tmp}", f"--pyi_out={tmp}", f"--grpc_python_out={tmp}"]
        if protoc.main([*args, str(PROTO_ROOT / PROTO)]) != 0:
            raise RuntimeError(f"protoc failed on {PROTO_ROOT / PROTO} (its message is above)")
        out.mkdir(parents=True, exist_ok=True)
        written = []
        for name in GENERATED:
            text = (Path(tmp) / Path(PROTO).parent / name).read_text(encoding="utf-8")
            if name.endswith("_grpc.py"):
                if ABSOLUTE_IMPORT not in text:
                    raise RuntimeError(f"{name}: protoc no longer writes {ABSOLUTE_IMPORT!r}; update proto/generate.py")
                text = text.replace(ABSOLUTE_IMPORT, RELATIVE_IMPORT)
            (out / name).write_text(text, encoding="utf-8")
            written.append(out / name)
    return written


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT):
        print(path)
