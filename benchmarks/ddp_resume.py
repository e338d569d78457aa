"""kill -9 of one rank in epoch 2 of a 2-rank torchrun run, then resume under torchrun -> ddp_resume.json

    python -m benchmarks.ddp_resume

configs/ptb_fast.toml made small (2x100 LSTM, 3 epochs, one thread per rank) is trained three times by
``torchrun --nproc-per-node=2``: uninterrupted; killed (SIGKILL to rank 1 a hundred steps into epoch 2, which makes
torchrun stop rank 0 too) and then continued by ``torchrun ... lm-train fit --resume RUN``; and killed the same way
under ``torchrun --max-restarts=1`` running ``lm-train fit CONFIG --out RUN --auto-resume``, which restarts both ranks
from the last checkpoint by itself. All three must end with the same validation perplexity.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time

from benchmarks.common import ROOT, write_result
from benchmarks.ddp_cpu import ptb_dataset
from benchmarks.torchrun import TORCHRUN, lm_train_fit, run_fit, worker_pid

CONFIG = ROOT / "configs" / "ptb_fast.toml"
RUNS = ROOT / "var" / "runs" / "ddp_resume"


def kill_rank_in_epoch_2(command: list[str], run) -> tuple[int, dict]:
    """Start ``command``, SIGKILL rank 1 a hundred steps into epoch 2; return torchrun's exit status and where."""
    log = run.parent / f"{run.name}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        killed = None
        while proc.poll() is None and killed is None:
            path = run / "metrics.jsonl"
            records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
            train = [r for r in records if r["event"] == "train" and r["epoch"] == 2]
            if train and train[-1]["batch"] >= 100 and (pid := worker_pid(proc.pid, rank=1)):
                os.kill(pid, signal.SIGKILL)
                killed = train[-1]
            time.sleep(0.05)
        return proc.wait(), killed


def main() -> None:
    shutil.rmtree(RUNS, ignore_errors=True)
    RUNS.mkdir(parents=True)
    data = ptb_dataset()
    sets = [f'data.train="{data}"', f'data.valid="{data}"', f'data.test="{data}"', "train.threads=1"]
    sets += ["model.embedding_size=100", "model.hidden_size=100", "train.epochs=3", "train.log_interval=10"]
    whole = run_fit(lm_train_fit(CONFIG, RUNS / "uninterrupted", *sets, nproc=2), RUNS / "uninterrupted")

    killed = RUNS / "killed_then_resume"
    status, where = kill_rank_in_epoch_2(lm_train_fit(CONFIG, killed, *sets, nproc=2), killed)
    if where is None or status == 0:
        raise SystemExit(f"the run was not killed in epoch 2 (exit status {status})")
    restart_from = (killed / "checkpoints" / "latest").read_text().strip()
    resume = [
        *TORCHRUN,
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "lmserve.training.cli",
        "fit",
        "--resume",
        str(killed),
    ]
    resumed = run_fit(resume, killed, log_name=f"{killed.name}.resumed")

    restarted_run = RUNS / "killed_max_restarts"
    command = lm_train_fit(CONFIG, restarted_run, *sets, launcher=["--standalone", "--max-restarts=1"], nproc=2)
    status2, where2 = kill_rank_in_epoch_2(command, restarted_run)
    if where2 is None or status2 != 0:
        raise SystemExit(f"torchrun --max-restarts=1 did not finish after the kill (exit status {status2})")
    restarted = json.loads((restarted_run / "results.json").read_text())

    write_result(
        "ddp_resume",
        {
            "uninterrupted_valid_ppl": whole["valid"]["ppl"],
            "resumed_valid_ppl": resumed["valid"]["ppl"],
            "max_restarts_valid_ppl": restarted["valid"]["ppl"],
            "equal_4_digits": len({f"{r['valid']['ppl']:.4g}" for r in (whole, resumed, restarted)}) == 1,
        },
        killed_at={"epoch": where["epoch"], "batch": where["batch"]},
        killed_max_restarts_at={"epoch": where2["epoch"], "batch": where2["batch"]},
        restarted_from=restart_from,
        torchrun_exit_status_after_kill=status,
        test_ppl={
            "uninterrupted": whole["test"]["ppl"],
            "resumed": resumed["test"]["ppl"],
            "max_restarts": restarted["test"]["ppl"],
        },
    )


if __name__ == "__main__":
    main()
