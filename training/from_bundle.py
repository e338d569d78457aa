"""``lm-train fit CONFIG --init-from BUNDLE``: a model bundle's weights back in the PyTorch model it was exported from.

Release models ship as bundles (``models/``), not as training checkpoints, so adapting one to a domain starts from its
ONNX graphs. The manifest says what the model is (``training.config``: the run's resolved config; ``vocab`` and its
``vocab.tsv``), the model is built from that config as training built it, and every entry of its ``state_dict`` is
taken from an initializer of the graphs:

- a weight the exporter kept under its own name (``model.embedding.weight``, ``model.head.linear.bias``, ...);
- an LSTM layer's weights from the graph's k-th ``LSTM`` node (layer k): ``W``, ``R`` and ``B`` hold PyTorch's
  ``weight_ih``, ``weight_hh`` and ``bias_ih`` + ``bias_hh`` with the gates in ONNX's order (i, o, f, c) instead of
  PyTorch's (i, f, g, o);
- the weight of a linear layer without bias (the adaptive softmax's cluster projections, ``model.projection``), which
  the exporter folds into a transposed ``MatMul`` operand named after no parameter: the ``MatMul`` (or ``Gemm``)
  node of that module (its ONNX scope) gives it;
- parameters that share one tensor (tied embeddings) from whichever of their names maps.

Weights stored as fp16 or int8 in ``weights.bin`` (``training.weight_storage``) are widened as the graph widens them
(``Cast``, then ``Mul`` by the row scales), in float32: the model computes what the bundle computes, and only the
rounding of the storage separates it from the checkpoint it was exported from. A parameter that maps to nothing, or
to a tensor of another shape, is an error naming the bundle and the parameter, never a random weight left in place;
and the rebuilt model is run next to the bundle's ``sentences`` graph on a few sentences before it is used, which
must agree to ``PARITY_TOLERANCE`` per token.

Full and adaptive softmax heads (what the release models use) are supported; other heads are refused by name (a
char-CNN head, for one, is exported as the matrix it computes, not as its CNN), as are dynamically quantised bundles
(``--quantize int8``: integer graphs) and subword vocabularies.

The rebuilt model is written as a checkpoint (``config.json``, ``vocab.tsv``, ``model.safetensors``, and
``bundle.json`` naming the bundle) in a temporary folder that lives as long as the process; from there
``--init-from`` goes on as for a checkpoint (``training.adapt``), and the run records the bundle
(``init_from.bundle`` in ``results.json``). Its first checkpoint, ``ckpt-000-000000``, keeps the initial weights.
"""

from __future__ import annotations

import atexit
import json
import re
import shutil
import tempfile
from pathlib import Path

from lmserve.core.bundle import MANIFEST_FILE, Bundle, BundleError
from lmserve.training.checkpoint import CheckpointError, save_weights
from lmserve.training.config import Config, ConfigError, config_from_dict
from lmserve.training.model import LSTMLM
from lmserve.training.vocab import VocabError, Vocabulary

SUPPORTED_HEADS = ("full", "adaptive")
SOURCE_FILE = "bundle.json"  # in the checkpoint made from a bundle: which bundle, stored how
PARITY_TOLERANCE = 1e-3  # |torch - ONNX| per token: the same float32 weights, only the kernels differ
LSTM_PARAMETER = re.compile(r"lstm\.(weight_ih|weight_hh|bias_ih|bias_hh)_l(\d+)")
ONNX_GATES_AS_TORCH = (0, 2, 3, 1)  # ONNX stacks gates i, o, f, c; PyTorch i, f, g (= c), o


def is_bundle(path: str | Path) -> bool:
    return (Path(path) / MANIFEST_FILE).is_file()


