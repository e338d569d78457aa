"""torchrun data parallelism on CPU (gloo): real launcher, real processes, real collectives.

Two ranks must train the model one process trains on the same global batch, evaluate to the same perplexity, come
back from a killed rank (``--max-restarts`` or ``--resume``) where the uninterrupted run ends, and meet across two
"machines" (torchrun's c10d rendezvous on 127.0.0.1)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from conftest import ROOT, make_sentences, tiny_config_text, write_corpus
from safetensors.torch import load_file

from benchmarks.torchrun import TORCHRUN, lm_train_fit, run_fit, worker_pid

pytestmark = pytest.mark.slow  # torchrun and its ranks


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ddp")
    return {
        "train": write_corpus(root / "train.txt", make_sentences(160, seed=1)),
        "valid": write_corpus(root / "valid.txt", make_sentences(30, seed=2)),
        "test": write_corpus(root / "test.txt", make_sentences(30, seed=3)),
    }


def config(tmp_path: Path, corpus, mode: str, head: str, **sections) -> Path:
    # 160 sentences in global batches of 8: 20 steps an epoch; no dropout, so only NCE's noise is random. SGD, since
    # Adam divides a gradient by its own size: the last-bit differences of a sum taken in another order would be
    # magnified for parameters whose gradient is nearly zero
    base = {
        "model": {"dropout": 0.0},
        "optimizer": {"name": "sgd", "lr": 1.0},
        "train": {"epochs": 1, "batch_size": 8, "eval_batch_size": 4},
    }
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    path = tmp_path / f"{mode}-{head}-{len(list(tmp_path.glob('*.toml')))}.toml"
    path.write_text(tiny_config_text(corpus, mode, head, **base))
    return path


def fit(config: Path, run: Path, *sets: str) -> dict:
    return run_fit(lm_train_fit(config, run, *sets), run)


def torchrun(config: Path, run: Path, *launcher: str, nproc: int = 2, wait: bool = True, env: dict | None = None):
    command = lm_train_fit(config, run, launcher=list(launcher), nproc=nproc)
    if wait:
        return run_fit(command, run, env=env)
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


# Loaded by every Python process of a run (as sitecustomize): at exit, each worker writes the names of its threads
EXIT_THREADS = """
import atexit, os

def write_threads():
    tasks = os.listdir("/proc/self/task")
    names = sorted(open(f"/proc/self/task/{task}/comm").read().strip() for task in tasks)
    with open(os.path.join(os.environ["EXIT_THREADS_DIR"], "rank" + os.environ["RANK"]), "w") as f:
        f.write("\\n".join(names))

if "RANK" in os.environ:
    atexit.register(write_threads)
