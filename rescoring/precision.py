"""The scorer's arithmetic: float32 (the default) or float16 on a GPU (``Scorer(precision="fp16")``).

Why fp16: a bundle's graphs compute in float32 whatever its ``--weights`` store (fp16 and int8 weights are widened
inside the graph), and on a GPU the scorer keeps float32 strict (TF32 off: scores within 1e-4 of the CPU's), which
leaves the tensor cores idle. In float16 the LSTM's and the output layer's products run on them. The bundle is not
changed: onnxruntime's own converter (``onnxruntime.transformers.float16``, which needs the ``onnx`` package) rewrites
each graph as a scorer loads it (:func:`half_graph`). Everything becomes float16 but:

- the graphs' inputs and outputs: states and scores stay float32, so callers, state tokens and lm-serve's clients see
  the same types, and a state made at one precision is read at the other;
- the log-softmax (``FLOAT32_OPS``) and every node after it: the normaliser sums the exponentials of the whole
  shortlist, and the picking and summing of the targets' log-probabilities would round each to float16's step
  (0.008 nats near -12). A score's error is then that of its logit, which the output layer's product rounds to
  float16 (up to 0.004 nats for a logit between 8 and 16) on top of what the LSTM's float16 arithmetic adds.

The price is a bound instead of parity, which only a GPU measures: ``benchmarks/gpu_scorer.py``'s
``fp16_token_max_abs_diff``, held to :data:`TOKEN_BOUND` (tests/test_scorer_gpu.py, the benchmark). The CPU shows
the part that comes from float16 weights (``fp16_rounding.json``, docs/benchmarks/scorer.md: its provider widens
every float16 node and drops the round trips it can). On the CPU fp16 is refused: there it is float32 between casts,
slower.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import onnxruntime as ort

PRECISIONS = ("fp32", "fp16")
# How far a token's score may be from the CPU scorer's float32 one, in nats, for each precision on a GPU: float32 (TF32
# off) is parity; float16's is the stated bound (the tiny test models' worst case; the English LM's shapes: 0.042 on an
# H200, benchmarks/gpu_scorer.py, of which float16 weights alone give 0.012 on the CPU, fp16_rounding.json)
TOKEN_BOUND = {"fp32": 1e-4, "fp16": 0.05}
FLOAT32_OPS = ["LogSoftmax"]
ONNX_FIX = "pip install 'lmserve[gpu]' (it brings onnx, which converts the graphs)"


class PrecisionError(ValueError):
    """A precision the scorer cannot run: unknown, fp16 off the GPU, or fp16 without the ``onnx`` package."""


def check_precision(precision: str, device: str) -> str:
    """``precision`` if a scorer on ``device`` can compute in it, else :class:`PrecisionError` (before any bundle is
    read)."""
    if precision not in PRECISIONS:
        raise PrecisionError(f"precision {precision!r}: expected one of {list(PRECISIONS)}")
    if precision == "fp16" and device != "cuda":
        raise PrecisionError(
            f"precision 'fp16' is for device 'cuda', not {device!r}: onnxruntime's CPU provider has no float16 LSTM "
            "and would compute in float32 between casts, slower than fp32"
        )
    return precision


def half_graph(path: Path) -> bytes:
    """The graph at ``path`` (its weights read from the bundle's ``weights.bin``) rewritten in float16 as the module
    docstring says, serialised for ``onnxruntime.InferenceSession``.

    Its constants are folded first, in float32, by onnxruntime's basic optimisations (the ones that hold for every
    provider): fp16 and int8 weights are widened by nodes of the graph, which in float16 nothing folds (the CPU has
    no float16 kernels to fold them with), so every run would widen them again and the CUDA LSTM, whose weights would
    no longer be constants, would copy them into cuDNN's layout on every call instead of once."""
    try:
        import onnx
        from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16
    except ImportError as e:
        raise PrecisionError(f"precision 'fp16' needs the onnx package ({e}): {ONNX_FIX}") from e
    with tempfile.TemporaryDirectory() as tmp:
        folded = Path(tmp) / path.name
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        options.optimized_model_filepath = str(folded)
        # from memory, weights included, so that the folded file holds them all and points into no weights.bin
        ort.InferenceSession(onnx.load(str(path)).SerializeToString(), options, providers=["CPUExecutionProvider"])
        model = onnx.load(str(folded))
    blocked = [*DEFAULT_OP_BLOCK_LIST, *FLOAT32_OPS]
    kept = from_the_normaliser_on(model)
    half = convert_float_to_float16(model, keep_io_types=True, op_block_list=blocked, node_block_list=kept)
    return without_repeated_nodes(half).SerializeToString()


def without_repeated_nodes(model):
    """``model`` with each node and value_info that repeats an earlier one exactly left out.

    onnxruntime 1.31's converter (in the newest onnxruntime-gpu, 1.31.1) widens a float16 tensor that two float32
    nodes read with two identical Cast nodes, same name and same output, which onnxruntime then refuses to load ("two
    nodes with same node name"); its 1.32 shares one Cast. Found on an H100 (docs/benchmarks/scorer.md). A repeat
    computes what the first did, so leaving it out changes nothing."""
    for field, key in ((model.graph.node, lambda n: n.SerializeToString()), (model.graph.value_info, lambda v: v.name)):
        seen, repeats = set(), []
        for i, item in enumerate(field):
            k = key(item)
            if k in seen:
                repeats.append(i)
            seen.add(k)
        for i in reversed(repeats):
            del field[i]
    return model


def from_the_normaliser_on(model) -> list[str]:
    """Names of the ``FLOAT32_OPS`` nodes and of every node that reads their outputs, directly or not (nameless nodes
    are named here): the picking of each target's log-probability and the sums after it. In float16 a score near -12
    would be rounded to a step of 2^-7, 0.008 nats, whatever the arithmetic before it."""
    for i, node in enumerate(model.graph.node):
        node.name = node.name or f"lmserve_node_{i}"
    readers: dict[str, list] = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    kept, todo = set(), [node for node in model.graph.node if node.op_type in FLOAT32_OPS]
    while todo:
        node = todo.pop()
        if node.name not in kept:
            kept.add(node.name)
            todo += [reader for output in node.output for reader in readers.get(output, [])]
    return sorted(kept)
