"""``data.valid_fraction``: the validation text carved from the end of the one training file a user has.

A small in-domain text (a few thousand transcripts to adapt a model to) often comes as one file. Its last lines,
contiguous, become the validation text and the lines before them the training text: contiguous rather than sampled,
so that neighbouring lines of one dialogue or document do not sit on both sides. Both parts are written to
``RUN/carved/`` and the run's config names them (``data.valid_fraction`` back to 0), so that the saved config
describes the files the run really read, and ``--resume``, ``eval`` and ``export`` need nothing else.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from lmserve.core.atomic import replacing
from lmserve.training.config import Config, ConfigError, expand_data_path
from lmserve.training.corpus import CorpusError, open_binary
from lmserve.training.prepared import is_prepared

FOLDER = "carved"


def carved_config(cfg: Config, run_dir: Path) -> Config:
    """``cfg`` with data.train and data.valid naming the two parts in ``RUN/carved/`` (unchanged without
    ``data.valid_fraction``); :func:`carve` writes them."""
    if not cfg.data.valid_fraction:
        return cfg
    folder = run_dir / FOLDER
    data = dataclasses.replace(
        cfg.data, train=str(folder / "train.txt"), valid=str(folder / "valid.txt"), valid_fraction=0.0
    )
    return dataclasses.replace(cfg, data=data)


def carve(cfg: Config, run_dir: Path) -> str:
    """Write ``RUN/carved/train.txt`` and ``valid.txt`` from data.train (plain or gzipped text); returns a line that
    says what went where."""
    source, fraction = expand_data_path(cfg.data.train), cfg.data.valid_fraction
    if is_prepared(source) or (":" in source and is_prepared(source.rsplit(":", 1)[0])):
        raise ConfigError(
            f"data.valid_fraction = {fraction}: data.train = {cfg.data.train} is a prepared dataset, whose lines are "
            "ids already; give its validation split as data.valid (lm-train prepare --valid FILE)"
        )
    lines = _count_lines(source)
    valid = math.ceil(fraction * lines)
    if not 0 < valid < lines:
        raise CorpusError(
            f"{source}: {lines} lines; data.valid_fraction = {fraction} leaves "
            + ("no validation line" if valid == 0 else "no training line")
        )
    target = carved_config(cfg, run_dir).data
    with open_binary(source) as f, replacing(target.train, binary=True) as train, replacing(target.valid, True) as out:
        for number, line in enumerate(f):
            (train if number < lines - valid else out).write(line if line.endswith(b"\n") else line + b"\n")
    return (
        f"data.valid_fraction = {fraction}: the last {valid:,} of the {lines:,} lines of {source} are the validation "
        f"text ({target.valid}), the lines before them the training text ({target.train})"
    )


def _count_lines(path: str) -> int:
    count, last = 0, b"\n"
    with open_binary(path) as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            count += block.count(b"\n")
            last = block[-1:]
    return count + (last != b"\n")  # a last line without its newline
