"""benchmarks/step_profile.py's split of a training step into its regions, on the CPU and (where PyTorch sees one) on
a CUDA GPU, where a region's time is that of the kernels it launched rather than its CPU time."""

import itertools

import pytest

from benchmarks.step_profile import book_kernels, busy_ms, profile_steps
from lmserve.training.config import load_config
from lmserve.training.trainer import Trainer

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.needs_gpu)]  # the CPU split in CI; the GPU's on a GPU machine


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_profile_splits_a_step_into_its_regions(tmp_path, write_config, device, precision):
    cfg = load_config(write_config("sentence", "adaptive", train={"device": device, "precision": precision}))
    trainer = Trainer.fresh(cfg, tmp_path / "run")
    steps = list(itertools.islice(trainer.train_batches.steps_of(0), 4))
    profile = profile_steps(trainer, steps)
    names = ["lstm", "head", "optimizer", "backward: lstm", "backward: head and embedding"]
    shares = {name: profile[name] for name in names}
    assert sum(shares.values()) == pytest.approx(1.0)
    assert all(share > 0 for share in shares.values()), shares  # every region did work, the LSTM's backward included
    assert profile["profiled_ms_per_step"] > 0
    if device == "cuda":
        assert profile["gpu_busy_ms_per_step"] > 0
        assert profile["kernel_overlap"] >= 1 - 1e-9  # the busy time is a union: no kernel counts twice
        assert profile["top_kernels"]


def test_gpu_busy_time_counts_overlapping_kernels_once():
    # cuDNN runs a 2-layer LSTM's layers on two streams at once: kernels overlap, and a gap is idle time
    spans = [(0.0, 4000.0), (1000.0, 3000.0), (3500.0, 6000.0), (8000.0, 9000.0), (8000.0, 8500.0)]
    assert busy_ms(spans) == pytest.approx(7.0)
    assert busy_ms([]) == 0.0


def test_each_kernel_is_booked_once_to_the_region_open_at_its_launch():
    markers = [("lstm", 0, 100), ("head", 100, 200), ("CudnnRnnBackward0", 300, 400), ("optimizer", 500, 600)]
    work = [(50, 2.0), (150, 1.0), (350, 4.0), (450, 0.5), (None, 0.25), (550, 1.5)]
    assert book_kernels(markers, work) == {
        "lstm": 2.0,
        "head": 1.0,
        "optimizer": 1.5,
        "backward: lstm": 4.0,
        "backward: head and embedding": 0.75,  # launched in no region, or with no launch record
    }
