"""The bundle's weights: one file shared by every graph, stored in fp32, fp16 or int8 (``lm-train export --weights``).

Each exported graph holds the whole model (the ``sentences``, ``step`` and ``step_full`` graphs share the LSTM and
most of the head), so a bundle used to carry its weights three times: 349 MB for the 30M-parameter 2x1024 English LM.
Here every large initializer of every graph moves to ``weights.bin`` (ONNX external data), written once however many
graphs use it. With ``fp16`` or ``int8`` storage the file holds the narrow tensor and the graph widens it back to
float32 with ``Cast`` (int8: ``Cast`` then ``Mul`` by a per-row scale, symmetric, one scale per vector along the last
axis: a word's embedding, a row of an LSTM gate matrix). ONNX Runtime folds those nodes into float32 constants when
it loads the graph, so the scorer computes in float32 at the speed of an fp32 bundle; only the stored values are
rounded, and export measures what that costs (the manifest's ``heldout.score_ppl`` against ``heldout.ppl``).

Vectors (biases, the adaptive softmax's cluster rows) and small tensors stay float32 under int8 storage, and tiny
ones stay inside the graph: they are a rounding error of the size and most of the rounding error of the scores.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from lmserve.core.bundle import WEIGHT_STORAGES, WEIGHTS_FILE

EXTERNAL_MIN_BYTES = 1024  # smaller initializers stay inside their graph
INT8_MIN_ROWS = 16  # a tensor with fewer vectors than this along its last axis is a bias, not a matrix
ALIGN = 4096  # each tensor starts on a page of weights.bin
FP16_MAX = float(np.finfo(np.float16).max)


def _narrowed(name: str, value: np.ndarray, storage: str) -> tuple[list[np.ndarray], list[str], list]:
    """The stored tensors of one float32 initializer and the nodes that rebuild it under its own name."""
    rows = value.size // value.shape[-1] if value.ndim else 1
    if storage == "int8" and value.ndim >= 2 and rows >= INT8_MIN_ROWS:
        scale = np.abs(value).max(axis=-1, keepdims=True) / 127.0
        scale[scale == 0] = 1.0  # an all-zero row: any scale gives zeros
        stored = np.clip(np.rint(value / scale), -127, 127).astype(np.int8)
        names = [f"{name}.int8", f"{name}.scale"]
        nodes = [
            helper.make_node("Cast", [names[0]], [f"{name}.widened"], to=TensorProto.FLOAT),
            helper.make_node("Mul", [f"{name}.widened", names[1]], [name]),
        ]
        return [stored, scale.astype(np.float32)], names, nodes
    if storage in ("fp16", "int8"):
        peak = float(np.abs(value).max(initial=0.0))
        if peak > FP16_MAX:
            raise ValueError(f"initializer {name!r}: |value| reaches {peak:.3g}, beyond fp16's {FP16_MAX:.0f}")
        half = f"{name}.fp16"
        return [value.astype(np.float16)], [half], [helper.make_node("Cast", [half], [name], to=TensorProto.FLOAT)]
    return [value], [name], []


def _narrow_graph(model: onnx.ModelProto, storage: str) -> None:
    """Replace the graph's large float32 initializers by their stored form and widening nodes (fp16, int8)."""
    graph = model.graph
    kept, widen = [], []
    for init in graph.initializer:
        if init.data_type != TensorProto.FLOAT or storage == "fp32":
            kept.append(init)
            continue
        value = numpy_helper.to_array(init)
        if value.nbytes < EXTERNAL_MIN_BYTES:
            kept.append(init)
            continue
        arrays, names, nodes = _narrowed(init.name, value, storage)
        kept.extend(numpy_helper.from_array(a, n) for a, n in zip(arrays, names, strict=True))
        widen.extend(nodes)
    del graph.initializer[:]
    graph.initializer.extend(kept)
    nodes = [*widen, *graph.node]  # the widening nodes first: the graph's nodes stay topologically sorted
    del graph.node[:]
    graph.node.extend(nodes)


def store_weights(folder: Path, graph_files: list[str], storage: str) -> dict:
    """Rewrite the graphs in ``folder`` so that their large initializers live once in ``weights.bin``, stored as
    ``storage``; return the manifest's ``weights`` field."""
    if storage not in WEIGHT_STORAGES:
        raise ValueError(f"weights storage {storage!r}: expected one of {', '.join(WEIGHT_STORAGES)}")
    offsets: dict[bytes, int] = {}
    with (folder / WEIGHTS_FILE).open("wb") as out:
        for name in graph_files:
            model = onnx.load(str(folder / name))
            _narrow_graph(model, storage)
            for init in model.graph.initializer:
                raw = numpy_helper.to_array(init).tobytes()
                if len(raw) < EXTERNAL_MIN_BYTES:
                    continue
                key = hashlib.sha256(f"{init.data_type}:{list(init.dims)}:".encode() + raw).digest()
                if key not in offsets:
                    out.write(b"\0" * (-out.tell() % ALIGN))
                    offsets[key] = out.tell()
                    out.write(raw)
                init.ClearField("raw_data")
                for field in ("float_data", "int32_data", "int64_data", "double_data"):
                    init.ClearField(field)
                init.data_location = TensorProto.EXTERNAL
                del init.external_data[:]
                for k, v in (("location", WEIGHTS_FILE), ("offset", offsets[key]), ("length", len(raw))):
                    init.external_data.add(key=k, value=str(v))
            onnx.save(model, str(folder / name))
    return {"file": WEIGHTS_FILE, "storage": storage}
