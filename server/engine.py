"""Where the batchers' scorer calls run: threads of the server process, or processes of their own.

Why processes: the engine's own Python (tokenising, prefix trees, n-gram lookups, feature rows) holds the GIL, and
so does the gRPC side (parsing, checking and answering calls). In one process the two take turns on one GIL (py-spy
at concurrency 32: held 60% of the time), and the server uses about 1.4 of 2 cores. With ``engine = "processes"``
each scoring worker is a process with its own GIL and its own copy of the models, and the server process is left
with the gRPC side (plus the cheap, latency-bound work: next-word steps, reranking, answers).

How a model gets there: a :class:`~server.models.ServedModel` pickles as a reference (name, config, threads,
generation, device), and a worker resolves it to its own copy (:func:`resolve`), loading it the first time a
generation of that model reaches it. The workers load the served models when they start (before the port opens);
after a hot reload, each loads the new generation when its first batch of it arrives and drops the old one (measured
in the 10-minute soak with two reloads: RSS of the server and its workers +1.1%). A worker that dies (killed, out of
memory) fails the batches it held; the next batch starts a fresh set of workers.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from lmserve.server.logs import LOGGER

log = logging.getLogger(LOGGER)
CONTEXT = multiprocessing.get_context("spawn")
START_TIMEOUT = 600.0  # seconds for all workers to load the models

_copies: dict[tuple[int, str], object] = {}  # in a worker: (generation, name) -> its own ServedModel


def resolve(name: str, config, threads: int, generation: int, device: str = "cpu"):
    """In a worker: its copy of model ``name`` of ``generation`` (the unpickling end of ``ServedModel``).

    A worker keeps the newest generation it has seen. Loading a newer one drops the older (and hands their pages back
    to the system); a batch of an older generation that arrives later (queued before a reload) gets a copy of its
    own, dropped when the batch is done."""
    from lmserve.server.admin import return_freed_memory
    from lmserve.server.models import ServedModel

    key = (generation, name)
    model = _copies.get(key)
    if model is not None:
        return model
    newest = max((g for g, _ in _copies), default=generation)
    model = ServedModel.load(name, config, threads, generation, device)
    if generation >= newest:
        _copies[key] = model
        old = [k for k in _copies if k[0] < generation]
        for k in old:
            del _copies[k]
        if old:
            return_freed_memory()
    return model


_started: threading.Barrier | None = None  # in a worker: met by every worker of its pool once, at start


def _load(models: list[tuple], started) -> None:
    """A worker's initializer: load the models (``ServedModel.ref()`` of each)."""
    global _started
    _started = started
    from lmserve.server.logs import quiet_onnxruntime

    quiet_onnxruntime()
    for ref in models:
        resolve(*ref)


def _ready() -> int:
    """Returns once every worker of the pool has loaded the models (each holds one of these calls meanwhile)."""
    _started.wait(timeout=START_TIMEOUT)
    return os.getpid()


class ProcessEngine(Executor):
    """``workers`` scoring processes, started (spawned: the server process has gRPC threads, which a fork must not
    copy) with the models that ``models()`` names at the time (``ServedModel.ref()`` of each: references, so that
    the pool does not hold the models themselves after a reload); replaced as a whole when one of them dies."""

    def __init__(self, workers: int, models: Callable[[], list[tuple]]):
        self.workers = workers
        self.models = models
        self.lock = threading.Lock()
        self.pool: ProcessPoolExecutor | None = None

    def start(self) -> list[int]:
        """Start the workers and wait until each has loaded the models; returns their process ids. Blocks."""
        with self.lock:
            self.pool = self._new_pool()
            try:
                return sorted(f.result() for f in [self.pool.submit(_ready) for _ in range(self.workers)])
            except (BrokenProcessPool, threading.BrokenBarrierError) as e:
                self.pool.shutdown(wait=False, cancel_futures=True)
                raise RuntimeError(
                    f"the {self.workers} scoring processes did not all start and load the models within "
                    f"{START_TIMEOUT:.0f} s ({type(e).__name__}; a worker's traceback is above)"
                ) from e

    def _new_pool(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(
            self.workers, CONTEXT, initializer=_load, initargs=(self.models(), CONTEXT.Barrier(self.workers))
        )

    def submit(self, fn, /, *args, **kwargs) -> Future:
        with self.lock:
            try:
                return self.pool.submit(fn, *args, **kwargs)
            except BrokenProcessPool:  # a worker died: its batches failed; later ones get new workers
                log.error("scoring processes replaced", extra={"fields": {"why": "one died", "workers": self.workers}})
                self.pool.shutdown(wait=False, cancel_futures=True)
                self.pool = self._new_pool()
                return self.pool.submit(fn, *args, **kwargs)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self.lock:
            if self.pool is not None:
                self.pool.shutdown(wait=wait, cancel_futures=cancel_futures)
