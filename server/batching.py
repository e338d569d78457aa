"""Micro-batching: the work of concurrent calls to one model is queued and merged into one engine call.

Why: a scorer call costs per graph run more than per row. One 30-best list is ~25 LSTM steps of a few rows each; 16
lists advance through the same ~25 steps with 16 times the rows, so the steps cost about the same and each list much
less. The same holds for sentences in the ``sentences`` graph.

How: a call's work (its sentences, or its lists) is an item in the queue of its model. A model with nothing running
starts an item at once, so a lone caller waits for nothing. While a batch of the model is running, items wait for a
free scoring worker (a thread, or a process: ``server.engine``); the worker then waits up to ``max_wait`` until a
fair share of the model's calls has queued (those queued and running, divided by the scoring workers), and takes
items up to that share and up to ``max_batch_tokens`` (an item bigger than that leaves alone). Without the share,
one worker would take nearly every call in one big batch and the other would trickle through the few left (measured
at concurrency 32 on 2 threads: batches of 17-32 calls beside batches of 3-8); with it, the workers carry even
batches. The share counts the calls of the model lately (their peak, decaying by 2% a batch), not only those in the
server at the moment: the callers of a batch that just finished are on their way back (answer, client, next request:
about 12 ms at concurrency 32 on 2 cores), and counting only those present splits 32 callers into three groups of
about 11 that take turns on 2 workers. The wait comes after the worker is free, so that it can include their return.
The price: when the load falls, a worker that finds another batch running waits the whole ``max_wait`` for a share
of the old peak until the peak has decayed (from 32 calls to 8 in about 70 batches).
Measured at concurrency 32 with 2 scoring processes (15-s runs; BENCHMARKS.md, "Serving"): taking only what was
there gave batches of 9.7 calls on average, waiting up to 10 ms for a share of the peak about 13, and 6-16% more lists
a second (a list cost the engine 6.2 ms of CPU in batches of 10, 4.7 ms in batches of 16, while small calls still
read their tails through the ``sentences`` graph).

The engine runs the merged work once; the results are split back by item. When a merged call fails, its items run
again one by one, so a request that breaks the engine fails alone. A call cancelled (client gone, deadline passed)
while queued leaves the queue and is not scored; one whose deadline passes in the queue gets :class:`Expired`.

Queues are per model *object*: after a hot reload, calls that resolved the old models batch with each other on the
old models, and new calls on the new ones; a queue (and its peak) disappears when it is empty and nothing of it
runs.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field

from lmserve.server.metrics import Metrics

PEAK_DECAY = 0.98  # a falling load is followed within about 50 batches


class Budget:
    """Room for work in flight, in estimated bytes, shared by the calls of a server: a call takes its share before
    its work and gives it back once its answer is made, and a call that does not fit waits its turn (first come,
    first served: a big call is not overtaken for ever by small ones). A call larger than the whole budget runs
    alone. Why: the engine's workers finish steps faster than the event loop turns their results into answers, and
    without a bound the results of every open stream could wait in memory at once."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.used = 0
        self.waiting: deque[tuple[int, asyncio.Future]] = deque()

    @contextlib.asynccontextmanager
    async def hold(self, amount: int):
        amount = min(amount, self.capacity)
        if self.waiting or self.used + amount > self.capacity:
            entry = (amount, asyncio.get_running_loop().create_future())
            self.waiting.append(entry)
            try:
                await entry[1]
            except BaseException:  # cancelled (deadline, client gone) while waiting, or just as its turn came
                if entry in self.waiting:
                    self.waiting.remove(entry)
                    self._wake()
                elif entry[1].done() and not entry[1].cancelled():
                    self._give_back(amount)
                raise
        else:
            self.used += amount
        try:
            yield
        finally:
            self._give_back(amount)

    def _give_back(self, amount: int) -> None:
        self.used -= amount
        self._wake()

    def _wake(self) -> None:
        while self.waiting and self.used + self.waiting[0][0] <= self.capacity:
            amount, future = self.waiting.popleft()
            if future.done():  # its caller was cancelled while it waited
                continue
            self.used += amount
            future.set_result(None)


class Expired(Exception):
    """The call's deadline passed while its work waited in the queue."""


@dataclass(eq=False)
class _Item:
    work: Sequence  # one call's sentences or lists
    tokens: int
    arrived: float  # loop time
    deadline: float | None  # loop time
    future: asyncio.Future


@dataclass(eq=False)
class _Queue:
    model: object
    items: deque[_Item] = field(default_factory=deque)
    tokens: int = 0
    running: int = 0  # batches of this queue in the pool
    running_calls: int = 0  # items in them
    company: asyncio.Event = field(default_factory=asyncio.Event)  # set when a call queues
    drainer: asyncio.Task | None = None
    peak: float = 0.0  # the most calls (queued and running) seen lately; decays by PEAK_DECAY a batch


