"""Small corpora the tests generate themselves: sentences from a random bigram chain over a Zipf-ish vocabulary,
so that a model can learn something in a few seconds and perplexities are meaningful."""

from __future__ import annotations

import gzip
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from lmserve.server.process import ServerProcess

ROOT = Path(__file__).resolve().parents[1]


@contextmanager
def running_lm_serve(root: Path, config: str | Path, *args: str, log: str = "server.log") -> Iterator[ServerProcess]:
    """``lm-serve serve`` in a child process on a free port, as the benchmarks start it (``server.process``): with
    ``config``, TOML text (written to root/serve.toml) or a config file, and ``args``, more ``serve`` options. Yields
    the server (``address``, ``records``, ``metrics_url``; its log is root/``log``); when the block ends without an
    error, SIGTERM, and the test fails unless the server exits 0 with ``stopped`` as its last log line and no error
    logged. Tests that stop or break a server on purpose use ``ServerProcess`` itself."""
    if not isinstance(config, Path):
        (root / "serve.toml").write_text(config)
        config = root / "serve.toml"
    with ServerProcess(config, root / log, *args) as server:
        yield server
        assert server.stop(timeout=30) == 0, server.log_text()
        records = server.records
        assert records[-1]["message"] == "stopped", server.log_text()
        assert not [r for r in records if r.get("level") == "error"], f"errors in the server log: {server.log_text()}"


def no_gpu_reason() -> str | None:
    """Why no NVIDIA GPU is visible here (None when ``nvidia-smi -L`` lists one): asked of the driver's own tool,
    so that it holds whatever onnxruntime or torch build is installed."""
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        return "no NVIDIA GPU: nvidia-smi is not installed"
    except subprocess.TimeoutExpired:
        return "no NVIDIA GPU: nvidia-smi -L did not answer in 30 s"
    if listed.returncode != 0 or "GPU" not in listed.stdout:
        said = (listed.stderr or listed.stdout).strip().splitlines()
        how = f"exited {listed.returncode}" if listed.returncode else "lists none"
        return f"no NVIDIA GPU: nvidia-smi -L {how}" + (f" ({said[0]})" if said else "")
    return None


# What `make test-fast` (pytest -m "not slow") leaves out: tests marked ``slow`` by hand (a module's pytestmark, a
# test's mark: other processes, training beyond a few steps) and, marked here, tests that need what takes long to
# make whatever they do: the ``bundles`` fixture (four models trained once a session), a server process (their module
# imports ServerProcess or running_lm_serve), or the real data sets (``integration``).
SLOW_FIXTURES = {"bundles"}
SERVER_STARTERS = {"ServerProcess", "running_lm_serve"}


def slow_by_need(item: pytest.Item) -> bool:
    if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())) or item.get_closest_marker("integration"):
        return True
    module = getattr(item, "module", None)
    return module is not None and any(name in vars(module) for name in SERVER_STARTERS)


@pytest.hookimpl(tryfirst=True)  # before -m selects by the marks
def pytest_collection_modifyitems(config, items):
    """Tests that need slow things are marked ``slow`` (above); tests marked ``needs_gpu`` are skipped, with the
    reason, where no NVIDIA GPU is visible."""
    for item in items:
        if not item.get_closest_marker("slow") and slow_by_need(item):
            item.add_marker(pytest.mark.slow)
    gpu_tests = [item for item in items if item.get_closest_marker("needs_gpu")]
    reason = no_gpu_reason() if gpu_tests else None
    if reason:
        for item in gpu_tests:
            item.add_marker(pytest.mark.skip(reason=reason))


def make_sentences(n: int, seed: int, vocab_size: int = 40, max_len: int = 12) -> list[str]:
    rng = np.random.default_rng(seed)
    words = [f"w{i}" for i in range(vocab_size)]
    chain_rng = np.random.default_rng(12345)  # the same "language" for every split
    weights = 1.0 / np.arange(1, vocab_size + 1)
    transitions = chain_rng.dirichlet(weights * 3, size=vocab_size)
    sentences = []
    for _ in range(n):
        length = int(rng.integers(1, max_len + 1))
        w = int(rng.choice(vocab_size, p=weights / weights.sum()))
        tokens = [words[w]]
        for _ in range(length - 1):
            w = int(rng.choice(vocab_size, p=transitions[w]))
            tokens.append(words[w])
        sentences.append(" ".join(tokens))
    return sentences


def sentence_batch(sentences: list[list[int]], bos=1, eos=2):
    """Arrays for a ``sentences`` graph: ``<s> w..`` inputs, ``w.. </s>`` targets (padded with </s>) and lengths."""
    steps = max(len(s) for s in sentences) + 1
    inputs = np.full((len(sentences), steps), eos, dtype=np.int64)
    targets = np.full((len(sentences), steps), eos, dtype=np.int64)
    for b, s in enumerate(sentences):
        inputs[b, : len(s) + 1] = [bos, *s]
        targets[b, : len(s) + 1] = [*s, eos]
    return inputs, targets, np.array([len(s) + 1 for s in sentences], dtype=np.int64)


