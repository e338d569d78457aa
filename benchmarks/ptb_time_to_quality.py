"""PTB test perplexity against wall-clock time from the start of ``lm-train fit`` -> ptb_time_to_quality.json

    python -m benchmarks.ptb_time_to_quality [--config configs/ptb_fast.toml] [--set KEY=VALUE ...]

Runs the fast PTB config in its own process, from scratch (the text is prepared into the run directory, which counts).
Every epoch's checkpoint is copied aside as soon as it is written (the run keeps only its latest and best) and
evaluated on the test set afterwards, so each point is (seconds from the start of ``fit`` to that checkpoint, its
test perplexity). Targets: <= 124.7 within 5 minutes (faster-rnnlm's GRU + NCE measured on this machine reaches
124.7 in 610 s) and <= 114.5 within 15 minutes (Zaremba et al.'s small model, 114.5 after 13 epochs).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time

from benchmarks.common import ROOT, write_result

RUN = ROOT / "var" / "runs" / "ptb_time_to_quality"
TARGETS = {"seconds_to_124_7": 124.7, "seconds_to_114_5": 114.5}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/ptb_fast.toml")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = parser.parse_args()
    shutil.rmtree(RUN, ignore_errors=True)
    shutil.rmtree(RUN.with_name(RUN.name + ".epochs"), ignore_errors=True)
    saved = RUN.with_name(RUN.name + ".epochs")
    saved.mkdir(parents=True)
    command = [sys.executable, "-m", "lmserve.training.cli", "fit", args.config, "--out", str(RUN)]
    command += [arg for value in args.set for arg in ("--set", value)]
    start_wall = time.time()
    start = time.perf_counter()
    points = {}
    with (RUN.parent / f"{RUN.name}.log").open("w") as log:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        while True:
            done = proc.poll() is not None
            metrics = RUN / "metrics.jsonl"
            records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
            for record in records:
                name = f"ckpt-{record.get('epoch', 0):03d}-000000"
                if record["event"] == "valid" and name not in points and (RUN / "checkpoints" / name).exists():
                    shutil.copytree(RUN / "checkpoints" / name, saved / name)
                    points[name] = {
                        "epoch": record["epoch"],
                        "seconds": record["time"] - start_wall,
                        "valid_ppl": record["ppl"],
                    }
            if done:
                break
            time.sleep(0.2)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"lm-train fit failed; see {RUN.parent / (RUN.name + '.log')}")
    results = json.loads((RUN / "results.json").read_text())
    for name, point in points.items():
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "lmserve.training.cli",
                "eval",
                "--checkpoint",
                str(saved / name),
                "--file",
                f"{RUN / 'data'}:test",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
        point["test_ppl"] = json.loads(out.stdout)["ppl"]
        print(point, flush=True)
    curve = sorted(points.values(), key=lambda p: p["seconds"])
    reached = {key: next((p["seconds"] for p in curve if p["test_ppl"] <= ppl), None) for key, ppl in TARGETS.items()}
    write_result(
        "ptb_time_to_quality",
        {**reached, "final_test_ppl": results["test"]["ppl"], "wall_s": wall, "tokens_per_s": results["tokens_per_s"]},
        curve=curve,
        config=args.config,
        overrides=args.set,
        targets={"seconds_to_124_7": "<= 300", "seconds_to_114_5": "<= 900"},
    )


if __name__ == "__main__":
    main()
