"""Where a training step's time goes, before and after the fast settings -> step_profile.json

    python -m benchmarks.step_profile [--steps 20] [--threads 2]
    python -m benchmarks.step_profile --gpu --data PREPARED -> step_profile_gpu.json

Each config (``today``: configs/ptb_objectives.toml; the last: configs/ptb_fast.toml) trains ``--steps`` PTB steps
under torch.profiler, split by the trainer's regions (``lstm``, ``head``, ``backward`` split by operator,
``optimizer``); tokens/s are timed in turns (benchmarks.common.time_interleaved). ``--gpu``: configs/librispeech_lm_gpu.toml
on a CUDA GPU, fp32 against bf16 (and bf16 at twice the batch), each region timed by the GPU time of the kernels it
launched, with how busy the GPU was (the union of the kernels' intervals over an unprofiled step's wall time) and the
top kernels. Figures: docs/benchmarks/training-at-scale.md ("Where a step's time goes") and docs/benchmarks/gpu.md.
"""

from __future__ import annotations

import argparse
import itertools
import re
import tempfile
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import ROOT, time_interleaved, write_result
from lmserve.training.config import load_config
from lmserve.training.trainer import Trainer

CONFIGS = {
    "today (full softmax, batch 20, SGD)": ("ptb_objectives.toml", []),
    "+ batch 64": ("ptb_objectives.toml", ["train.batch_size=64"]),
    "+ adaptive softmax": (
        "ptb_objectives.toml",
        ["train.batch_size=64", 'head.type="adaptive"', "head.cutoffs=[2000]"],
    ),
    "ptb_fast (+ Adam)": ("ptb_fast.toml", []),
}
GPU_CONFIGS = {
    "fp32": ("librispeech_lm_gpu.toml", ['train.precision="fp32"']),
    "bf16": ("librispeech_lm_gpu.toml", []),
    "bf16, batches of 1024": ("librispeech_lm_gpu.toml", ["train.batch_size=1024", "optimizer.lr=0.0028"]),
}
REGIONS = ("lstm", "head", "backward", "optimizer")
FORWARD_AND_UPDATE = ("lstm", "head", "optimizer")  # the regions that launch kernels on the main thread
LSTM_BACKWARD = re.compile(r"rnn.*backward|backward.*rnn", re.I)


def run_steps(trainer: Trainer, steps: list) -> None:
    for micro in steps:
        trainer.step(micro, [None], False)
    if trainer.device.type == "cuda":
        torch.cuda.synchronize()  # the steps are done when their kernels are


def cpu_region_ms(events) -> dict:
    """Milliseconds per region of the profiled steps on the CPU: each region's CPU time, and the LSTM's share of the
    backward pass from its own backward operators."""
    totals = {e.key: e.cpu_time_total / 1e3 for e in events}
    lstm_backward = sum(e.self_cpu_time_total for e in events if LSTM_BACKWARD.search(e.key)) / 1e3
    ms = {region: totals.get(region, 0.0) for region in REGIONS}
    ms["backward: lstm"] = lstm_backward
    ms["backward: head and embedding"] = ms.pop("backward") - lstm_backward
    return ms


def gpu_region_ms(trace) -> dict:
    """Milliseconds per region on a GPU, from the profiler's own records (``prof.profiler.kineto_results.events()``):
    each kernel is booked once, to the region that was open on the CPU when it was launched (the launch record shares
    the kernel's correlation id). The operators' lists of kernels cannot be used: the profiler attached some kernels
    to two operators (on the H100 a tiny model's operators held 120% of all kernel time). The backward pass runs on
    autograd's device thread, outside the main thread's ``backward`` region: its kernels are those launched in no
    forward or optimizer region (with the few launched outside every region, the batch's copy to the GPU and the
    gradients' reset), and the LSTM's are those launched inside its backward operators."""
    markers, launches, work = [], {}, []
    for e in trace:
        if e.device_type() == DeviceType.CPU:
            if e.linked_correlation_id() > 0:  # a launch (CUDA runtime call), linked to its operator
                launches[e.correlation_id()] = e.start_ns()
            elif e.name() in FORWARD_AND_UPDATE or LSTM_BACKWARD.search(e.name()):
                markers.append((e.name(), e.start_ns(), e.start_ns() + e.duration_ns()))
        elif e.device_type() == DeviceType.CUDA and not e.is_user_annotation():
            work.append((launches.get(e.correlation_id()), e.duration_ns() / 1e6))
    return book_kernels(markers, work)


def book_kernels(markers: list[tuple[str, int, int]], work: list[tuple[int | None, float]]) -> dict:
    """``work``: (launch time or None, ms) per kernel; ``markers``: (name, start, end) of the regions and the LSTM's
    backward operators. The forward regions, the autograd thread's backward and the update never overlap in time."""
    ms = dict.fromkeys((*FORWARD_AND_UPDATE, "backward: lstm", "backward: head and embedding"), 0.0)
    for launched, kernel_ms in work:
        names = [name for name, start, end in markers if launched is not None and start <= launched <= end]
        region = next((r for r in FORWARD_AND_UPDATE if r in names), None)
        ms[region or ("backward: lstm" if names else "backward: head and embedding")] += kernel_ms
    return ms