"""


def threads_at_exit(tmp_path: Path) -> tuple[dict, Path]:
    """The environment that makes each worker of a run write its threads at exit into the returned folder."""
    hook, folder = tmp_path / "exit-hook", tmp_path / "exit-threads"
    hook.mkdir()
    folder.mkdir()
    (hook / "sitecustomize.py").write_text(EXIT_THREADS)
    pythonpath = os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": pythonpath, "EXIT_THREADS_DIR": str(folder)}, folder


def weights(run: Path) -> dict:
    latest = (run / "checkpoints" / "latest").read_text().strip()
    return load_file(run / "checkpoints" / latest / "model.safetensors")


def max_relative_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max() / a[k].abs().max().clamp(min=1e-12)) for k in a)


@pytest.mark.parametrize(
    "mode, head, objective, accumulate",
    [
        ("sentence", "full", "cross_entropy", 1),
        ("stream", "adaptive", "cross_entropy", 1),
        # NCE draws noise per part of the global batch: one process with 2 micro-batches draws what 2 ranks draw
        ("sentence", "full", "nce", 2),
    ],
)
def test_two_ranks_train_what_one_process_trains(tmp_path, corpus, mode, head, objective, accumulate):
    cfg = config(tmp_path, corpus, mode, head, objective={"type": objective, "samples": 20})
    single = fit(cfg, tmp_path / "one", f"train.accumulate={accumulate}")
    env, exit_threads = threads_at_exit(tmp_path)
    ranks = torchrun(cfg, tmp_path / "two", env=env)
    # gloo's threads joined before the interpreter exits: one left alive then can abort a finished run
    threads = {f.name: f.read_text().split("\n") for f in exit_threads.iterdir()}
    assert sorted(threads) == ["rank0", "rank1"] and all(len(names) == 1 for names in threads.values()), threads
    assert ranks["world_size"] == 2 and ranks["tokens_seen"] == single["tokens_seen"]
    assert max_relative_difference(weights(tmp_path / "one"), weights(tmp_path / "two")) < 1e-5
    for split in ("valid", "test"):
        assert ranks[split]["ppl"] == pytest.approx(single[split]["ppl"], rel=1e-6)
        assert ranks[split]["tokens"] == single[split]["tokens"]  # every sentence evaluated once


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_machines_meet_through_c10d_rendezvous(tmp_path, corpus):
    cfg = config(tmp_path, corpus, "sentence", "adaptive")
    single = fit(cfg, tmp_path / "one")
    port = free_port()
    nodes = [
        torchrun(
            cfg,
            tmp_path / "two",
            "--nnodes=2",
            f"--node-rank={rank}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=lmserve-test",
            nproc=1,
            wait=False,
        )
        for rank in (0, 1)
    ]
    for node in nodes:
        out, _ = node.communicate(timeout=300)
        assert node.returncode == 0, out[-3000:]
    result = json.loads((tmp_path / "two" / "results.json").read_text())
    assert result["world_size"] == 2
    assert result["valid"]["ppl"] == pytest.approx(single["valid"]["ppl"], rel=1e-6)
    assert max_relative_difference(weights(tmp_path / "one"), weights(tmp_path / "two")) < 1e-5


@pytest.mark.parametrize("how", ["max-restarts", "resume"])
def test_a_killed_rank_comes_back_and_ends_like_the_uninterrupted_run(tmp_path, corpus, how):
    """Rank 1 killed with -9 in epoch 2: torchrun ``--max-restarts=1`` restarts both ranks from the last checkpoint
    by itself (``--auto-resume``); without it torchrun stops rank 0 too, and ``lm-train fit --resume RUN`` under
    torchrun goes on. Either way the run ends where the uninterrupted one does."""
    cfg = config(tmp_path, corpus, "stream", "full", train={"epochs": 3, "log_interval": 1})
    uninterrupted = torchrun(cfg, tmp_path / "whole")
    run = tmp_path / "killed"
    launcher = ["--standalone", "--max-restarts=1"] if how == "max-restarts" else ["--standalone"]
    proc = torchrun(cfg, run, *launcher, wait=False)
    log, killed, deadline = run / "metrics.jsonl", False, time.monotonic() + 240
    while not killed and time.monotonic() < deadline and proc.poll() is None:
        events = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        if any(e["event"] == "train" and e["epoch"] == 2 and e["batch"] >= 3 for e in events):
            pid = worker_pid(proc.pid, rank=1)
            if pid:
                os.kill(pid, signal.SIGKILL)
                killed = True
        time.sleep(0.02)
    out, _ = proc.communicate(timeout=300)
    assert killed, out[-3000:]
    if how == "max-restarts":
        assert proc.returncode == 0, out[-3000:]
    else:
        assert proc.returncode != 0, out[-3000:]
        fit = ["-m", "lmserve.training.cli", "fit", "--resume", str(run)]
        run_fit([*TORCHRUN, "--standalone", "--nproc-per-node=2", *fit], run, log_name="resumed")
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert [e["checkpoint"] for e in events if e["event"] == "resume"] == ["ckpt-001-000000"]
    resumed = json.loads((run / "results.json").read_text())
    assert resumed["valid"]["ppl"] == pytest.approx(uninterrupted["valid"]["ppl"], rel=1e-6)
    assert resumed["test"]["ppl"] == pytest.approx(uninterrupted["test"]["ppl"], rel=1e-6)
