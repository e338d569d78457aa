"""The training step without launch stalls (``train.compile = "compile" | "cuda_graphs" | "compile_graphs"``).

On a GPU the eager step of the 2x1024 LibriSpeech LM keeps the GPU busy only half the time: the CPU launches many
small kernels, and the step waits for the GPU three times (the boolean mask that drops padding, the adaptive
softmax's ``nonzero`` per tail cluster, the loss's ``.item()``), so the queue of kernels runs dry. A step that
compiles or replays as a whole first needs shapes that are known before it runs and no waits inside it or after it
(its loss stays on the device, :class:`FastStep`), so each batch is *routed* on the CPU, in the prefetch thread, into
static shapes (:class:`Router`):

- every position of the ``[T, B]`` batch is scored and padding counts with weight 0 (no mask indexing);
- in sentence mode T is rounded up to a multiple of :data:`STEP_T` and B padded to ``train.batch_size``: a run meets
  ~20 shapes instead of one per batch length (80 captures or compilations), and pays ~1.5 padded steps a batch
  instead of the 3-4x LSTM work of padding every batch to the longest sentence; stream mode keeps its exact T, since
  padded steps would change the state carried into the next chunk;
- the adaptive softmax's tail clusters get the flat positions of their targets, counted on the CPU, padded to a
  capacity per (T, cluster) that grows by :data:`GROWTH` when a batch needs more: the loss stays exact and the shapes
  settle after a few batches. The step widens every batch of a T to the widest capacities it has met for that T
  (:meth:`RoutedBatch.widened`): batches routed before a capacity grew (those waiting in the prefetch queue, or a
  benchmark's batches routed all at once) would otherwise alternate with the wider ones, each change of shape a new
  capture. Routed in order, gpu_step's 40 batches meet 19 shapes; widened, a second pass over them captures none.

``compile``: :func:`routed_loss` through ``torch.compile`` (AOTAutograd compiles its backward; on a GPU mode
``reduce-overhead`` replays it as CUDA graphs, one per shape; the cuDNN LSTM stays an eager graph break), then
clipping and fused Adam as in the eager step. ``cuda_graphs``: one ``torch.cuda.CUDAGraph`` per T holding forward,
backward, clipping and the capturable Adam update with its learning rate read from a GPU tensor; the first batch of
a shape trains eagerly through the same code (the warm-up a capture needs), later ones are copied into the graph's
static inputs and replayed. The graphs share one memory pool: they never run at once, and what one leaves behind (its
outputs) is read before the next replays. ``compile_graphs``: both, the compiled loss (inductor's default mode, no
CUDA graphs of its own) captured with the LSTM, clipping and Adam in ``cuda_graphs``' graphs. Compile fuses the
head's loss terms but launches the LSTM eagerly, the capture launches nothing but runs the unfused head, and
compile_graphs does both; docs/benchmarks/gpu.md (``gpu_step.json``) times the three against the eager step.

Differences from the eager step: a tail cluster with no target in a batch gets a zero gradient (Adam moves it by its
momentum) where the eager step leaves it out of the update; the bf16 products run on padded shapes, so losses agree
to rounding, not bit for bit. Heads full and adaptive, exact cross-entropy, no dropout (the eager step reseeds it
every step so that a resumed run is exact; a graph's random numbers cannot be reseeded), one process, no accumulation:
``training/config.py`` checks these at start-up.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch

from lmserve.training.batching import Batch
from lmserve.training.config import CAPTURED, COMPILED
from lmserve.training.heads.adaptive import AdaptiveSoftmax
from lmserve.training.model import LSTMLM

STEP_T = 4  # sentence mode: a batch's T is rounded up to a multiple of this
GROWTH = 1.25  # a tail cluster's capacity, when a batch needs more rows than it has


@dataclass
class RoutedBatch:
    """A batch in the static shapes the faster steps score (module docstring); the tail lists have one entry per
    adaptive tail cluster (none for a full softmax)."""

    inputs: torch.Tensor  # [T, B] int64, T and B padded
    weights: torch.Tensor  # [T * B] float32: 1 where a position counts, 0 for padding
    head_index: torch.Tensor  # [T * B] int64: the target's entry in the head softmax (itself, or its cluster's)
    tail_rows: list[torch.Tensor]  # [capacity] int64: flat positions whose target falls in the cluster, then zeros
    tail_targets: list[torch.Tensor]  # [capacity] int64: those targets' ids within the cluster
    tail_weights: list[torch.Tensor]  # [capacity] float32: 1 for a target, 0 for the padding of the capacity
    num_sequences: int
    num_tokens: int

    def tensors(self) -> list[torch.Tensor]:
        return [self.inputs, self.weights, self.head_index, *self.tail_rows, *self.tail_targets, *self.tail_weights]

    def _with(self, tensors: list[torch.Tensor]) -> RoutedBatch:
        k = len(self.tail_rows)
        inputs, weights, head_index, rest = tensors[0], tensors[1], tensors[2], tensors[3:]
        return RoutedBatch(
            inputs, weights, head_index, rest[:k], rest[k : 2 * k], rest[2 * k :], self.num_sequences, self.num_tokens
        )

    def pin_memory(self) -> RoutedBatch:
        return self._with([t.pin_memory() for t in self.tensors()])

    def to(self, device: torch.device) -> RoutedBatch:
        return self._with([t.to(device, non_blocking=True) for t in self.tensors()])

    @property
    def tails(self) -> tuple[int, ...]:
        """Each tail cluster's capacity."""
        return tuple(len(rows) for rows in self.tail_rows)

    def widened(self, tails: tuple[int, ...]) -> RoutedBatch:
        """The same batch with each tail cluster's rows padded up to ``tails`` as the router pads them (position 0,
        weight 0): the same loss in the wider shape."""
        if tails == self.tails:
            return self
        k = len(self.tail_rows)
        rest = [
            torch.nn.functional.pad(t, (0, tails[i % k] - len(t)))
            for i, t in enumerate([*self.tail_rows, *self.tail_targets, *self.tail_weights])
        ]
        return self._with([self.inputs, self.weights, self.head_index, *rest])