class Batcher:
    """One kind of work (``run(model, merged_work) -> one result per work element``) over all models.

    ``merge=False`` keeps the queue and the thread limit but gives every call a batch of its own: the "batching off"
    switch, so that an on/off comparison differs only in the merging."""

    def __init__(
        self,
        kind: str,
        run: Callable[[object, list], list],
        pool: Executor,
        slots: asyncio.Semaphore,
        workers: int,
        max_batch_tokens: int,
        max_wait: float,
        merge: bool = True,
        metrics: Metrics | None = None,
    ):
        self.kind = kind
        self.run = run
        self.pool = pool
        self.slots = slots  # shared by the batchers of a server: at most one batch per scoring thread
        self.workers = workers  # the semaphore's count
        self.max_batch_tokens = max_batch_tokens
        self.max_wait = max_wait
        self.merge = merge
        self.metrics = metrics
        self.queues: dict[int, _Queue] = {}  # by id(model); a queue holds its model, so the id stays its own
        self.batches = 0  # batches run, and calls in them: tests and benchmarks read the merging off these
        self.calls = 0

    async def submit(self, model: object, work: Sequence, tokens: int, timeout: float | None = None) -> list:
        """The results of ``work`` (one per element), scored with other calls' work to ``model`` when they meet;
        ``timeout``: seconds left to the call's deadline."""
        loop = asyncio.get_running_loop()
        queue = self.queues.get(id(model))
        if queue is None:
            queue = self.queues[id(model)] = _Queue(model)
        now = loop.time()
        item = _Item(work, tokens, now, None if timeout is None else now + timeout, loop.create_future())
        queue.items.append(item)
        queue.tokens += tokens
        self._depth(1)
        queue.peak = max(queue.peak, len(queue.items) + queue.running_calls)
        queue.company.set()  # a worker gathering a batch counts again
        if queue.drainer is None or queue.drainer.done():
            queue.drainer = asyncio.create_task(self._drain(queue))
        try:
            return await item.future
        except asyncio.CancelledError:
            if item in queue.items:  # still queued: leave, so that nobody scores it
                queue.items.remove(item)
                queue.tokens -= item.tokens
                self._depth(-1)
            raise

    async def _drain(self, queue: _Queue) -> None:
        loop = asyncio.get_running_loop()
        while queue.items:
            await self.slots.acquire()
            if self.merge and queue.running:
                await self._gather(queue, loop.time() + self.max_wait)
            batch = self._take(queue, loop.time())
            queue.peak *= PEAK_DECAY
            if not batch:
                self.slots.release()
                continue
            queue.running += 1
            queue.running_calls += len(batch)
            asyncio.create_task(self._run(queue, batch))
        self._forget_if_idle(queue)

    async def _gather(self, queue: _Queue, until: float) -> None:
        """Wait, up to loop time ``until``, for a fair share of the model's calls or a full token budget to queue."""
        loop = asyncio.get_running_loop()
        while queue.items and queue.tokens < self.max_batch_tokens and len(queue.items) < self._share(queue):
            delay = until - loop.time()
            if delay <= 0:
                return
            queue.company.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(queue.company.wait(), delay)

    def _share(self, queue: _Queue) -> int:
        """Calls per batch when the model's calls (queued and running, or as many as lately) are spread over the
        workers."""
        if not self.merge:
            return 1
        return -(-max(len(queue.items) + queue.running_calls, int(queue.peak)) // self.workers)

    def _take(self, queue: _Queue, now: float) -> list[_Item]:
        """Items from the front, up to the token budget and the fair share (at least one); expired ones fail on the
        way."""
        share = self._share(queue)
        batch, tokens = [], 0
        while queue.items:
            item = queue.items[0]
            if batch and (len(batch) >= share or tokens + item.tokens > self.max_batch_tokens):
                break
            queue.items.popleft()
            queue.tokens -= item.tokens
            self._depth(-1)
            if item.deadline is not None and now >= item.deadline:
                item.future.set_exception(Expired(f"the deadline passed after {now - item.arrived:.3f} s in the queue"))
                continue
            batch.append(item)
            tokens += item.tokens
        return batch

    async def _run(self, queue: _Queue, batch: list[_Item]) -> None:
        try:
            if self.metrics:
                self.metrics.batch_calls.labels(self.kind).observe(len(batch))
                self.metrics.batch_tokens.labels(self.kind).observe(sum(i.tokens for i in batch))
            self.batches += 1
            self.calls += len(batch)
            loop = asyncio.get_running_loop()
            works = [i.work for i in batch]
            results = await loop.run_in_executor(self.pool, score_together, self.run, queue.model, works)
            for item, result in zip(batch, results, strict=True):
                if item.future.done():  # cancelled while it ran
                    continue
                if isinstance(result, BaseException):
                    item.future.set_exception(result)
                else:
                    item.future.set_result(result)
        except BaseException as e:  # the pool is shut down, or this task is cancelled: nobody may wait forever
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(e if isinstance(e, Exception) else RuntimeError("scoring stopped"))
            raise
        finally:
            self.slots.release()
            queue.running -= 1
            queue.running_calls -= len(batch)
            self._forget_if_idle(queue)

    def _forget_if_idle(self, queue: _Queue) -> None:
        if not queue.items and not queue.running and self.queues.get(id(queue.model)) is queue:
            del self.queues[id(queue.model)]

    def _depth(self, change: int) -> None:
        if self.metrics:
            self.metrics.queue_depth.labels(self.kind).inc(change)


def score_together(run: Callable[[object, list], list], model: object, works: list[Sequence]) -> list[list | Exception]:
    """In a scoring thread or process (module-level, so that it pickles): all ``works`` in one engine call, split
    back; when that fails, each work alone, so that a work that breaks the engine fails alone."""
    try:
        merged = run(model, [x for work in works for x in work])
    except Exception as e:
        if len(works) == 1:
            return [e]
        return [_alone(run, model, work) for work in works]
    results, start = [], 0
    for work in works:
        results.append(merged[start : start + len(work)])
        start += len(work)
    return results


def _alone(run: Callable[[object, list], list], model: object, work: Sequence) -> list | Exception:
    try:
        return run(model, list(work))
    except Exception as e:
        return e
