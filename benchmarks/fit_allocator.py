"""How much of a training run's anonymous memory is the C heap holding freed tensors, what returning it costs, and
what another malloc gives -> fit_allocator.json

    python -m benchmarks.fit_allocator [--tokens 200000] [--rounds 2]

The LibriSpeech LM (configs/librispeech_lm.toml: 2x256 LSTM, adaptive softmax over 50,000 words, sentence batches,
Adam; 2 threads) trained for ``--tokens`` tokens on the prepared gutenberg-large, once with glibc's defaults and
once each with a fixed mmap threshold (``MALLOC_MMAP_THRESHOLD_``) of 1 and 4 MB, the variants taking turns round
after round, and with jemalloc and tcmalloc (Debian's libjemalloc2 and libtcmalloc-minimal4) put in front of glibc's
malloc with ``LD_PRELOAD``. By default the threshold rises to the size of the largest block freed (up to 32 MB), so
the step's big tensors (the dense embedding gradient, the adaptive tail's scores) are carved from the heap, which
their varying sizes fragment and which is never given back; a fixed threshold maps each of them and returns it to
the kernel when freed, at the price of mapping and zeroing fresh pages every step; jemalloc gives freed pages back
after a delay (the same price), tcmalloc keeps them in size classes that the next step reuses. Reports each
variant's median tokens/s and the peak of its process's RSS and anonymous RSS (``benchmarks.common.run_measured``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
from pathlib import Path

from benchmarks.common import ROOT, run_measured, write_result

RUNS = ROOT / "var" / "runs" / "fit_allocator"
LOGS = ROOT / "var" / "logs"
PREPARED = "var/prepared/glarge-w50k"
LIBS = Path("/usr/lib/x86_64-linux-gnu")
VARIANTS = {
    "glibc_default": {},
    "mmap_1mb": {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)},
    "mmap_4mb": {"MALLOC_MMAP_THRESHOLD_": str(4 << 20)},
    "jemalloc": {"LD_PRELOAD": str(LIBS / "libjemalloc.so.2")},
    "tcmalloc": {"LD_PRELOAD": str(LIBS / "libtcmalloc_minimal.so.4")},
}


def fit(name: str, env: dict, tokens: int) -> dict:
    run = RUNS / name
    shutil.rmtree(run, ignore_errors=True)
    command = [sys.executable, "-m", "lmserve.training.cli", "fit", "configs/librispeech_lm.toml", "--out", str(run)]
    for value in (f'data.valid="{PREPARED}:test"', f"train.max_tokens={tokens}", "schedule.start_tokens=0"):
        command += ["--set", value]
    measured = run_measured(command, LOGS / f"fit_allocator-{name}.log", env={**os.environ, **env})
    results = json.loads((run / "results.json").read_text())
    return {**measured, "tokens_per_s": results["tokens_per_s"], "tokens_seen": results["tokens_seen"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if not (ROOT / PREPARED / "manifest.json").exists():
        raise SystemExit(f"{PREPARED}: missing; prepare gutenberg-large with a 50,000-word vocabulary (README)")
    missing = [env["LD_PRELOAD"] for env in VARIANTS.values() if not Path(env.get("LD_PRELOAD", "/")).exists()]
    if missing:
        raise SystemExit(f"{', '.join(missing)}: missing; apt-get install libjemalloc2 libtcmalloc-minimal4")
    runs = {name: [] for name in VARIANTS}
    for _ in range(args.rounds):
        for name, env in VARIANTS.items():
            runs[name].append(fit(name, env, args.tokens))
            print(name, runs[name][-1], flush=True)
    metrics = {}
    for name, measured in runs.items():
        metrics[f"{name}_tokens_per_s"] = statistics.median(m["tokens_per_s"] for m in measured)
        metrics[f"{name}_peak_rss_mb"] = max(m["peak_rss_mb"] for m in measured)
        metrics[f"{name}_peak_anon_mb"] = max(m["peak_anon_mb"] for m in measured)
    for name in list(VARIANTS)[1:]:
        metrics[f"{name}_speed_vs_default"] = metrics[f"{name}_tokens_per_s"] / metrics["glibc_default_tokens_per_s"]
        metrics[f"{name}_anon_saved_mb"] = metrics["glibc_default_peak_anon_mb"] - metrics[f"{name}_peak_anon_mb"]
    write_result("fit_allocator", metrics, runs=runs, tokens=args.tokens, variants=VARIANTS)


if __name__ == "__main__":
    main()