class Router:
    """Batches -> :class:`RoutedBatch`; the only writer of the tail capacities (it runs in the prefetch thread, and
    batches reach the step in the order it routed them)."""

    def __init__(self, model: LSTMLM, batch_size: int, eos_id: int, carries_state: bool):
        head = model.head
        self.bounds = head.bounds.cpu().numpy() if isinstance(head, AdaptiveSoftmax) else None
        self.shortlist = head.shortlist if self.bounds is not None else 0
        self.batch_size = batch_size
        self.eos_id = eos_id
        self.carries_state = carries_state
        self.capacity: dict[tuple[int, int], int] = {}  # (T, cluster) -> rows

    def __call__(self, micro: list[Batch]) -> list[RoutedBatch]:
        return [self.route(batch) for batch in micro]

    def route(self, batch: Batch) -> RoutedBatch:
        t, b = batch.inputs.shape
        steps = t if self.carries_state else -(-t // STEP_T) * STEP_T
        inputs = np.full((steps, self.batch_size), self.eos_id, dtype=np.int64)
        targets = np.full((steps, self.batch_size), self.eos_id, dtype=np.int64)
        weights = np.zeros((steps, self.batch_size), dtype=np.float32)
        inputs[:t, :b], targets[:t, :b] = batch.inputs.numpy(), batch.targets.numpy()
        weights[:t, :b] = 1.0 if batch.mask is None else batch.mask.numpy()
        targets, weights = targets.reshape(-1), weights.reshape(-1)
        head_index, tail_rows, tail_targets, tail_weights = targets, [], [], []
        if self.bounds is not None:
            cluster = np.searchsorted(self.bounds, targets, side="right")  # 0 = shortlist, i = tail cluster i
            head_index = np.where(cluster == 0, targets, self.shortlist + cluster - 1)
            for i in range(len(self.bounds) - 1):
                rows = np.flatnonzero((cluster == i + 1) & (weights > 0))
                capacity = self.capacity.get((steps, i), 0)
                if len(rows) > capacity:
                    capacity = self.capacity[steps, i] = int(np.ceil(len(rows) * GROWTH))
                padding = (0, capacity - len(rows))  # rows of position 0 with weight 0
                tail_rows.append(torch.from_numpy(np.pad(rows.astype(np.int64), padding)))
                tail_targets.append(torch.from_numpy(np.pad(targets[rows] - self.bounds[i], padding)))
                tail_weights.append(torch.from_numpy(np.pad(np.ones(len(rows), dtype=np.float32), padding)))
        return RoutedBatch(
            torch.from_numpy(inputs),
            torch.from_numpy(weights),
            torch.from_numpy(np.ascontiguousarray(head_index)),
            tail_rows,
            tail_targets,
            tail_weights,
            batch.num_sequences,
            batch.num_tokens,
        )


def routed_loss(model: LSTMLM, batch: RoutedBatch, h0: torch.Tensor, c0: torch.Tensor, scale: torch.Tensor):
    """(loss to back-propagate, summed NLL, final LSTM state) of a routed batch: the adaptive softmax's NLL is
    ``lse(head) - head[head_index]`` at every position plus ``lse(tail) - tail[target]`` on its cluster's rows, the
    same sums as ``AdaptiveSoftmax.target_terms`` without its data-dependent row sets."""
    hidden, (h, c) = model(batch.inputs, (h0, c0))
    hidden = hidden.reshape(-1, hidden.shape[-1])
    head = model.head
    if isinstance(head, AdaptiveSoftmax):
        logits = head.head(hidden).float()  # the loss in float32 under bf16 autocast, as the head's own
        nll_at = torch.logsumexp(logits, -1) - logits.gather(1, batch.head_index[:, None]).squeeze(1)
        nll = (nll_at * batch.weights).sum()
        for tail, rows, local, weights in zip(
            head.tails, batch.tail_rows, batch.tail_targets, batch.tail_weights, strict=True
        ):
            logits = tail(hidden.index_select(0, rows)).float()
            nll = nll + ((torch.logsumexp(logits, -1) - logits.gather(1, local[:, None]).squeeze(1)) * weights).sum()
    else:
        score, log_norms = head.target_terms(hidden, batch.head_index)
        nll = ((log_norms.sum(-1) - score) * batch.weights).sum()
    return nll * scale, nll.detach(), h.detach(), c.detach()


class FastStep:
    """The step of ``train.compile = compile | cuda_graphs | compile_graphs`` on routed batches: ``(batch, state,
    scale) -> (summed NLL, state to carry)``; the caller sets the learning rate in the optimizer's groups first. The
    NLL is a tensor on the device, not read here: reading it would wait for the step to end, and the GPU would idle
    while the CPU launched the next one (the trainer reads the sum once per log interval: ``StepLosses``)."""

    def __init__(self, mode: str, model: LSTMLM, optimizer: torch.optim.Optimizer, clip_norm: float, bf16: bool):
        self.mode, self.model, self.optimizer, self.clip_norm = mode, model, optimizer, clip_norm
        self.captures = mode in CAPTURED
        self.device = next(model.parameters()).device
        lstm = model.lstm
        self.state_shape = (lstm.num_layers, lstm.hidden_size)
        # a capture must not cache autocast's casts of the weights: the cache would hold the first step's copies
        self.autocast = (
            (lambda: torch.autocast(self.device.type, dtype=torch.bfloat16, cache_enabled=not self.captures))
            if bf16
            else contextlib.nullcontext
        )
        # compile alone replays its own CUDA graphs on a GPU; inside a capture of ours it must not
        self.own_graphs = mode == "compile" and self.device.type == "cuda"
        self.loss = (
            torch.compile(routed_loss, mode="reduce-overhead" if self.own_graphs else None)
            if mode in COMPILED
            else routed_loss
        )
        self.scale = torch.zeros((), device=self.device)
        # T -> each tail cluster's widest capacity so far: every batch of that T is widened to it, so that a batch
        # routed before the router last grew a capacity replays the wider graph instead of capturing its own
        self.widest: dict[int, tuple[int, ...]] = {}
        self.graphs: dict[int, _Graph] = {}  # T -> the graph captured for that T's widest tails
        self.captured = 0  # graphs captured so far, warm-ups included: replays are the steps that captured none
        self.pool = None

    def __call__(self, batch: RoutedBatch, state, scale: float):
        steps = batch.inputs.shape[0]
        widest = self.widest.get(steps, batch.tails)
        widest = self.widest[steps] = tuple(max(w, c) for w, c in zip(widest, batch.tails, strict=True))
        if self.captures:
            graph = self.graphs.get(steps)
            if graph is not None and graph.tails == widest:
                return graph.replay(batch, state, scale, self.optimizer.param_groups[0]["lr"])
        if self.own_graphs:
            torch.compiler.cudagraph_mark_step_begin()  # the previous step's outputs may be overwritten now
        batch = batch.to(self.device).widened(widest)
        nll, state = self._eager(batch, state, scale)
        if self.captures:
            self.graphs[steps] = _Graph(self, batch)
            self.captured += 1
        return nll, state

    def initial_state(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        zeros = torch.zeros(self.state_shape[0], batch_size, self.state_shape[1], device=self.device)
        return zeros, zeros.clone()

    def forward_backward_update(self, batch: RoutedBatch, h0, c0, grads_to_none: bool) -> tuple:
        self.optimizer.zero_grad(set_to_none=grads_to_none)
        with self.autocast():
            loss, nll, h, c = self.loss(self.model, batch, h0, c0, self.scale)
        loss.backward()
        if self.clip_norm:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_norm)
        self.optimizer.step()
        return nll, h, c

    def _eager(self, batch: RoutedBatch, state, scale: float):
        """The step run as it comes (compiled or not) on a batch on the device, on a side stream on a GPU as a
        capture's warm-up must be."""
        self.scale.fill_(scale)
        h0, c0 = state if state is not None else self.initial_state(batch.inputs.shape[1])
        side = torch.cuda.Stream() if self.captures else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            nll, h, c = self.forward_backward_update(batch, h0, c0, grads_to_none=not self.captures)
        if side is not None:
            torch.cuda.current_stream().wait_stream(side)
        return nll.clone(), (h.clone(), c.clone())  # a compiled step's outputs are overwritten by its next replay


class _Graph:
    """One captured step for one shape of routed batch; its inputs are static tensors the batch is copied into.

    Gradients, Adam's state and the parameters must stay where they are across replays, outside the graphs' shared
    pool: the warm-up step allocated them, the graph zeroes the gradients in place, and a capture that moved one is an
    error rather than a silent corruption by another graph's replay."""

    def __init__(self, step: FastStep, batch: RoutedBatch):
        self.tails = batch.tails
        self.step = step
        self.batch = batch  # on the device: the warm-up's batch becomes the graph's static inputs
        self.h0, self.c0 = step.initial_state(batch.inputs.shape[1])
        self.lr = torch.zeros((), device=step.device)
        params = list(step.model.parameters())
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        before = [p.grad.data_ptr() for p in params]
        self.graph = torch.cuda.CUDAGraph()
        groups = step.optimizer.param_groups
        saved_lr = [g["lr"] for g in groups]
        for g in groups:  # captured as a read of self.lr; the checkpoint and logs keep the float
            g["lr"] = self.lr
        try:
            # thread_local: the prefetch thread may pin the next batches' memory while this thread captures
            with torch.cuda.graph(self.graph, pool=step.pool, capture_error_mode="thread_local"):
                self.nll, self.h, self.c = step.forward_backward_update(self.batch, self.h0, self.c0, False)
        finally:
            for g, lr in zip(groups, saved_lr, strict=True):
                g["lr"] = lr
        step.pool = self.graph.pool()
        if [p.grad.data_ptr() for p in params] != before:
            raise RuntimeError(f"train.compile = {step.mode}: the captured backward pass moved a gradient")

    def replay(self, batch: RoutedBatch, state, scale: float, lr: float):
        for static, value in zip(self.batch.tensors(), batch.tensors(), strict=True):
            static[: len(value)].copy_(value, non_blocking=True)
            if len(value) < len(static):  # a narrower tail cluster: the rest is padding (position 0, weight 0)
                static[len(value) :].zero_()
        for static, value in zip((self.h0, self.c0), state or (None, None), strict=True):
            if value is None:
                static.zero_()
            else:
                static.copy_(value)
        self.step.scale.fill_(scale)
        self.lr.fill_(lr)
        self.graph.replay()
        return self.nll.clone(), (self.h.clone(), self.c.clone())
