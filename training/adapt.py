"""``lm-train fit CONFIG --init-from CHECKPOINT``: a trained model continued on a small in-domain text.

What the model is comes from the initial checkpoint: its ``[model]``, ``[head]`` and ``[vocab]`` sections and its
vocabulary file, whose ids the weights are about. The config may leave those sections out or repeat them; a key that
differs is an error naming it, never a silent choice. ``data.lowercase`` belongs with them (it decides which entry of
the vocabulary a word of the text is), and ``[objective]``, ``data.mode`` and ``data.direction`` are the checkpoint's
unless the config gives them, so that a self-normalised model stays self-normalised, a sentence-mode model is
evaluated as one and a backward model goes on reading backwards (a config may turn a forward model around: the
backward twin of ``models/english_lm`` starts from it). All
the rest (data, optimizer, schedule, epochs, early stopping) is the config's, defaults included.

Words of the new text outside the vocabulary become ``<unk>``; how many there are per split is printed and kept in the
run's ``results.json`` (``init_from.oov``). The trainer evaluates the initial weights before the first update and
saves them as the first ``best`` checkpoint, so the adapted model is never worse on the validation text than the one
it started from: when no epoch improves, ``best`` is the initial weights.

A model bundle (a release model of ``models/``) is a checkpoint too: ``training.from_bundle`` rebuilds its PyTorch
model from the ONNX graphs' weights (fp16 or int8 storage widened back to float32) and writes it as a checkpoint,
which goes on from here as any other; the run records the bundle (``init_from.bundle``).

The checkpoint is read whole before anything is written (``initial_checkpoint``): a file where a folder belongs, a
file missing, damaged or cut short, weights of another shape than its config's model are each one error naming
``--init-from`` and the file, and leave no run folder behind.
"""

from __future__ import annotations

from pathlib import Path

from lmserve.training.checkpoint import CheckpointError, load_model_for_eval, read_config, resolve_checkpoint
from lmserve.training.config import Config, ConfigError, apply_overrides, config_from_dict, read_config_file
from lmserve.training.from_bundle import checkpoint_from_bundle, is_bundle

FIXED_SECTIONS = ("model", "head", "vocab")  # the checkpoint's: the config may only repeat them
CHECKPOINT_FILES = ("config.json", "vocab.tsv", "model.safetensors")


def initial_checkpoint(path: str | Path) -> Path:
    """The checkpoint ``--init-from`` names: a checkpoint directory, or a run directory (its best checkpoint),
    checked whole: its config, vocabulary and weights load into its model (module docstring)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(
            f"--init-from {path}: no such folder; neither a checkpoint nor a run folder to start from"
        )
    if not path.is_dir():
        raise CheckpointError(
            f"--init-from {path}: a file; expected a checkpoint folder ({', '.join(CHECKPOINT_FILES)}) or a run "
            "folder (its best checkpoint)"
        )
    if is_bundle(path):  # a model bundle: its weights rebuilt from its graphs into a checkpoint (training.from_bundle)
        return checkpoint_from_bundle(path)
    try:
        ckpt = resolve_checkpoint(path, "best")
    except CheckpointError as e:
        raise CheckpointError(f"--init-from {e}") from None
    for name in CHECKPOINT_FILES:
        if not (ckpt / name).is_file():
            raise CheckpointError(f"--init-from {path}: {ckpt} has no {name}")
    try:
        load_model_for_eval(ckpt)  # before a run folder exists: a damaged checkpoint must not leave half of one
    except ValueError as e:  # CheckpointError, ConfigError, VocabError: each names its file
        raise CheckpointError(f"--init-from {path}: {e}") from None
    return ckpt


def adapted_config(config_path: str | Path, overrides: list[str], ckpt: Path) -> Config:
    """The config of a run that continues ``ckpt``: the file with ``overrides``, and the checkpoint's model, head,
    vocabulary and (where the file is silent) objective, data.mode, data.lowercase and data.direction (module
    docstring)."""
    raw = apply_overrides(read_config_file(config_path), overrides)
    given = config_from_dict(raw, str(config_path))
    initial = read_config(ckpt)
    if initial.vocab.type != "word":
        raise ConfigError(
            f"--init-from {ckpt}: a {initial.vocab.type} vocabulary; continuing training is supported for word "
            "vocabularies only (the new text would have to be spelled with the checkpoint's sentencepiece model)"
        )
    data = raw.get("data", {})
    named = [(section, key) for section in FIXED_SECTIONS for key in raw.get(section, {})]
    for section, key in named + ([("data", "lowercase")] if "lowercase" in data else []):
        mine, theirs = getattr(getattr(given, section), key), getattr(getattr(initial, section), key)
        if mine != theirs:
            raise ConfigError(
                f"{config_path}: {section}.{key} = {mine!r}, but the initial checkpoint {ckpt} has {theirs!r}: with "
                "--init-from the model, head and vocabulary (and data.lowercase) are the checkpoint's; leave the key "
                "out or give the checkpoint's value"
            )
    merged, saved = given.to_dict(), initial.to_dict()
    for section in FIXED_SECTIONS:
        merged[section] = saved[section]
    if "objective" not in raw:
        merged["objective"] = saved["objective"]
    for key in ("mode", "lowercase", "direction"):
        if key not in data:
            merged["data"][key] = saved["data"][key]
    return config_from_dict(merged, f"{config_path} with --init-from {ckpt}")