def bundle_source(ckpt: Path) -> str | None:
    """The bundle a checkpoint was rebuilt from (``checkpoint_from_bundle``), None for a trained checkpoint."""
    try:
        return json.loads((ckpt / SOURCE_FILE).read_text(encoding="utf-8"))["bundle"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def checkpoint_from_bundle(path: str | Path) -> Path:
    """The bundle's model as a checkpoint folder, in a temporary folder removed when the process ends."""
    path = Path(path)
    cfg, vocab, model, storage = load_bundle_model(path)
    root = Path(tempfile.mkdtemp(prefix="lm-train-bundle-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    ckpt = root / (path.resolve().name or "bundle")
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    vocab.save(ckpt / "vocab.tsv")
    save_weights(model, ckpt / "model.safetensors")
    (ckpt / SOURCE_FILE).write_text(json.dumps({"bundle": str(path), "weights": storage}, indent=2) + "\n")
    return ckpt


def load_bundle_model(path: str | Path) -> tuple[Config, Vocabulary, LSTMLM, str]:
    """(config, vocabulary, model with the bundle's weights, weight storage) of a bundle (module docstring)."""
    path = Path(path)
    where = f"--init-from {path}"
    try:
        bundle = Bundle.load(path)
    except BundleError as e:
        raise CheckpointError(f"{where}: {e}") from e
    manifest = bundle.manifest
    head = manifest["head"]
    if head not in SUPPORTED_HEADS:
        raise CheckpointError(
            f"{where}: a bundle with a {head!r} head; training can start from bundles with a "
            f"{' or '.join(SUPPORTED_HEADS)} head only: pass the checkpoint it was exported from" + _origin(manifest)
        )
    if manifest.get("quantization"):
        raise CheckpointError(
            f"{where}: a bundle of dynamically quantised graphs ({manifest['quantization']}: lm-train export "
            "--quantize), which do not hold the float weights; export its checkpoint with --weights fp32, fp16 or int8 "
            "instead" + _origin(manifest)
        )
    if manifest["vocab"].get("type", "word") != "word":
        raise CheckpointError(
            f"{where}: a {manifest['vocab']['type']} vocabulary; continuing training is supported for word "
            "vocabularies only"
        )
    raw = (manifest.get("training") or {}).get("config")
    if not isinstance(raw, dict):
        raise CheckpointError(f"{where}: {MANIFEST_FILE} has no training.config (the run's config) to build the model")
    try:
        cfg = config_from_dict(raw, f"{path / MANIFEST_FILE} training.config")
        vocab = Vocabulary.load(path / manifest["vocab"]["file"])
    except (ConfigError, VocabError) as e:
        raise CheckpointError(f"{where}: {e}") from e
    for field, value in manifest["model"].items():
        if getattr(cfg.model, field, value) != value:
            raise CheckpointError(
                f"{where}: {MANIFEST_FILE} model.{field} = {value!r}, but its training.config has model.{field} = "
                f"{getattr(cfg.model, field)!r}"
            )
    if cfg.head.type != head:
        raise CheckpointError(
            f"{where}: {MANIFEST_FILE} head = {head!r}, but its training.config has head.type = {cfg.head.type!r}"
        )
    try:
        model = LSTMLM(len(vocab), cfg.model, cfg.head, vocab.tokens)
    except ValueError as e:
        raise CheckpointError(f"{where}: training.config does not build a model: {e}") from e
    model.load_state_dict(_mapped_state(bundle, model, where))
    model.eval()
    _check_parity(bundle, model, where)
    storage = (manifest.get("weights") or {}).get("storage", "fp32")
    return cfg, vocab, model, storage


def _origin(manifest: dict) -> str:
    origin = (manifest.get("training") or {}).get("checkpoint")
    return f" ({origin})" if origin else ""


class _Graph:
    """One ONNX graph's constants: initializers, and what the widening nodes of fp16/int8 storage make of them."""

    def __init__(self, file: Path):
        import onnx

        try:
            self.proto = onnx.load(str(file))
        except Exception as e:  # protobuf's DecodeError, a missing or short weights.bin: a damaged bundle
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointError(f"{file.name} cannot be read ({first})") from e
        self.file = file
        self.initializers = {init.name: init for init in self.proto.graph.initializer}
        self.producer = {out: node for node in self.proto.graph.node for out in node.output}
        self.nodes = list(self.proto.graph.node)
        self._values: dict[str, object] = {}

    def value(self, name: str):
        """The float32 array ``name`` holds whatever the graph's inputs (None when it depends on them)."""
        import numpy as np
        from onnx import TensorProto, helper, numpy_helper

        if name in self._values:
            return self._values[name]
        value = None
        if name in self.initializers:
            value = numpy_helper.to_array(self.initializers[name])
        elif (node := self.producer.get(name)) is not None:
            attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            if node.op_type == "Constant" and "value" in attributes:
                value = numpy_helper.to_array(attributes["value"])
            elif node.op_type == "Cast" and attributes.get("to") == TensorProto.FLOAT:
                source = self.value(node.input[0])
                value = None if source is None else source.astype(np.float32)
            elif node.op_type == "Mul":  # int8 storage: the widened rows times their scales, in float32 as ORT does
                a, b = self.value(node.input[0]), self.value(node.input[1])
                value = None if a is None or b is None else np.multiply(a, b, dtype=np.float32)
        self._values[name] = value
        return value

    def lstm_nodes(self) -> list:
        return [node for node in self.nodes if node.op_type == "LSTM"]

    def module_weight(self, module: str):
        """The transposed weight operand of the ``MatMul``/``Gemm`` nodes of ``module`` (``model.``-qualified name),
        as PyTorch stores it ([out, in]); None when there is none, an error when there are different ones."""
        found = []
        for node in self.nodes:
            if node.op_type not in ("MatMul", "Gemm") or len(node.input) < 2 or not _in_scope(node.name, module):
                continue
            operand = self.value(node.input[1])
            if operand is None or operand.ndim != 2:
                continue
            trans_b = any(a.name == "transB" and a.i for a in node.attribute)
            found.append(operand if trans_b else operand.T)
        if any(f.shape != found[0].shape or (f != found[0]).any() for f in found[1:]):
            raise CheckpointError(f"{self.file.name}: nodes of {module} multiply by different matrices")
        return found[0] if found else None


def _in_scope(node_name: str, module: str) -> bool:
    """Whether an exported node belongs to ``module``: its ONNX scope (``/model/embedding/Gather``,
    ``/tails.0/tails.0.0/MatMul``: one qualified module name after another, each either a child of the one before or
    its full name) ends with the module's name."""
    scope = ""
    for part in node_name.strip("/").split("/")[:-1]:
        scope = part if not scope or part.startswith(scope + ".") else f"{scope}.{part}"
    return bool(scope) and (module == scope or module.endswith("." + scope))


def _lstm_value(graph: _Graph, kind: str, layer: int, layers: int):
    """PyTorch's ``lstm.{kind}_l{layer}`` from the graph's LSTM node for that layer."""
    import numpy as np

    nodes = graph.lstm_nodes()
    if len(nodes) != layers:
        raise CheckpointError(f"{graph.file.name} has {len(nodes)} LSTM nodes for a model of {layers} layers")
    node = nodes[layer]
    if any(a.name == "direction" and a.s not in (b"forward", b"") for a in node.attribute):
        raise CheckpointError(f"{graph.file.name}: LSTM node {node.name} is not a forward LSTM")
    index = {"weight_ih": 1, "weight_hh": 2, "bias_ih": 3, "bias_hh": 3}[kind]
    if len(node.input) <= index or not node.input[index]:
        return None
    stacked = graph.value(node.input[index])
    if stacked is None or stacked.shape[0] != 1:
        return None
    stacked = stacked[0]
    if kind.startswith("bias"):
        half = stacked.shape[0] // 2
        stacked = stacked[:half] if kind == "bias_ih" else stacked[half:]
    gates = np.split(stacked, 4, axis=0)
    return np.concatenate([gates[g] for g in ONNX_GATES_AS_TORCH], axis=0)


def _value_of(graph: _Graph, name: str, layers: int):
    """``state_dict`` entry ``name`` from one graph, or None."""
    value = graph.value(f"model.{name}")
    if value is None and (match := LSTM_PARAMETER.fullmatch(name)):
        value = _lstm_value(graph, match.group(1), int(match.group(2)), layers)
    if value is None and name.endswith(".weight"):
        value = graph.module_weight(f"model.{name.removesuffix('.weight')}")
    return value


def _mapped_state(bundle: Bundle, model, where: str) -> dict:
    """Every entry of ``model.state_dict()`` from the bundle's graphs (module docstring), or an error naming it."""
    import torch

    layers = model.lstm.num_layers
    state = model.state_dict(keep_vars=True)
    groups: dict[int, list[str]] = {}  # names that share one tensor (tied weights) map together
    for name, tensor in state.items():
        groups.setdefault(id(tensor), []).append(name)
    names = ("sentences", "step_full", "step")  # the first holds the whole model; the others are read if it does not
    graphs: list[_Graph] = []

    def lookup(group: list[str]):
        for graph in graphs:
            for name in group:
                if (value := _value_of(graph, name, layers)) is not None:
                    return value, graph
        return None, None

    mapped = {}
    try:
        for group in groups.values():
            value, graph = lookup(group)
            while value is None and len(graphs) < len(names):
                graphs.append(_Graph(bundle.graph_path(names[len(graphs)])))
                value, graph = lookup(group)
            if value is None:
                why = (
                    " (head.learn_log_z: the learned log Z is folded into the graphs' arithmetic, or left out of "
                    "exact ones)"
                    if group[0].endswith("log_z_offset")
                    else ""
                )
                raise CheckpointError(
                    f"parameter {' = '.join(group)} ({_shape(state[group[0]])}) is in none of the bundle's graphs "
                    f"({', '.join(bundle.manifest['graphs'][n] for n in names)}){why}: its weights cannot be "
                    "rebuilt; pass the checkpoint it was exported from" + _origin(bundle.manifest)
                )
            expected = tuple(state[group[0]].shape)
            if tuple(value.shape) != expected:
                raise CheckpointError(
                    f"parameter {group[0]} is {list(value.shape)} in {graph.file.name}, but the model built from "
                    f"training.config has {list(expected)}"
                )
            for name in group:
                mapped[name] = torch.from_numpy(value.copy()).to(state[name].dtype)
    except CheckpointError as e:
        raise CheckpointError(f"{where}: {e}") from e
    return mapped


def _shape(tensor) -> str:
    return "x".join(map(str, tensor.shape)) or "scalar"


def _check_parity(bundle: Bundle, model, where: str) -> None:
    """The rebuilt model and the bundle's ``sentences`` graph score a few random sentences alike."""
    import numpy as np
    import onnxruntime as ort
    import torch

    from lmserve.training.export import SentencesGraph

    self_normalised = bundle.manifest["normalisation"] != "exact"
    rng = np.random.default_rng(0)
    batch, length = 3, 7
    ids = rng.integers(len(bundle.tokens), size=(batch, length + 1))
    lengths = np.array([length, length - 2, 1])
    zeros = np.zeros((model.lstm.num_layers, batch, model.lstm.hidden_size), dtype=np.float32)
    feed = {"input_ids": ids[:, :-1], "target_ids": ids[:, 1:], "lengths": lengths, "h0": zeros, "c0": zeros}
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(bundle.graph_path("sentences")), options, providers=["CPUExecutionProvider"])
    got = session.run(None, {i.name: feed[i.name] for i in session.get_inputs()})[0]
    with torch.no_grad():
        want = SentencesGraph(model, self_normalised)(*(torch.from_numpy(feed[k]) for k in feed)).numpy()
    worst = float(np.abs(got - want).max())
    if not worst <= PARITY_TOLERANCE:
        raise CheckpointError(
            f"{where}: the model rebuilt from the bundle's weights scores {worst:.2e} per token away from its "
            f"{bundle.manifest['graphs']['sentences']} (tolerance {PARITY_TOLERANCE}): the weights did not map back"
        )
