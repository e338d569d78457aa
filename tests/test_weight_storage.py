"""Bundle weight storage (``lm-train export --weights``): one shared weights file, fp16 and int8 storage that the
scorer widens back to float32 at load, and the errors for what does not go together."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from lmserve.core.bundle import WEIGHTS_FILE, Bundle, BundleError
from lmserve.rescoring.scorer import Scorer
from lmserve.training.cli import main

SENTENCES = ["w1 w2 w3", "w5 w7 w7", "w0 w3 w1 w4 w2 w9 w11", "w12 w3"]


@pytest.fixture(scope="module")
def stored(bundles, tmp_path_factory):
    """The adaptive test model exported with each storage (fp32 is the session fixture's own bundle)."""
    run, fp32 = bundles[("adaptive", 0.0)]
    root = tmp_path_factory.mktemp("stored")
    made = {"fp32": fp32}
    for storage in ("fp16", "int8"):
        assert main(["export", "--checkpoint", str(run), "--out", str(root / storage), "--weights", storage]) == 0
        made[storage] = root / storage
    return made


def external_spans(bundle) -> list[tuple[int, int]]:
    """(offset, length) of every initializer, in every graph, that lives in weights.bin."""
    spans = []
    for name in ("sentences", "step", "step_full"):
        model = onnx.load(str(bundle.graph_path(name)), load_external_data=False)
        for init in model.graph.initializer:
            if init.data_location == onnx.TensorProto.EXTERNAL:
                fields = {e.key: e.value for e in init.external_data}
                assert fields["location"] == WEIGHTS_FILE
                spans.append((int(fields["offset"]), int(fields["length"])))
    return spans


def test_the_graphs_share_one_weights_file_that_holds_each_tensor_once(stored):
    bundle = Bundle.load(stored["fp32"])
    assert bundle.manifest["weights"] == {"file": WEIGHTS_FILE, "storage": "fp32"}
    spans = external_spans(bundle)
    distinct = set(spans)
    assert len(spans) > len(distinct)  # the LSTM and the head are in all three graphs, stored once
    size = (bundle.path / WEIGHTS_FILE).stat().st_size
    assert size == max(o + n for o, n in distinct)
    assert sum(n for _, n in distinct) <= size < sum(n for _, n in spans)


def test_fp16_and_int8_storage_shrink_the_weights_and_score_close_to_fp32(stored):
    size = {k: (p / WEIGHTS_FILE).stat().st_size for k, p in stored.items()}
    data = {k: sum(n for _, n in set(external_spans(Bundle.load(p)))) for k, p in stored.items()}
    assert data["fp16"] < 0.55 * data["fp32"]
    assert data["int8"] < data["fp16"]
    assert size["int8"] < size["fp32"]
    scores = {k: np.array([s.logprob for s in Scorer(p, threads=1).score(SENTENCES)]) for k, p in stored.items()}
    assert np.abs(scores["fp16"] - scores["fp32"]).max() < 1e-2
    assert np.abs(scores["int8"] - scores["fp32"]).max() < 0.2
    for storage in ("fp16", "int8"):
        held = Bundle.load(stored[storage]).manifest["heldout"]
        assert held["score_ppl"] == pytest.approx(held["ppl"], rel=0.02)  # measured on the stored graphs
        assert held["max_abs_diff"] > 0  # and not the fp32 graphs' parity


@pytest.mark.parametrize("storage", ["fp16", "int8"])
def test_onnx_runtime_folds_the_widening_into_float32_constants_at_load(stored, storage, tmp_path):
    """No Cast or Mul of a weight runs per call: the stored graphs compute as fast as fp32 ones."""
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimised.onnx")
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    graph = Bundle.load(stored[storage]).graph_path("step")
    ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
    optimised = onnx.load(str(tmp_path / "optimised.onnx"))
    narrow = {onnx.TensorProto.FLOAT16, onnx.TensorProto.INT8}
    assert not [i.name for i in optimised.graph.initializer if i.data_type in narrow]


def test_quantize_and_narrow_weights_together_is_an_error_before_any_work(bundles, tmp_path, capsys):
    run, _ = bundles[("full", 0.0)]
    out = tmp_path / "bundle"
    assert main(["export", "--checkpoint", str(run), "--out", str(out), "--quantize", "int8", "--weights", "fp16"]) == 2
    assert "--quantize int8 with --weights fp16" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("weights", [{"file": "missing.bin", "storage": "fp16"}, {"file": WEIGHTS_FILE}, "fp16"])
def test_a_manifest_whose_weights_field_is_wrong_is_refused_naming_it(stored, tmp_path, weights):
    copy = shutil.copytree(stored["fp16"], tmp_path / "bundle")
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["weights"] = weights
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="field 'weights'"):
        Bundle.load(copy)