def write_corpus(path: Path, sentences: list[str]) -> Path:
    data = ("\n".join(sentences) + "\n").encode()
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return path


def write_splits(root: Path, sentences=make_sentences) -> dict[str, Path]:
    """train, valid and test files of 300, 40 and 40 sentences from ``sentences(n, seed)`` (seeds 1, 2, 3): the
    corpus the module-scoped fixtures train on."""
    return {
        name: write_corpus(root / f"{name}.txt", sentences(n, seed))
        for name, n, seed in (("train", 300, 1), ("valid", 40, 2), ("test", 40, 3))
    }


def fit_and_export(root: Path, name: str, config_text: str, overrides: list[str] = ()) -> tuple[Path, Path]:
    """``lm-train fit`` of ``config_text`` into ``root/name``, then ``export`` to ``root/name.bundle``: (run,
    bundle)."""
    from lmserve.training.cli import main

    config = root / f"{name}.toml"
    config.write_text(config_text)
    run, bundle = root / name, root / f"{name}.bundle"
    assert main(["fit", str(config), "--out", str(run), *overrides]) == 0
    assert main(["export", "--checkpoint", str(run), "--out", str(bundle)]) == 0
    return run, bundle


@pytest.fixture
def tiny_corpus(tmp_path) -> dict[str, Path]:
    """train (gzipped), valid and test files; valid/test contain a word the training text never has."""
    return {
        "train": write_corpus(tmp_path / "train.txt.gz", make_sentences(300, seed=1)),
        "valid": write_corpus(tmp_path / "valid.txt", make_sentences(40, seed=2) + ["w1 neverseen w2"]),
        "test": write_corpus(tmp_path / "test.txt", make_sentences(40, seed=3)),
    }


def tiny_config_text(corpus: dict[str, Path], mode: str = "stream", head: str = "full", **sections) -> str:
    """A TOML config for a very small, fast model over ``corpus``; ``sections`` add or replace keys."""
    base = {
        "data": {
            "train": str(corpus["train"]),
            "valid": str(corpus["valid"]),
            "test": str(corpus["test"]),
            "mode": mode,
        },
        "model": {"embedding_size": 16, "hidden_size": 16, "layers": 2, "dropout": 0.1},
        "head": {"type": head, **({"cutoffs": [10, 25]} if head == "adaptive" else {})},
        "optimizer": {"name": "adam", "lr": 0.01},
        "train": {
            "batch_size": 8,
            "bptt": 8,
            "eval_batch_size": 4,
            "epochs": 3,
            "threads": 1,
            "log_interval": 5,
            "loss_reduction": "token_mean",
        },
    }
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    lines = []
    for name, values in base.items():
        lines.append(f"[{name}]")
        for key, value in values.items():
            lines.append(f"{key} = {toml_value(value)}")
    return "\n".join(lines) + "\n"


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\") + '"'
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return repr(value)


def head_overrides(head: dict, runs: Path) -> list[str]:
    """``--set=head.KEY=VALUE`` for each of a test row's head settings; ``{runs}`` in a value is the module's runs."""
    return [f"--set=head.{key}={toml_value(value)}".replace("{runs}", str(runs)) for key, value in head.items()]


@pytest.fixture
def write_config(tmp_path, tiny_corpus):
    """``write_config(mode=..., head=..., section={...})`` -> path of a TOML config over ``tiny_corpus``."""
    counter = iter(range(1000))

    def write(mode: str = "stream", head: str = "full", **sections) -> Path:
        path = tmp_path / f"config{next(counter)}.toml"
        path.write_text(tiny_config_text(tiny_corpus, mode, head, **sections))
        return path

    return write


@pytest.fixture
def shared_data() -> Path:
    """The real data sets (../shared/data or $LMSERVE_DATA): integration tests need them and fail loudly without."""
    path = Path(os.environ.get("LMSERVE_DATA", ROOT.parent / "shared" / "data"))
    if not (path / "ptb" / "ptb.train.txt.gz").exists():
        raise FileNotFoundError(f"integration tests need the shared data sets at {path} (set LMSERVE_DATA)")
    return path


BUNDLE_HEADS = [("full", 0.0), ("adaptive", 0.0), ("full", 0.5), ("adaptive", 0.5)]  # (head, selfnorm alpha)


@pytest.fixture(scope="session")
def bundles(tmp_path_factory) -> dict[tuple[str, float], tuple[Path, Path]]:
    """(run, bundle) per head x normalisation: trained one epoch on a generated corpus and exported, once."""
    root = tmp_path_factory.mktemp("bundles")
    corpus = write_splits(root)
    made = {}
    for head, alpha in BUNDLE_HEADS:
        # the penalty needs a few epochs to bring log Z within export's thresholds for "self-normalised"
        text = tiny_config_text(
            corpus, "sentence", head, train={"epochs": 4 if alpha else 1}, objective={"selfnorm_alpha": alpha}
        )
        made[(head, alpha)] = fit_and_export(root, f"{head}-{alpha}", text)
    return made
