"""Micro-batching: concurrent calls of a model merge into one engine call and each gets exactly its own results, as
if it had been scored alone; a failing call fails alone; a cancelled or expired call is never scored.

First the batcher itself over a small real engine (reciprocals, whose first call waits at a gate so that others
queue behind it: an event, not a sleep), then the real server on a real port, where merging shows in its metrics."""

import asyncio
import threading
import urllib.request
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from conftest import make_sentences

from lmserve.rescoring.client import hypothesis_list
from lmserve.rescoring.nbest import Hypothesis, NBestEntry
from lmserve.server.batching import PEAK_DECAY, Batcher, Expired, _Queue
from lmserve.server.process import ServerProcess
from lmserve.v1 import lmserve_pb2 as pb
from lmserve.v1.lmserve_pb2_grpc import LMServiceStub


class Reciprocals:
    """An engine: ``1 / x`` of every element of the merged work; it records each call's input, and holds every call at
    ``gate`` until the test opens it, so that the calls submitted meanwhile queue."""

    def __init__(self):
        self.calls: list[list] = []
        self.changed = threading.Condition()
        self.entered = threading.Event()
        self.gate = threading.Event()

    def __call__(self, model, work: list) -> list:
        with self.changed:
            self.calls.append(list(work))
            self.changed.notify_all()
        self.entered.set()
        self.gate.wait(30)
        return [1 / x for x in work]

    def wait_for_calls(self, count: int) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.calls) >= count, 30)


def run_with_batcher(scenario, workers: int = 1, max_batch_tokens: int = 1000, max_wait: float = 0.05, merge=True):
    engine = Reciprocals()
    pool = ThreadPoolExecutor(workers)

    async def main():
        batcher = Batcher("test", engine, pool, asyncio.Semaphore(workers), workers, max_batch_tokens, max_wait, merge)
        result = await scenario(batcher, engine)
        assert not batcher.queues, "an idle batcher keeps no queue"
        return result

    try:
        return asyncio.run(main()), engine
    finally:
        pool.shutdown()


async def behind_a_running_batch(batcher, engine, works: list[list], model="m"):
    """Start one call, wait until the engine runs it, then submit ``works`` (queued behind it): their tasks."""
    first = asyncio.create_task(batcher.submit(model, [1], 1))
    await asyncio.to_thread(engine.entered.wait)
    tasks = [asyncio.create_task(batcher.submit(model, work, len(work))) for work in works]
    await asyncio.sleep(0)  # one turn of the loop: every task runs up to its first await, i.e. is queued
    assert sum(len(q.items) for q in batcher.queues.values()) == len(works)
    return first, tasks


def test_calls_queued_behind_a_running_batch_merge_and_get_their_own_results():
    works = [[i, i + 1] for i in range(2, 20, 2)]

    async def scenario(batcher, engine):
        first, tasks = await behind_a_running_batch(batcher, engine, works)
        engine.gate.set()
        return await first, await asyncio.gather(*tasks)

    (first, results), engine = run_with_batcher(scenario)
    assert first == [1.0]
    assert results == [[1 / x for x in work] for work in works]
    assert engine.calls == [[1], [x for work in works for x in work]]  # one engine call for the nine calls


