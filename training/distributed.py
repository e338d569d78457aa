"""Data-parallel training across processes, GPUs and machines with ``torch.distributed``, launched by ``torchrun``.

``torchrun`` starts one process per device and tells each its place in environment variables (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR/PORT); ``setup`` joins the process group from them: gloo for CPU training, NCCL for GPUs.
Without those variables (a plain ``lm-train fit``) there is one process and every collective here is a no-op, so the
training loop has a single shape.

What the loop shares and how: the model is wrapped in DistributedDataParallel, which averages gradients; each step
first sums every rank's sequence and token counts (the loss is divided by the global count, so W ranks compute the
gradient of one process with the same global batch) together with the stop flag (Ctrl-C or SIGTERM on any rank stops
all of them at the same step); validation sums are added up across ranks. Rank 0 alone writes files and prints.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Distributed:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def active(self) -> bool:
        """Whether a process group exists (also under torchrun with one process, for a single-GPU NCCL run)."""
        return dist.is_available() and dist.is_initialized()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over ranks, in float64 (counts and log-likelihood sums stay exact)."""
        if not self.active:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor)
        return tensor.tolist()

    def barrier(self) -> None:
        if self.active:
            dist.barrier(device_ids=[self.device.index] if self.device.type == "cuda" else None)

    def broadcast_object(self, value):
        """Rank 0's ``value`` on every rank."""
        if not self.active:
            return value
        holder = [value]
        dist.broadcast_object_list(holder, src=0, device=self.device if self.device.type == "cuda" else None)
        return holder[0]

    def close(self) -> None:
        """Leave the process group, joining its backend's threads; drop every DistributedDataParallel wrapper
        first, since its reducer holds the group (and gloo's threads) alive past this call."""
        if self.active:
            dist.destroy_process_group()


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def setup(device: torch.device) -> Distributed:
    """Join the process group when started by torchrun; ``device`` "cuda" becomes this rank's GPU (LOCAL_RANK)."""
    if not launched_by_torchrun():
        return Distributed(device=device)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        # Imported before the group exists, not by DistributedDataParallel after: once torch._dynamo is imported
        # after it, destroy_process_group no longer frees the group (torch 2.13; held from C++), so gloo's threads
        # outlive close() into the interpreter's exit, where one that then needs the GIL aborts the process
        # (pytorch/pytorch#179291; seen as "terminate called without an active exception" after a finished run)
        importlib.import_module("torch._dynamo")  # not `import torch._dynamo`: that binds a local `torch`

        # The rendezvous store outlives a restart of the workers (torchrun --max-restarts), and the addresses the ranks
        # of a failed attempt published in it may be read by the next one ("connection refused"; pytorch/pytorch
        # #167288): each attempt keeps its keys under its own prefix.
        store, _, _ = next(dist.rendezvous("env://"))
        store = dist.PrefixStore(f"lmserve/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            store=store,
            rank=rank,
            world_size=world,
            device_id=device if device.type == "cuda" else None,
        )
    return Distributed(rank, world, local_rank, device)


def step_seed(seed: int, epoch: int, step: int, part: int) -> int:
    """The RNG seed of one micro-batch (dropout masks, noise samples): a function of where it is in training and of
    its part of the global batch, not of which rank trains it. Each rank thus draws from its own stream, a resumed
    run draws what the uninterrupted one drew, and W ranks draw what one process with accumulate = W draws."""
    return int(np.random.SeedSequence([seed, epoch, step, part]).generate_state(1, np.uint64)[0] >> 1)
