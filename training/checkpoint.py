"""Checkpoints: one directory per save, written atomically, never unpickled.

Layout of ``RUN/checkpoints/ckpt-EEE-BBBBBB/`` (E = completed epochs, B = batches done in the next epoch):

- ``config.json``: the resolved run config; ``vocab.tsv``: the vocabulary with counts;
- ``model.safetensors``: weights (tied matrices stored once);
- ``trainer.safetensors``: optimiser tensors, the torch RNG state, the objective's own state if it keeps one (an
  adapted proposal, ``objective.*``) and, mid-epoch in stream mode, the carried LSTM state;
- ``state.json``: everything else the loop needs to continue exactly where it stopped.

``RUN/checkpoints/latest`` and ``best`` name the newest and the best-validation checkpoint.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, load_model, save_file, save_model

from lmserve.core.atomic import atomic_write_text, replacing_folder
from lmserve.training.config import Config, config_from_dict
from lmserve.training.model import LSTMLM
from lmserve.training.subword import MODEL_FILE as SUBWORD_MODEL_FILE
from lmserve.training.vocab import Vocabulary


class CheckpointError(ValueError):
    """A checkpoint or run directory is missing or incomplete; the message names the path."""


def checkpoint_name(epochs_done: int, batch: int) -> str:
    return f"ckpt-{epochs_done:03d}-{batch:06d}"


def _split_optimizer_state(state_dict: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    """Optimiser state -> (JSON-able part, tensors for safetensors)."""
    tensors, plain = {}, {}
    for pid, slots in state_dict["state"].items():
        plain[str(pid)] = {}
        for name, value in slots.items():
            if torch.is_tensor(value):
                tensors[f"optimizer.{pid}.{name}"] = value.detach().cpu().contiguous()
            else:
                plain[str(pid)][name] = value
    return {"state": plain, "param_groups": state_dict["param_groups"]}, tensors


def _join_optimizer_state(plain: dict, tensors: dict[str, torch.Tensor]) -> dict:
    state = {int(pid): dict(slots) for pid, slots in plain["state"].items()}
    for key, value in tensors.items():
        if key.startswith("optimizer."):
            _, pid, name = key.split(".", 2)
            state.setdefault(int(pid), {})[name] = value
    return {"state": state, "param_groups": plain["param_groups"]}


def save_checkpoint(
    run_dir: Path,
    name: str,
    *,
    model: LSTMLM,
    optimizer: torch.optim.Optimizer,
    config: Config,
    vocab: Vocabulary,
    state: dict,
    carried: tuple[torch.Tensor, torch.Tensor] | None = None,
    subword_model: Path | None = None,
    objective_state: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write the checkpoint, then point ``latest`` at it. A subword run's sentencepiece model goes in with it: the
    piece ids mean nothing without it."""
    ckpt_root = run_dir / "checkpoints"
    path = ckpt_root / name
    optimizer_plain, tensors = _split_optimizer_state(optimizer.state_dict())
    tensors["rng.torch"] = torch.get_rng_state()
    if torch.cuda.is_initialized():  # a GPU run: dropout and noise samples draw from the GPU's generator
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    if carried is not None:
        tensors["carried.h"], tensors["carried.c"] = (t.detach().cpu().contiguous() for t in carried)
    for key, value in (objective_state or {}).items():
        tensors[f"objective.{key}"] = value.detach().cpu().contiguous()
    with replacing_folder(path) as tmp:
        (tmp / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
        vocab.save(tmp / "vocab.tsv")
        save_weights(model, tmp / "model.safetensors")
        save_file(tensors, str(tmp / "trainer.safetensors"))
        if subword_model is not None:
            shutil.copyfile(subword_model, tmp / SUBWORD_MODEL_FILE)
        (tmp / "state.json").write_text(json.dumps({**state, "optimizer": optimizer_plain}, indent=2) + "\n")
    atomic_write_text(ckpt_root / "latest", name + "\n")
    return path


def _cpu_twin(model: LSTMLM) -> LSTMLM:
    """The model itself on the CPU, else a CPU copy: on a GPU, cuDNN keeps an LSTM's weights as views of one flat
    buffer, which safetensors refuses to save or load as separate tensors (tied weights stay tied in the copy)."""
    return model if next(model.parameters()).device.type == "cpu" else copy.deepcopy(model).cpu()


def save_weights(model: LSTMLM, path: Path) -> None:
    save_model(_cpu_twin(model), str(path))


def load_weights(model: LSTMLM, path: Path) -> None:
    """Load ``model.safetensors`` into ``model`` wherever it lives (strict: every weight, nothing else)."""
    twin = _cpu_twin(model)
    load_model(twin, str(path))
    if twin is not model:
        model.load_state_dict(twin.state_dict())


def mark_best(run_dir: Path, name: str) -> None:
    atomic_write_text(run_dir / "checkpoints" / "best", name + "\n")


def prune_checkpoints(run_dir: Path) -> None:
    """Keep only the latest and the best checkpoint (and nothing half-written)."""
    root = run_dir / "checkpoints"
    keep = {_read_pointer(root, "latest"), _read_pointer(root, "best")}
    for child in root.iterdir():
        if child.is_dir() and child.name not in keep:
            shutil.rmtree(child)


def _read_pointer(root: Path, which: str) -> str | None:
    try:
        return (root / which).read_text().strip()
    except FileNotFoundError:
        return None


def resolve_checkpoint(path: str | Path, which: str = "best") -> Path:
    """A checkpoint directory, or a run directory whose ``best`` (or ``latest``) checkpoint is meant."""
    path = Path(path)
    if (path / "model.safetensors").exists():
        return path
    name = _read_pointer(path / "checkpoints", which)
    if name is None:
        raise CheckpointError(
            f"{path}: neither a checkpoint (no model.safetensors) nor a run with a {which} checkpoint"
        )
    return path / "checkpoints" / name


def read_config(ckpt: Path) -> Config:
    """A checkpoint's ``config.json``; errors name the file."""
    path = ckpt / "config.json"
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not a checkpoint's config (not JSON: {e}); the checkpoint is damaged") from None
    if not isinstance(record, dict):
        raise CheckpointError(f"{path}: expected a JSON object (the run's config), got {type(record).__name__}")
    return config_from_dict(record, str(path))


def load_model_for_eval(path: str | Path) -> tuple[Config, Vocabulary, LSTMLM]:
    """The model of a checkpoint (or of a run's best one). Whatever is wrong with it (a file missing, cut short or of
    another model, weights of other shapes than its config's) is a :class:`CheckpointError` naming the file."""
    ckpt = resolve_checkpoint(path)
    for required in ("config.json", "vocab.tsv", "model.safetensors"):
        if not (ckpt / required).is_file():
            raise CheckpointError(f"{ckpt}: missing {required}")
    config = read_config(ckpt)
    vocab = Vocabulary.load(ckpt / "vocab.tsv")
    model = LSTMLM(len(vocab), config.model, config.head, vocab.tokens)
    weights = ckpt / "model.safetensors"
    try:
        missing, unexpected = load_model(model, str(weights), strict=False)
    except SafetensorError as e:
        raise CheckpointError(f"{weights}: cannot be read ({e}); the checkpoint is damaged") from None
    except RuntimeError as e:  # load_state_dict's size mismatch: weights of another model than config.json's
        first = next((line.strip() for line in str(e).splitlines() if "size mismatch" in line), str(e))
        raise CheckpointError(
            f"{weights}: weights of another shape than config.json's model (vocabulary {len(vocab)}, "
            f"{config.model.layers}x{config.model.hidden_size}, head {config.head.type}): {first}"
        ) from None
    if missing or unexpected:
        raise CheckpointError(
            f"{weights}: does not match config.json's model (missing {_few(missing)}, extra {_few(unexpected)})"
        )
    return config, vocab, model


def _few(names: list[str], most: int = 5) -> str:
    return str(names[:most])[:-1] + (f", ... ({len(names)} in all)]" if len(names) > most else "]")


def load_objective_state(ckpt: Path) -> dict[str, torch.Tensor]:
    """The objective's saved state (``save_checkpoint``'s ``objective_state``), empty for objectives that keep none."""
    tensors = load_file(str(ckpt / "trainer.safetensors"))
    return {key.removeprefix("objective."): value for key, value in tensors.items() if key.startswith("objective.")}


def load_training_state(ckpt: Path, optimizer: torch.optim.Optimizer) -> tuple[dict, tuple | None]:
    """Restore optimiser and RNG in place; return (state.json content, carried LSTM state or None)."""
    state = json.loads((ckpt / "state.json").read_text())
    tensors = load_file(str(ckpt / "trainer.safetensors"))
    optimizer.load_state_dict(_join_optimizer_state(state.pop("optimizer"), tensors))
    torch.set_rng_state(tensors["rng.torch"])
    if "rng.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng.cuda"])
    carried = (tensors["carried.h"], tensors["carried.c"]) if "carried.h" in tensors else None
    return state, carried
