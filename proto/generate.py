"""Generate the Python code of the wire contract (``make proto``): ``lmserve/v1/lmserve.proto`` -> ``lmserve/v1``.

The generated files are committed, so nothing needs grpcio-tools at run time; ``tests/test_proto.py`` regenerates them
into a temporary folder and fails when the committed ones differ. The output depends on the protoc inside grpcio-tools,
hence the exact pin in pyproject.toml.

protoc names Python modules after the proto path, so the generated gRPC module imports ``from lmserve.v1 import
lmserve_pb2``: the code lives at that import path, the package ``lmserve.v1``, and is committed exactly as protoc
writes it. Both the client (``lmserve.rescoring.client``) and the server import it from there.

    python proto/generate.py [OUT]      # default OUT: lmserve/v1
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PROTO = "lmserve/v1/lmserve.proto"
DEFAULT_OUT = PROTO_ROOT.parent / "lmserve" / "v1"
GENERATED = ("lmserve_pb2.py", "lmserve_pb2.pyi", "lmserve_pb2_grpc.py")


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
            (out / name).write_bytes((Path(tmp) / Path(PROTO).parent / name).read_bytes())
            written.append(out / name)
    return written


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT):
        print(path)
