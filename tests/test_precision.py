"""The scorer in float16 (``Scorer(precision="fp16")``, ``--precision``, ``models.NAME.precision``).

fp16 runs on the GPU only, so here: the converted graphs themselves (float16 inside, float32 in and out and at the
log-softmax, scores within the tiny models' bound of float32's; the CPU provider widens each float16 node, so this is
the rounding of weights and activations, not float16 arithmetic), and every way of asking for fp16 off the GPU refused
before any work. The GPU's own parity is in tests/test_scorer_gpu.py."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import sentence_batch
from onnxruntime.capi.onnxruntime_pybind11_state import Fail

from lmserve.rescoring.commands.cli import main as rescore_main
from lmserve.rescoring.precision import FLOAT32_OPS, TOKEN_BOUND, PrecisionError, half_graph, without_repeated_nodes
from lmserve.rescoring.scorer import Scorer
from lmserve.server.config import ConfigError, load_config
from lmserve.server.models import ModelSet

SENTENCES = [[5, 9, 3, 14], [7], [], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32]]


def element_types(model: onnx.ModelProto) -> dict[str, int]:
    inferred = onnx.shape_inference.infer_shapes(model).graph
    typed = [*inferred.value_info, *inferred.input, *inferred.output]
    types = {v.name: v.type.tensor_type.elem_type for v in typed}
    return types | {t.name: t.data_type for t in model.graph.initializer}


@pytest.mark.parametrize("head", ["full", "adaptive"])
def test_the_half_graph_is_float16_inside_float32_outside_and_close(bundles, head):
    scorer = Scorer(bundles[(head, 0.0)][1], threads=1)
    path = scorer.bundle.graph_path("sentences")
    half = half_graph(path)
    model = onnx.load_from_string(half)
    types = element_types(model)
    float32, float16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16
    assert {v.name: types[v.name] for v in model.graph.output} == {"logprobs": float32}
    assert types["h0"] == types["c0"] == float32
    products = [n for n in model.graph.node if n.op_type in ("LSTM", "Gemm", "MatMul")]
    assert products and all(types[n.output[0]] == float16 for n in products)
    normalisers = [n for n in model.graph.node if n.op_type in FLOAT32_OPS]
    assert normalisers and all(types[n.input[0]] == types[n.output[0]] == float32 for n in normalisers)
    picks = [n for n in model.graph.node if n.op_type == "GatherElements"]  # a target's log-probability, after them
    assert picks and all(types[n.output[0]] == float32 for n in picks)

    inputs, targets, lengths = sentence_batch(SENTENCES)
    state = np.zeros((scorer.layers, len(SENTENCES), scorer.state_size), dtype=np.float32)
    feed = {"input_ids": inputs, "target_ids": targets, "lengths": lengths, "h0": state, "c0": state}
    want = scorer.sessions["sentences"].run(None, feed)[0]
    got = ort.InferenceSession(half, providers=["CPUExecutionProvider"]).run(None, feed)[0]
    assert got.dtype == np.float32
    mask = np.arange(inputs.shape[1])[None, :] < lengths[:, None]
    diff = np.abs(got - want)[mask]
    assert 0 < diff.max() <= TOKEN_BOUND["fp16"]  # rounded (so converted), and close


def test_a_cast_the_converter_repeats_is_left_out_and_the_graph_loads(bundles):
    """onnxruntime 1.31's converter writes one Cast twice for a float16 tensor that two float32 nodes read (the
    newest onnxruntime-gpu's; the one installed here shares it), so the repeat is made here as it wrote it."""
    scorer = Scorer(bundles[("adaptive", 0.0)][1], threads=1)
    half = half_graph(scorer.bundle.graph_path("sentences"))
    model = onnx.load_from_string(half)
    cast = next(n for n in model.graph.node if n.op_type == "Cast" and n.name.endswith("_cast_to_fp32_node"))
    widened = next(v for v in model.graph.value_info if v.name == cast.output[0])
    model.graph.node.add().CopyFrom(cast)
    model.graph.value_info.add().CopyFrom(widened)
    with pytest.raises(Fail, match="two nodes with same node name"):
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])

    nodes = len(model.graph.node)
    fixed = without_repeated_nodes(model)
    assert len(fixed.graph.node) == nodes - 1 and [n.name for n in fixed.graph.node].count(cast.name) == 1
    assert [v.name for v in fixed.graph.value_info].count(widened.name) == 1
    inputs, targets, lengths = sentence_batch(SENTENCES)
    state = np.zeros((scorer.layers, len(SENTENCES), scorer.state_size), dtype=np.float32)
    feed = {"input_ids": inputs, "target_ids": targets, "lengths": lengths, "h0": state, "c0": state}
    got = ort.InferenceSession(fixed.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)[0]
    want = ort.InferenceSession(half, providers=["CPUExecutionProvider"]).run(None, feed)[0]
    np.testing.assert_array_equal(got, want)


def test_fp16_off_the_gpu_and_unknown_precisions_are_refused_before_any_work(tmp_path, capsys):
    """The Scorer refuses before it reads the bundle (none is there); lm-rescore as it parses (exit 2; neither the
    bundle nor the input exists)."""
    with pytest.raises(PrecisionError, match=r"precision 'fp16' is for device 'cuda', not 'cpu'.*no float16 LSTM"):
        Scorer(tmp_path / "no bundle here", precision="fp16")
    with pytest.raises(PrecisionError, match=r"precision 'bf16': expected one of \['fp32', 'fp16'\]"):
        Scorer(tmp_path / "no bundle here", precision="bf16")
    missing = str(tmp_path / "missing")
    commands = [
        (["score", "--lm", missing, "--input", missing, "--precision", "fp16"],
         "--precision fp16 with --device cpu: precision 'fp16' is for device 'cuda'"),
        (["tune", missing, "--lm", missing, "--metric", "wer", "--features", "neural", "--out", missing,
          "--precision", "fp16"], "--precision fp16 with --device cpu"),
        (["nbest", missing, "--weights", missing, "--out", missing, "--server", "localhost:1", "--precision", "fp16"],
         "--precision fp16 with --server: the server's config (models.NAME.precision)"),
    ]  # fmt: skip
    for argv, message in commands:
        with pytest.raises(SystemExit) as exited:
            rescore_main(argv)
        assert exited.value.code == 2
        assert message in capsys.readouterr().err, argv


def test_a_models_precision_is_checked_with_the_config_and_at_load(bundles, tmp_path):
    """A value that is not a precision is an error of the config; fp16 on the CPU (the config's device, or the
    command line's) one of loading the model, naming its key; the server does not start either way."""
    bundle = bundles[("full", 0.0)][1]
    config = tmp_path / "serve.toml"
    config.write_text(f'[models.m]\nbundle = "{bundle}"\nprecision = "fp8"\n')
    with pytest.raises(ConfigError, match=r"models\.m\.precision = 'fp8': expected one of \['fp32', 'fp16'\]"):
        load_config(config)
    config.write_text(f'[models.m]\nbundle = "{bundle}"\nprecision = "fp16"\n')
    with pytest.raises(ConfigError, match=r"models\.m\.precision = 'fp16': precision 'fp16' is for device 'cuda'"):
        ModelSet.load(load_config(config))
    config.write_text(f'[models.m]\nbundle = "{bundle}"\nprecision = "fp32"\n')
    assert ModelSet.load(load_config(config)).get("m").lm.scorer.precision == "fp32"
