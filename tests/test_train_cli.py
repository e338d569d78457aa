"""``lm-train fit`` / ``eval`` end to end on generated corpora, including kill -9, Ctrl-C and --resume."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import make_sentences, tiny_config_text, write_corpus
from safetensors.torch import load_file

from lmserve.training.checkpoint import resolve_checkpoint
from lmserve.training.cli import main
from lmserve.training.config import Config, ScheduleConfig
from lmserve.training.model import LSTMLM
from lmserve.training.trainer import build_scheduler


def read_jsonl(path: Path) -> list[dict]:
    """Complete lines only: a running process may be half-way through writing the last one."""
    return [json.loads(line) for line in path.read_text().split("\n")[:-1]]


@pytest.mark.slow  # trains for epochs
@pytest.mark.parametrize(("mode", "head"), [("stream", "full"), ("sentence", "adaptive"), ("sentence", "full")])
def test_fit_writes_checkpoints_metrics_curves_and_results(tmp_path, write_config, capsys, mode, head):
    run = tmp_path / "run"
    assert main(["fit", str(write_config(mode, head)), "--out", str(run)]) == 0
    results = json.loads((run / "results.json").read_text())
    assert results == json.loads(capsys.readouterr().out)
    assert results["stopped"] == "epochs" and results["epochs"] == 3
    assert results["test"]["ppl"] < 25 and results["valid"]["oov_targets"] == 1  # 40 words + specials
    events = read_jsonl(run / "metrics.jsonl")
    valid = [e["ppl"] for e in events if e["event"] == "valid"]
    assert len(valid) == 3 and valid[-1] < valid[0]
    assert {e["event"] for e in events} >= {"data", "train", "valid", "test"}
    assert {e["split"]: e["oov_rate"] > 0 for e in events if e["event"] == "data"} == {
        "train": False,
        "valid": True,
        "test": False,
    }
    assert (run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    checkpoints = run / "checkpoints"
    kept = sorted(p.name for p in checkpoints.iterdir() if p.is_dir())
    assert (checkpoints / "latest").read_text().strip() == "ckpt-003-000000" and len(kept) <= 2
    assert sorted(p.name for p in (checkpoints / "ckpt-003-000000").iterdir()) == [
        "config.json",
        "model.safetensors",
        "state.json",
        "trainer.safetensors",
        "vocab.tsv",
    ]
    assert not list(checkpoints.glob(".*"))  # no temporary leftovers


@pytest.mark.slow  # trains for epochs
def test_eval_reproduces_the_run_and_reports_oov_and_log_z(tmp_path, write_config, tiny_corpus, capsys):
    run = tmp_path / "run"
    main(["fit", str(write_config("sentence", "adaptive")), "--out", str(run)])
    results = json.loads(capsys.readouterr().out)
    assert main(["eval", "--checkpoint", str(run), "--file", str(tiny_corpus["valid"])]) == 0
    ev = json.loads(capsys.readouterr().out)
    assert ev["mode"] == "sentence"
    assert ev["ppl"] == pytest.approx(results["valid"]["ppl"], rel=1e-9)
    assert ev["oov_targets"] == 1 and ev["oov_rate"] > 0 and ev["ppl_no_oov"] != ev["ppl"]
    assert ev["logz_std"] > 0
    main(["eval", "--checkpoint", str(run), "--file", str(tiny_corpus["valid"]), "--mode", "stream"])
    stream = json.loads(capsys.readouterr().out)
    assert stream["mode"] == "stream" and stream["ppl"] != ev["ppl"]


@pytest.mark.slow  # trains for epochs
def test_self_normalised_run_has_smaller_log_z(tmp_path, write_config, capsys):
    logz = {}
    for alpha in (0.0, 1.0):
        main(["fit", str(write_config(objective={"selfnorm_alpha": alpha})), "--out", str(tmp_path / str(alpha))])
        logz[alpha] = json.loads(capsys.readouterr().out)["test"]["logz_mean"]
    assert abs(logz[1.0]) < 0.5 < abs(logz[0.0])


@pytest.mark.slow  # trains for epochs
def test_token_budget_early_stopping_and_plateau(tmp_path, write_config, capsys):
    main(["fit", str(write_config(train={"max_tokens": 300, "epochs": 5})), "--out", str(tmp_path / "a")])
    results = json.loads(capsys.readouterr().out)
    # the budget ran out part-way through epoch 1: no epoch is complete, the checkpoint holds the position
    assert results["stopped"] == "token budget" and results["epochs"] == 0 and 300 <= results["tokens_seen"] < 400
    # lr 0: validation perplexity never improves, so patience 2 stops after epoch 3 of 10
    cfg = write_config(optimizer={"name": "sgd", "lr": 0.0}, train={"epochs": 10, "early_stop_patience": 2})
    main(["fit", str(cfg), "--out", str(tmp_path / "b")])
    results = json.loads(capsys.readouterr().out)
    assert results["epochs"] == 3 and results["stopped"].startswith("early stop")


@pytest.mark.slow  # three runs
@pytest.mark.parametrize("mode", ["stream", "sentence"])
def test_a_budget_spent_mid_epoch_is_extended_into_unseen_text(tmp_path, write_config, capsys, mode):
    """Raising train.max_tokens on a run its budget stopped part-way through an epoch reads on from where it stopped
    (with the streams' carried state): the weights are those of one run with the larger budget, not of a run that
    read the epoch's first batches twice."""
    cfg = write_config(mode=mode, optimizer={"name": "adam", "lr": 0.01}, train={"max_tokens": 300, "epochs": 1})
    main(["fit", str(cfg), "--out", str(tmp_path / "stopped")])
    assert main(["fit", "--resume", str(tmp_path / "stopped"), "--set", "train.max_tokens=900"]) == 0
    once = write_config(mode=mode, optimizer={"name": "adam", "lr": 0.01}, train={"max_tokens": 900, "epochs": 1})
    main(["fit", str(once), "--out", str(tmp_path / "once")])
    capsys.readouterr()
    latest = [
        load_file(str(resolve_checkpoint(tmp_path / run, "latest") / "model.safetensors"))
        for run in ("stopped", "once")
    ]
    assert latest[0].keys() == latest[1].keys()
    for name in latest[0]:
        assert torch.equal(latest[0][name], latest[1][name]), name


@pytest.mark.slow  # trains for epochs
def test_a_finished_run_is_extended_and_annealed_by_resume_with_set(tmp_path, write_config, capsys):
    run = tmp_path / "run"
    cfg = write_config(optimizer={"name": "adam", "lr": 0.01}, train={"max_tokens": 300, "epochs": 1})
    main(["fit", str(cfg), "--out", str(run)])
    first = json.loads(capsys.readouterr().out)
    assert first["stopped"] == "token budget"
    # the model and the data position are the checkpoint's: changing what they mean is refused, naming the key
    assert main(["fit", "--resume", str(run), "--set", "model.hidden_size=8"]) == 2
    assert "cannot change model.hidden_size" in capsys.readouterr().err
    assert (
        main(["fit", "--resume", str(run), "--set", "schedule.type=linear", "--set", "schedule.start_tokens=999"]) == 2
    )
    assert "train.max_tokens > schedule.start_tokens" in capsys.readouterr().err
    extend = ["--set", "train.epochs=3", "--set", "train.max_tokens=1500", "--set", "schedule.type=linear"]
    extend += ["--set", f"schedule.start_tokens={first['tokens_seen']}", "--set", "schedule.decay=0.1"]
    extend += ["--set", "train.log_interval=1"]
    assert main(["fit", "--resume", str(run), *extend]) == 0
    extended = json.loads(capsys.readouterr().out)
    assert extended["stopped"] == "token budget" and 1500 <= extended["tokens_seen"] < 1700
    assert extended["valid"]["ppl"] < first["valid"]["ppl"]
    events = read_jsonl(run / "metrics.jsonl")
    resumed_at = next(i for i, e in enumerate(events) if e["event"] == "resume")
    assert events[resumed_at]["set"] == extend[1::2]
    # each step's lr falls in a straight line with the tokens seen before it: 0.01 at the old budget, 0.001 at 1500
    steps = [e for e in events[resumed_at:] if e["event"] == "train"]
    before = [first["tokens_seen"]] + [e["tokens_seen"] for e in steps[:-1]]
    assert len(steps) > 5
    for e, seen in zip(steps, before, strict=True):
        expected = 0.01 * (1 - 0.9 * (seen - first["tokens_seen"]) / (1500 - first["tokens_seen"]))
        assert e["lr"] == pytest.approx(expected, rel=1e-9)
    assert json.loads((run / "config.json").read_text())["schedule"]["type"] == "linear"


def test_learning_rate_schedules():
    def lrs(schedule: ScheduleConfig, valid_ppls):
        cfg = Config(schedule=schedule)
        optimizer = torch.optim.SGD(LSTMLM(10, cfg.model, cfg.head).parameters(), lr=1.0)
        scheduler = build_scheduler(optimizer, cfg)
        seen = [optimizer.param_groups[0]["lr"]]
        for ppl in valid_ppls:
            optimizer.step()
            scheduler.step(ppl) if schedule.type == "plateau" else scheduler.step()
            seen.append(optimizer.param_groups[0]["lr"])
        return seen

    # Zaremba: epochs 1-4 at lr 1, then halved every epoch
    assert lrs(ScheduleConfig(type="fixed", decay=0.5, start_epoch=4), [0] * 6) == [1, 1, 1, 1, 0.5, 0.25, 0.125]
    assert lrs(ScheduleConfig(type="plateau", decay=0.25), [100, 90, 95, 80, 80]) == [1, 1, 1, 0.25, 0.25, 0.0625]


@pytest.mark.slow  # trains for epochs
def test_fit_refuses_to_overwrite_a_run_and_reports_config_errors(tmp_path, write_config, capsys):
    run = tmp_path / "run"
    cfg = write_config(train={"epochs": 1})
    assert main(["fit", str(cfg), "--out", str(run)]) == 0
    assert main(["fit", str(cfg), "--out", str(run)]) == 2
    assert "already has checkpoints; pass --resume" in capsys.readouterr().err
    assert main(["fit", str(cfg), "--out", str(tmp_path / "x"), "--set", "model.hiden=3"]) == 2
    assert "unknown key model.hiden" in capsys.readouterr().err
    assert (
        main(
            [
                "fit",
                str(cfg),
                "--out",
                str(tmp_path / "y"),
                "--set",
                "head.type=adaptive",
                "--set",
                "head.cutoffs=[5000]",
            ]
        )
        == 2
    )
    assert "head.cutoffs" in capsys.readouterr().err
    assert main(["eval", "--checkpoint", str(tmp_path / "nothing"), "--file", str(cfg)]) == 2
    assert "neither a checkpoint" in capsys.readouterr().err


# -- interruptions: real processes, real signals --------------------------------------------------------------


@pytest.fixture(scope="module")
def slow_config(tmp_path_factory) -> Path:
    """Stream mode (so a mid-epoch stop must carry the LSTM state) with epochs long enough to interrupt."""
    root = tmp_path_factory.mktemp("resume")
    corpus = {
        "train": write_corpus(root / "train.txt", make_sentences(1500, seed=4)),
        "valid": write_corpus(root / "valid.txt", make_sentences(50, seed=5)),
        "test": write_corpus(root / "test.txt", make_sentences(50, seed=6)),
    }
    path = root / "config.toml"
    path.write_text(tiny_config_text(corpus, "stream", "full", train={"epochs": 4, "log_interval": 1}))
    return path


@pytest.fixture(scope="module")
def uninterrupted(slow_config, tmp_path_factory) -> dict:
    run = tmp_path_factory.mktemp("uninterrupted") / "run"
    subprocess.run(
        [sys.executable, "-m", "lmserve.training.cli", "fit", str(slow_config), "--out", str(run)],
        check=True,
        capture_output=True,
    )
    return json.loads((run / "results.json").read_text())


def start_and_signal(config: Path, run: Path, epoch: int, sig: int) -> tuple[int, str]:
    """Start a run, send ``sig`` once it is a few batches into ``epoch``; return its exit status and stderr."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmserve.training.cli", "fit", str(config), "--out", str(run)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    log = run / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if log.exists() and any(
            e["event"] == "train" and e["epoch"] == epoch and e["batch"] >= 3 for e in read_jsonl(log)
        ):
            proc.send_signal(sig)
            break
        time.sleep(0.02)
    _, stderr = proc.communicate(timeout=120)
    return proc.returncode, stderr.decode()


def resume(run: Path) -> dict:
    subprocess.run(
        [sys.executable, "-m", "lmserve.training.cli", "fit", "--resume", str(run)], check=True, capture_output=True
    )
    return json.loads((run / "results.json").read_text())


@pytest.mark.slow  # trains for epochs
def test_kill_9_during_epoch_3_then_resume_ends_like_an_uninterrupted_run(slow_config, uninterrupted, tmp_path):
    run = tmp_path / "run"
    status, _ = start_and_signal(slow_config, run, epoch=3, sig=signal.SIGKILL)
    assert status == -signal.SIGKILL
    assert (run / "checkpoints" / "latest").read_text().strip() == "ckpt-002-000000"
    assert not (run / "results.json").exists()
    resumed = resume(run)
    assert resumed["valid"]["ppl"] == pytest.approx(uninterrupted["valid"]["ppl"], rel=1e-9)
    assert resumed["test"]["ppl"] == pytest.approx(uninterrupted["test"]["ppl"], rel=1e-9)
    assert any(e["event"] == "resume" for e in read_jsonl(run / "metrics.jsonl"))


@pytest.mark.slow  # trains for epochs
def test_ctrl_c_saves_mid_epoch_and_resume_ends_like_an_uninterrupted_run(slow_config, uninterrupted, tmp_path):
    run = tmp_path / "run"
    status, stderr = start_and_signal(slow_config, run, epoch=2, sig=signal.SIGINT)
    assert status == 130, stderr[-2000:]
    assert "continue with: lm-train fit --resume" in stderr
    latest = (run / "checkpoints" / "latest").read_text().strip()
    assert latest.startswith("ckpt-001-") and latest != "ckpt-001-000000"  # mid-epoch 2
    from safetensors.torch import load_file

    assert "carried.h" in load_file(run / "checkpoints" / latest / "trainer.safetensors")
    resumed = resume(run)
    assert resumed["valid"]["ppl"] == pytest.approx(uninterrupted["valid"]["ppl"], rel=1e-9)


def test_a_config_that_fails_leaves_no_run_folder(tmp_path, capsys):
    (tmp_path / "empty.toml").write_text("")
    assert main(["fit", str(tmp_path / "empty.toml"), "--out", str(tmp_path / "run")]) == 2
    assert "data.train and data.valid must both be set" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    (tmp_path / "run").mkdir()  # a folder that was there before stays
    assert main(["fit", str(tmp_path / "empty.toml"), "--out", str(tmp_path / "run")]) == 2
    assert (tmp_path / "run").is_dir()
