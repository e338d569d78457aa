"""``train.device``: a run on a CUDA GPU trains, checkpoints and resumes like a CPU run, and its checkpoints are
ordinary ones that evaluate and export on a machine without a GPU. The GPU tests run where PyTorch sees one (the
lent GPU machine: ``pytest tests/test_train_device.py``); the clear error for a GPU the machine lacks is tested
everywhere."""

import json
import signal
import subprocess
import sys

import pytest
import torch
from conftest import make_sentences, tiny_config_text, write_corpus
from safetensors.torch import load_file
from test_train_cli import resume, start_and_signal

from lmserve.training.checkpoint import load_model_for_eval
from lmserve.training.cli import main
from lmserve.training.corpus import encode_file
from lmserve.training.evaluate import evaluate
from lmserve.training.trainer import make_batcher

# (head, objective overrides, precision): each head and a sampled objective, so every buffer and noise draw meets the
# GPU, and in bf16 the heads and a sampled objective whose loss mixes matrix products with float32 reductions
RUNS = [
    ("full", {}, "fp32"),
    ("adaptive", {}, "fp32"),
    ("class", {}, "fp32"),
    ("tree", {}, "fp32"),
    ("full", {"type": "importance_sampling", "samples": 20, "noise_power": 0.5, "noise_uniform": 0.1}, "fp32"),
    ("full", {"type": "nce", "samples": 20}, "fp32"),
    ("full", {}, "bf16"),
    ("adaptive", {}, "bf16"),
    ("class", {}, "bf16"),
    ("full", {"type": "nce", "samples": 20}, "bf16"),
]


def test_a_device_this_machine_lacks_is_a_clear_error(tmp_path, write_config, capsys):
    """GPU 99 exists nowhere: without a GPU the error says PyTorch sees none, with one it gives the count."""
    assert main(["fit", str(write_config(train={"device": "cuda:99"})), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "train.device = 'cuda:99'" in err
    assert ("sees no CUDA GPU" in err) is not torch.cuda.is_available()
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.needs_gpu
@pytest.mark.parametrize(
    ("head", "objective", "precision"), RUNS, ids=[f"{h}-{o.get('type', 'ce')}-{p}" for h, o, p in RUNS]
)
def test_gpu_run_learns_and_its_checkpoint_evaluates_the_same_on_the_cpu(
    tmp_path, write_config, tiny_corpus, capsys, head, objective, precision
):
    config = write_config("sentence", head, train={"device": "cuda", "precision": precision}, objective=objective)
    gpu = tmp_path / "gpu"
    assert main(["fit", str(config), "--out", str(gpu)]) == 0
    results = json.loads(capsys.readouterr().out)
    valid = [
        e["ppl"] for e in map(json.loads, (gpu / "metrics.jsonl").read_text().splitlines()) if e["event"] == "valid"
    ]
    assert valid[-1] < valid[0]

    cfg, vocab, model = load_model_for_eval(gpu)  # on the CPU
    assert next(model.parameters()).device.type == "cpu"
    corpus = encode_file(str(tiny_corpus["test"]), vocab, cfg.data.lowercase)
    on_cpu = evaluate(model, make_batcher(cfg, corpus, vocab, training=False), vocab.unk_id)
    assert on_cpu.ppl == pytest.approx(results["test"]["ppl"], rel=1e-4)


@pytest.mark.needs_gpu
def test_gpu_run_stopped_by_ctrl_c_resumes_to_the_uninterrupted_result(tmp_path):
    """Stream mode (the carried LSTM state comes back to the GPU) and importance sampling (its noise draws come from
    the GPU's generator, which the checkpoint keeps). Without dropout: cuDNN draws the masks between LSTM layers from
    a generator of its own that no checkpoint can restore. CUDA sums in varying order (index_add), so the figures
    agree to rounding, not bit for bit."""
    corpus = {
        "train": write_corpus(tmp_path / "train.txt", make_sentences(1500, seed=4)),
        "valid": write_corpus(tmp_path / "valid.txt", make_sentences(50, seed=5)),
        "test": write_corpus(tmp_path / "test.txt", make_sentences(50, seed=6)),
    }
    config = tmp_path / "config.toml"
    config.write_text(
        tiny_config_text(
            corpus,
            "stream",
            "full",
            model={"dropout": 0.0},
            train={"epochs": 3, "log_interval": 1, "device": "cuda"},
            objective={"type": "importance_sampling", "samples": 20},
        )
    )
    whole = tmp_path / "whole"
    subprocess.run([sys.executable, "-m", "lmserve.training.cli", "fit", str(config), "--out", str(whole)], check=True)
    expected = json.loads((whole / "results.json").read_text())

    run = tmp_path / "run"
    status, stderr = start_and_signal(config, run, epoch=2, sig=signal.SIGINT)
    assert status == 130, stderr[-2000:]
    latest = (run / "checkpoints" / "latest").read_text().strip()
    saved = load_file(run / "checkpoints" / latest / "trainer.safetensors")
    assert latest.startswith("ckpt-001-") and {"rng.cuda", "carried.h"} <= saved.keys()
    resumed = resume(run)
    assert resumed["test"]["ppl"] == pytest.approx(expected["test"]["ppl"], rel=1e-3)