def kernels(events) -> list:
    """The GPU's own events: kernels, copies and sets (a region's GPU span is an annotation, not work of its own)."""
    return [e for e in events if e.device_type == DeviceType.CUDA and not e.is_user_annotation]


def top_kernels(averages, total_ms: float, n: int = 10) -> dict[str, float]:
    """The ``n`` kernels that took most of the GPU's time in a profile's ``key_averages()``, each as a share of
    ``total_ms``."""
    top = sorted(kernels(averages), key=lambda e: -e.self_device_time_total)[:n]
    return {e.key[:120]: e.self_device_time_total / 1e3 / total_ms for e in top}


def busy_ms(spans: list[tuple[float, float]]) -> float:
    """Milliseconds in which at least one of these (start, end) microsecond spans ran: their union's length."""
    busy, covered_to = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > covered_to:
            busy += end - max(start, covered_to)
            covered_to = end
    return busy / 1e3


def profile_steps(trainer: Trainer, steps: list) -> dict:
    cuda = trainer.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        run_steps(trainer, steps)
    events = prof.key_averages()
    ms = gpu_region_ms(prof.profiler.kineto_results.events()) if cuda else cpu_region_ms(events)
    total = sum(ms.values())
    if total <= 0:
        raise RuntimeError(f"the profile of {len(steps)} steps on {trainer.device} holds no time in its regions {ms}")
    result = {name: t / total for name, t in ms.items()} | {"profiled_ms_per_step": total / len(steps)}
    if cuda:
        busy = busy_ms([(e.time_range.start, e.time_range.end) for e in kernels(prof.events())])
        result |= {
            "gpu_busy_ms_per_step": busy / len(steps),
            "kernel_overlap": total / busy,
            "top_kernels": top_kernels(events, total),
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gpu", action="store_true", help="the GPU LibriSpeech LM, fp32 and bf16, on a CUDA GPU")
    parser.add_argument("--data", help="--gpu: the prepared dataset to train and validate on")
    args = parser.parse_args()
    if args.gpu and not args.data:
        parser.error("--gpu needs --data PREPARED (a prepared dataset with a 50k vocabulary)")
    torch.set_num_threads(args.threads)
    configs = GPU_CONFIGS if args.gpu else CONFIGS
    data = [f'data.{split}="{args.data}"' for split in ("train", "valid", "test")] if args.gpu else []
    rows, runs = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, (config, sets)) in enumerate(configs.items()):
            cfg = load_config(ROOT / "configs" / config, [*sets, *data, f"train.threads={args.threads}"])
            trainer = Trainer.fresh(cfg, Path(tmp) / str(i))
            start = time.perf_counter()
            steps = list(itertools.islice(trainer.train_batches.steps_of(0), 3 + args.steps))
            build_ms = (time.perf_counter() - start) * 1e3 / len(steps)
            run_steps(trainer, steps[:3])  # warm-up
            timed = steps[3:]
            tokens = sum(m[0].num_tokens for m in timed)
            padded = sum(m[0].targets.numel() for m in timed)
            rows[name] = {
                "profile": profile_steps(trainer, timed),
                "batch_build_ms": build_ms,
                "padding": 1 - tokens / padded,
            }
            runs[name] = (lambda t=trainer, s=timed: run_steps(t, s), tokens)
            print(name, rows[name], flush=True)
        seconds = time_interleaved({name: run for name, (run, _) in runs.items()}, args.rounds)
    for name, (_, tokens) in runs.items():
        rows[name]["tokens_per_s"] = tokens / seconds[name]
        rows[name]["step_ms"] = seconds[name] * 1e3 / args.steps
        rows[name]["batch_build_share"] = rows[name]["batch_build_ms"] / rows[name]["step_ms"]
        if args.gpu:
            rows[name]["gpu_busy"] = rows[name]["profile"]["gpu_busy_ms_per_step"] / rows[name]["step_ms"]
    speed = {name: row["tokens_per_s"] for name, row in rows.items()}
    write_result(
        "step_profile_gpu" if args.gpu else "step_profile",
        {
            **(
                {"speedup_bf16": speed["bf16"] / speed["fp32"]}
                if args.gpu
                else {"speedup_ptb_fast": speed["ptb_fast (+ Adam)"] / speed["today (full softmax, batch 20, SGD)"]}
            ),
            **{f"tokens_per_s: {n}": s for n, s in speed.items()},
            **({f"gpu_busy: {n}": r["gpu_busy"] for n, r in rows.items()} if args.gpu else {}),
        },
        rows=rows,
        threads=args.threads,
        steps=args.steps,
    )


if __name__ == "__main__":
    main()
