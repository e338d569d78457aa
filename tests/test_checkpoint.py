import json
import subprocess
import sys

import pytest
import torch

from lmserve.training.checkpoint import (
    CheckpointError,
    load_model_for_eval,
    load_training_state,
    mark_best,
    prune_checkpoints,
    resolve_checkpoint,
    save_checkpoint,
)
from lmserve.training.config import Config, HeadConfig, ModelConfig
from lmserve.training.model import LSTMLM
from lmserve.training.trainer import build_optimizer
from lmserve.training.vocab import Vocabulary

VOCAB = Vocabulary.build([["a", "b", "c", "a"]])


def trained(optimizer_name: str, tie: bool = False):
    cfg = Config(model=ModelConfig(embedding_size=6, hidden_size=6, tie_embeddings=tie), head=HeadConfig())
    cfg.optimizer.name = optimizer_name
    torch.manual_seed(0)
    model = LSTMLM(len(VOCAB), cfg.model, cfg.head)
    optimizer = build_optimizer(model, cfg)
    for _ in range(2):
        hidden, _ = model(torch.randint(0, len(VOCAB), (3, 2)))
        optimizer.zero_grad()
        model.head.target_logprob(hidden.reshape(-1, 6), torch.randint(0, len(VOCAB), (6,))).sum().neg().backward()
        optimizer.step()
    return cfg, model, optimizer


@pytest.mark.parametrize("name", ["sgd", "adagrad", "adam"])
def test_checkpoint_round_trip_restores_weights_optimizer_and_rng(tmp_path, name):
    cfg, model, optimizer = trained(name, tie=name == "adam")
    torch.manual_seed(123)
    carried = (torch.randn(2, 1, 6), torch.randn(2, 1, 6))
    path = save_checkpoint(
        tmp_path,
        "ckpt-001-000005",
        model=model,
        optimizer=optimizer,
        config=cfg,
        vocab=VOCAB,
        state={"epochs_done": 1, "batch": 5},
        carried=carried,
    )
    expected_next_random = torch.rand(3)

    _, _, fresh_model = load_model_for_eval(path)
    for (key, a), b in zip(model.state_dict().items(), fresh_model.state_dict().values(), strict=True):
        assert torch.equal(a, b), key
    if cfg.model.tie_embeddings:
        assert fresh_model.head.linear.weight is fresh_model.embedding.weight
    fresh_optimizer = build_optimizer(fresh_model, cfg)
    state, got_carried = load_training_state(path, fresh_optimizer)
    assert state == {"epochs_done": 1, "batch": 5}
    assert torch.equal(torch.rand(3), expected_next_random)  # the RNG continues where it was saved
    assert all(torch.equal(a, b) for a, b in zip(carried, got_carried, strict=True))
    before, after = optimizer.state_dict(), fresh_optimizer.state_dict()
    assert json.loads(json.dumps(before["param_groups"])) == after["param_groups"]  # (tuples come back as lists)
    for pid, slots in before["state"].items():
        for key, value in slots.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(after["state"][pid][key])), (pid, key)


def test_pointers_pruning_and_resolution(tmp_path):
    cfg, model, optimizer = trained("sgd")
    for name in ("ckpt-001-000000", "ckpt-002-000000", "ckpt-003-000000"):
        save_checkpoint(tmp_path, name, model=model, optimizer=optimizer, config=cfg, vocab=VOCAB, state={})
        if name == "ckpt-001-000000":
            mark_best(tmp_path, name)
    prune_checkpoints(tmp_path)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.is_dir()) == [
        "ckpt-001-000000",
        "ckpt-003-000000",
    ]
    assert resolve_checkpoint(tmp_path).name == "ckpt-001-000000"
    assert resolve_checkpoint(tmp_path, "latest").name == "ckpt-003-000000"
    assert json.loads((resolve_checkpoint(tmp_path) / "config.json").read_text())["model"]["hidden_size"] == 6


def test_a_killed_writers_half_checkpoint_is_removed_by_the_next_save(tmp_path):
    """kill -9 during a save leaves its temporary folder (a model's worth of disk); the resumed run saves that step
    again and removes it, while a live process's temporary (pid 1) is left alone."""
    cfg, model, optimizer = trained("sgd")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    checkpoints = tmp_path / "checkpoints"
    leftover = checkpoints / f".ckpt-001-000000.{int(dead.stdout)}.abc123.tmp"
    running = checkpoints / ".ckpt-001-000000.1.def456.tmp"
    for folder in (leftover, running):
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"half")
    save_checkpoint(tmp_path, "ckpt-001-000000", model=model, optimizer=optimizer, config=cfg, vocab=VOCAB, state={})
    assert not leftover.exists() and running.exists()
    assert resolve_checkpoint(tmp_path, "latest").name == "ckpt-001-000000"


def test_damaged_checkpoints_are_clear_errors(tmp_path):
    cfg, model, optimizer = trained("sgd")
    path = save_checkpoint(
        tmp_path, "ckpt-001-000000", model=model, optimizer=optimizer, config=cfg, vocab=VOCAB, state={}
    )
    config = json.loads((path / "config.json").read_text())
    config["model"]["hidden_size"] = 7
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match="hidden_size|size mismatch|does not match"):
        load_model_for_eval(path)
    (path / "vocab.tsv").unlink()
    with pytest.raises(CheckpointError, match="missing vocab.tsv"):
        load_model_for_eval(path)