def test_a_batch_stops_at_the_token_budget():
    works = [[2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]

    async def scenario(batcher, engine):
        first, tasks = await behind_a_running_batch(batcher, engine, works)
        engine.gate.set()
        await first
        return await asyncio.gather(*tasks)

    _, engine = run_with_batcher(scenario, max_batch_tokens=4)
    assert engine.calls == [[1], [2, 3, 4, 5], [6, 7, 8, 9], [10, 11]]


def test_without_merging_every_call_runs_alone():
    works = [[2, 3], [4], [5, 6]]

    async def scenario(batcher, engine):
        first, tasks = await behind_a_running_batch(batcher, engine, works)
        engine.gate.set()
        await first
        return await asyncio.gather(*tasks)

    results, engine = run_with_batcher(scenario, merge=False)
    assert engine.calls == [[1], [2, 3], [4], [5, 6]] and results == [[0.5, 1 / 3], [0.25], [0.2, 1 / 6]]


def test_threads_share_the_calls_evenly():
    """Two threads: with one call running, nine queued ones leave as a batch of five (half of the ten calls of the
    model), not nine on one thread and none on the other; the other four follow when a thread is free."""
    works = [[i] for i in range(2, 11)]

    async def scenario(batcher, engine):
        first, tasks = await behind_a_running_batch(batcher, engine, works)
        await asyncio.to_thread(engine.wait_for_calls, 2)  # the second thread took its share
        engine.gate.set()
        await first
        return await asyncio.gather(*tasks)

    results, engine = run_with_batcher(scenario, workers=2)
    assert engine.calls[:2] == [[1], [2, 3, 4, 5, 6]]
    assert sum(engine.calls[2:], []) == [7, 8, 9, 10]  # in one or two batches, as the threads come free
    assert results == [[1 / x for x in work] for work in works]


def test_a_free_thread_waits_for_a_fair_share_not_for_the_whole_wait():
    """Two threads, max_wait an hour: two of three calls leave at once; the third waits for a second one (half of
    the four calls of the model), and the two leave together as soon as it comes."""

    async def scenario(batcher, engine):
        tasks = [asyncio.create_task(batcher.submit("m", [x], 1)) for x in (2, 3, 4)]
        await asyncio.to_thread(engine.wait_for_calls, 1)
        await asyncio.sleep(0.05)
        assert engine.calls == [[2, 3]] and len(batcher.queues[id("m")].items) == 1  # [4] waits for company
        tasks.append(asyncio.create_task(batcher.submit("m", [5], 1)))
        await asyncio.to_thread(engine.wait_for_calls, 2)
        engine.gate.set()
        return await asyncio.gather(*tasks)

    results, engine = run_with_batcher(scenario, workers=2, max_wait=3600)
    assert engine.calls == [[2, 3], [4, 5]] and results == [[0.5], [1 / 3], [0.25], [0.2]]


def test_the_share_counts_the_calls_of_the_model_lately():
    """Three calls queued and three running make a share of three, unless the model had eight calls lately: then four
    (the callers of a finished batch are on their way back); the peak fades as batches leave."""
    batcher = Batcher("test", Reciprocals(), None, None, 2, 1000, 0.01)
    queue = _Queue("m", deque(range(3)), running_calls=3)
    assert batcher._share(queue) == 3
    queue.peak = 8
    assert batcher._share(queue) == 4
    queue.peak *= PEAK_DECAY**20
    assert batcher._share(queue) == 3


def test_a_call_that_breaks_the_engine_fails_alone():
    works = [[2], [0, 3], [4]]  # 1/0 fails the merged call; run alone, only [0, 3] fails

    async def scenario(batcher, engine):
        first, tasks = await behind_a_running_batch(batcher, engine, works)
        engine.gate.set()
        await first
        return await asyncio.gather(*tasks, return_exceptions=True)

    (good, bad, other), engine = run_with_batcher(scenario)
    assert good == [0.5] and other == [0.25] and isinstance(bad, ZeroDivisionError)
    assert engine.calls == [[1], [2, 0, 3, 4], [2], [0, 3], [4]]


def test_a_cancelled_call_leaves_the_queue_and_an_expired_one_is_not_scored():
    async def scenario(batcher, engine):
        first, (cancelled, kept) = await behind_a_running_batch(batcher, engine, [[7], [8]])
        expired = asyncio.create_task(batcher.submit("m", [9], 1, timeout=0.0))
        cancelled.cancel()
        await asyncio.sleep(0)
        engine.gate.set()
        await first
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        with pytest.raises(Expired, match="deadline passed"):
            await expired
        return await kept

    kept, engine = run_with_batcher(scenario)
    assert kept == [0.125] and engine.calls == [[1], [8]]


def test_an_idle_model_does_not_wait_for_company():
    async def scenario(batcher, engine):
        engine.gate.set()
        return await asyncio.wait_for(batcher.submit("m", [4], 1), timeout=5)  # max_wait is an hour

    result, engine = run_with_batcher(scenario, max_wait=3600)
    assert result == [0.25]


def test_models_batch_apart():
    async def scenario(batcher, engine):
        first, tasks = await behind_a_running_batch(batcher, engine, [[2], [3]], model="old")
        newer = asyncio.create_task(batcher.submit("new", [4], 1))
        engine.gate.set()
        await first
        return await asyncio.gather(*tasks, newer)

    _, engine = run_with_batcher(scenario, workers=1)
    assert sorted(engine.calls[1:]) == [[2, 3], [4]]


# -- the real server ---------------------------------------------------------------------------------------------


def lists(n: int, seed: int) -> list[NBestEntry]:
    """Hypothesis lists sharing prefixes, as decoders make them: a sentence and variants of its end."""
    rng = np.random.default_rng(seed)
    entries = []
    for i, sentence in enumerate(make_sentences(n, seed=seed)):
        words = sentence.split()
        texts = [" ".join([*words[: int(rng.integers(len(words) + 1))], f"w{int(rng.integers(40))}"]) for _ in range(5)]
        entries.append(NBestEntry(f"u{i}", [Hypothesis(t, {"am": float(rng.normal())}) for t in [sentence, *texts]]))
    return entries


@pytest.fixture(scope="module")
def config(bundles, tmp_path_factory):
    """One scoring thread and a long wait for company, so that concurrent calls surely meet."""
    root = tmp_path_factory.mktemp("batching")
    bundle = bundles[("full", 0.0)][1]
    path = root / "serve.toml"
    path.write_text(
        "[server]\nworkers = 1\nmetrics_port = 0\n[batching]\nmax_wait_ms = 100.0\nmax_batch_tokens = 100000\n"
        f'[models.tiny]\nbundle = "{bundle}"\n'
    )
    off = root / "off.toml"
    off.write_text(path.read_text().replace("[batching]\n", "[batching]\nenabled = false\n"))
    return path, off


def batch_counts(server: ServerProcess, kind: str) -> tuple[float, float]:
    """(batches, calls in them) of one kind, from the server's Prometheus metrics."""
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    label = f'{{kind="{kind}"}}'
    return float(samples.get(f"lmserve_batch_calls_count{label}", 0)), float(
        samples.get(f"lmserve_batch_calls_sum{label}", 0)
    )


def concurrently(address: str, requests: list) -> list:
    """Every request at once on one channel (the way a busy decoder farm calls); responses in request order."""

    async def main():
        async with grpc.aio.insecure_channel(address) as channel:
            stub = LMServiceStub(channel)
            calls = []
            for request in requests:
                method = stub.ScoreSentences if isinstance(request, pb.ScoreSentencesRequest) else stub.RescoreNBest
                calls.append(method(request, timeout=60))
            return await asyncio.gather(*calls)

    return asyncio.run(main())


def one_by_one(address: str, requests: list) -> list:
    async def main():
        async with grpc.aio.insecure_channel(address) as channel:
            stub = LMServiceStub(channel)
            out = []
            for request in requests:
                method = stub.ScoreSentences if isinstance(request, pb.ScoreSentencesRequest) else stub.RescoreNBest
                out.append(await method(request, timeout=60))
            return out

    return asyncio.run(main())


def requests() -> list:
    sentences = make_sentences(48, seed=21)
    out = [pb.ScoreSentencesRequest(sentences=sentences[i : i + 3], per_token=True) for i in range(0, 48, 3)]
    for entry in lists(16, seed=22):
        request = pb.RescoreNBestRequest(lists=[hypothesis_list(entry)])
        request.combination.weights.update({"am": 1.0, "neural": 0.5})
        out.append(request)
    return out


def test_concurrent_calls_merge_and_score_as_if_alone(config, tmp_path):
    with ServerProcess(config[0], tmp_path / "server.log") as server:
        alone = one_by_one(server.address, requests())  # an idle server scores each call by itself
        before = {kind: batch_counts(server, kind) for kind in ("sentences", "lists")}
        assert before["sentences"][0] == before["sentences"][1] == 16  # 16 batches of one call
        together = concurrently(server.address, requests())
        after = {kind: batch_counts(server, kind) for kind in ("sentences", "lists")}
        assert server.stop() == 0
    for kind in ("sentences", "lists"):
        batches, calls = (a - b for a, b in zip(after[kind], before[kind], strict=True))
        assert calls == 16 and batches < calls, (kind, batches)  # some batch merged calls
    for a, b in zip(alone, together, strict=True):
        assert a == b  # the very same bytes: merging changes nothing in a call's answer


def test_batching_off_scores_every_call_alone_with_the_same_results(config, tmp_path):
    with ServerProcess(config[1], tmp_path / "server.log") as server:
        together = concurrently(server.address, requests())
        batches, calls = batch_counts(server, "sentences")
        assert server.stop() == 0
    assert batches == calls == 16
    with ServerProcess(config[0], tmp_path / "on.log") as server:
        assert one_by_one(server.address, requests()) == together
