"""One GPU: fp32 against bf16 autocast on the 2x1024 LibriSpeech LM, then that LM trained under torchrun and NCCL
-> gpu_scale.json

    python -m benchmarks.gpu_scale [--config configs/librispeech_lm_gpu.toml] [--data DIR] [--compare-tokens 4000000]
        [--seconds 330] [--run var/runs/librispeech_lm_gpu]

1. fp32 (TF32 off) against bf16 autocast, same seed and batches, ``--compare-tokens`` tokens each: tokens/s and
   validation perplexity. 2. The LM under ``torchrun --nproc-per-node=1`` (NCCL) in bf16 for about ``--seconds``,
   Adam's rate constant for 40% of it, then linear to 0; checkpoints stay in ``--run``. Needs a CUDA GPU. Figures:
   docs/benchmarks/gpu.md ("One GPU").
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch

from benchmarks.common import ROOT, write_result
from benchmarks.torchrun import lm_train_fit, run_fit
from lmserve.training.config import load_config

RUNS = ROOT / "var" / "runs" / "gpu_scale"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "librispeech_lm_gpu.toml")
    parser.add_argument("--data", help="prepared dataset for train, valid and test (default: the config's)")
    parser.add_argument("--compare-tokens", type=int, default=4_000_000)
    parser.add_argument("--seconds", type=float, default=330.0, help="training time to size the LM's token budget")
    parser.add_argument("--run", type=Path, default=ROOT / "var" / "runs" / "librispeech_lm_gpu")
    parser.add_argument("--name", default="gpu_scale", help="result file name")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more config overrides")
    args = parser.parse_args()
    overrides = [f'data.{split}="{args.data}"' for split in ("train", "valid", "test")] if args.data else []
    overrides += args.set
    if load_config(args.config, overrides).train.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"{args.config} trains on a CUDA GPU, and PyTorch {torch.__version__} sees none here")
    shutil.rmtree(RUNS, ignore_errors=True)
    shutil.rmtree(args.run, ignore_errors=True)

    compare = {}
    for precision in ("fp32", "bf16"):
        sets = [*overrides, f'train.precision="{precision}"', f"train.max_tokens={args.compare_tokens}"]
        sets += ['schedule.type="fixed"', "schedule.decay=1.0"]
        run = RUNS / precision
        compare[precision] = run_fit(lm_train_fit(args.config, run, *sets), run)
        print(precision, {k: compare[precision][k] for k in ("tokens_seen", "tokens_per_s")}, flush=True)

    budget = int(compare["bf16"]["tokens_per_s"] * args.seconds)
    sets = [*overrides, f"train.max_tokens={budget}", f"schedule.start_tokens={int(0.4 * budget)}"]
    start = time.perf_counter()
    lm = run_fit(lm_train_fit(args.config, args.run, *sets, launcher=["--standalone"], nproc=1), args.run)
    wall = time.perf_counter() - start
    print("lm", {k: lm[k] for k in ("tokens_seen", "tokens_per_s")}, flush=True)

    fp32, bf16 = compare["fp32"], compare["bf16"]
    write_result(
        args.name,
        {
            "fp32_tokens_per_s": fp32["tokens_per_s"],
            "bf16_tokens_per_s": bf16["tokens_per_s"],
            "bf16_speedup": bf16["tokens_per_s"] / fp32["tokens_per_s"],
            "compare_tokens": bf16["tokens_seen"],
            "fp32_valid_ppl": fp32["valid"]["ppl"],
            "bf16_valid_ppl": bf16["valid"]["ppl"],
            "nccl_nproc_per_node": 1,
            "nccl_tokens_per_s": lm["tokens_per_s"],
            "nccl_tokens_seen": lm["tokens_seen"],
            "nccl_valid_ppl": lm["valid"]["ppl"],
            "nccl_test_ppl": lm["test"]["ppl"],
            "nccl_wall_s": wall,
        },
        compare={k: {"tokens_seen": v["tokens_seen"], "tokens_per_s": v["tokens_per_s"]} for k, v in compare.items()},
        lm_results=lm,
        config=str(args.config.relative_to(ROOT)),
        run=str(args.run),
        overrides=overrides,
        nccl_version=".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
    )


if __name__ == "__main__":
    main()
