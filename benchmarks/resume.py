"""kill -9 during epoch 3 of a short PTB run, then ``lm-train fit --resume`` -> resume.json

    python -m benchmarks.resume

Runs configs/ptb_resume.toml twice at the same time (one thread each): once uninterrupted, once killed with SIGKILL
part-way through epoch 3 and resumed from its last checkpoint. Both must end with the same validation perplexity.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time

from benchmarks.common import ROOT, write_result

CONFIG = ROOT / "configs" / "ptb_resume.toml"
RUNS = ROOT / "var" / "runs"


def lm_train(*args: str, log_name: str) -> subprocess.Popen:
    log = (ROOT / "var" / "logs" / f"{log_name}.log").open("a")
    return subprocess.Popen([sys.executable, "-m", "lmserve.training.cli", *args], stdout=log, stderr=log, cwd=ROOT)


def train_records(run) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().split("\n")[:-1] if '"event": "train"' in line]


def main() -> None:
    (ROOT / "var" / "logs").mkdir(parents=True, exist_ok=True)
    plain, killed = RUNS / "resume_uninterrupted", RUNS / "resume_killed"
    for run in (plain, killed):
        shutil.rmtree(run, ignore_errors=True)
    reference = lm_train("fit", str(CONFIG), "--out", str(plain), log_name=plain.name)
    victim = lm_train("fit", str(CONFIG), "--out", str(killed), log_name=killed.name)
    killed_at = None
    while victim.poll() is None:
        records = [r for r in train_records(killed) if r["epoch"] == 3]
        if records and records[-1]["batch"] >= 500:  # about a fifth into epoch 3
            victim.send_signal(signal.SIGKILL)
            killed_at = records[-1]
            break
        time.sleep(0.5)
    victim.wait()
    if killed_at is None:
        raise SystemExit("the run ended before it could be killed in epoch 3")
    restart_from = (killed / "checkpoints" / "latest").read_text().strip()
    resumed = lm_train("fit", "--resume", str(killed), log_name=killed.name)
    for proc in (reference, resumed):
        if proc.wait() != 0:
            raise SystemExit(f"{proc.args} failed, see var/logs/")
    a = json.loads((plain / "results.json").read_text())
    b = json.loads((killed / "results.json").read_text())
    write_result(
        "resume",
        {
            "uninterrupted_valid_ppl": a["valid"]["ppl"],
            "resumed_valid_ppl": b["valid"]["ppl"],
            "abs_difference": abs(a["valid"]["ppl"] - b["valid"]["ppl"]),
            "killed_in_epoch": killed_at["epoch"],
            "killed_after_batch": killed_at["batch"],
        },
        restarted_from=restart_from,
        same_to_4_significant_digits=f"{a['valid']['ppl']:.4g}" == f"{b['valid']['ppl']:.4g}",
        config=str(CONFIG.relative_to(ROOT)),
    )


if __name__ == "__main__":
    main()
