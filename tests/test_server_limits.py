"""lm-serve bounds the work of every call before doing it: a decoder step's words (items x candidates) and its
answer's estimated size are checked against ``[limits]`` (and the states it would keep against the state cache), and
refused with RESOURCE_EXHAUSTED naming the limit and its value, before anything is scored; an answer that still comes
out larger than ``limits.max_message_bytes`` is refused as such and logged with that code, not ``OK``. Only the
server's own checks of a request are INVALID_ARGUMENT: a ValueError from inside the engine (numpy, onnxruntime) is a
bug of ours, INTERNAL, logged with its traceback. Real servers on free loopback ports, called over gRPC."""

import asyncio
import logging
import time
import urllib.request

import grpc
import pytest
from conftest import fit_and_export, tiny_config_text, write_splits

from lmserve.server.app import LMServer
from lmserve.server.batching import Budget
from lmserve.server.config import Limits, load_config
from lmserve.server.logs import LOGGER
from lmserve.server.models import ModelSet
from lmserve.server.process import ServerProcess
from lmserve.v1 import lmserve_pb2 as pb
from lmserve.v1.lmserve_pb2_grpc import LMServiceStub

EXHAUSTED, INVALID, INTERNAL = (
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.INTERNAL,
)
LIMITS = {"max_items": 64, "max_candidates": 40, "max_step_words": 600, "max_message_bytes": 100_000}


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    root = tmp_path_factory.mktemp("limits")
    corpus = write_splits(root)
    return fit_and_export(root, "lm", tiny_config_text(corpus, "sentence", "full", train={"epochs": 1}))[1]


def write_config(path, bundle, limits=LIMITS, cache_mb=0.05):
    text = "\n".join(f"{key} = {value}" for key, value in limits.items())
    path.write_text(
        f"[server]\nworkers = 1\nmetrics_port = 0\n[limits]\n{text}\n[state_cache]\nmax_mb = {cache_mb}\n"
        f'[models.m]\nbundle = "{bundle}"\n'
    )
    return path


@pytest.fixture(scope="module")
def server(bundle, tmp_path_factory):
    root = tmp_path_factory.mktemp("limits-server")
    with ServerProcess(write_config(root / "serve.toml", bundle), root / "server.log") as server:
        yield server
        assert server.stop() == 0
    assert not [r for r in server.records if r.get("level") == "error"], "errors in the server log"


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.address) as channel:
        yield LMServiceStub(channel)


def step(items: int, candidates: int, **flags) -> pb.ScoreNextWordsBatchRequest:
    words = [f"w{k % 30}" for k in range(candidates)]
    return pb.ScoreNextWordsBatchRequest(items=[pb.NextWordsItem(candidates=words)] * items, **flags)


def status_of(call, *args, **kwargs) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kwargs)
    return info.value.code(), info.value.details()


def steps_scored(server: ServerProcess) -> float:
    """Decoder steps the engine has run (the ``steps`` batcher's calls), from the metrics."""
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    return float(samples.get('lmserve_batch_calls_sum{kind="steps"}', 0))


def last_call(server: ServerProcess, method: str) -> dict:
    return [r for r in server.records if r.get("message") == "call" and r.get("method") == method][-1]


def test_the_default_limits_refuse_the_step_that_took_7_gb_before_scoring_it(bundle, tmp_path):
    """1,024 items of 1,000 candidates (a 7 MB request within every other limit) took a server from 382 MB to 7 GB
    RSS; the default limits refuse it up front."""
    config = tmp_path / "serve.toml"
    config.write_text(f'[server]\nworkers = 1\n[models.m]\nbundle = "{bundle}"\n')
    limits = Limits()
    assert limits.max_items * limits.max_candidates == 1024 * 1000 > limits.max_step_words
    with ServerProcess(config, tmp_path / "server.log") as server, grpc.insecure_channel(server.address) as channel:
        request = step(1024, 1000, scores_only=True)
        code, details = status_of(LMServiceStub(channel).ScoreNextWordsBatch, request, timeout=20)
        assert code == EXHAUSTED, details
        assert f"1024000 given, at most {limits.max_step_words} (limits.max_step_words)" in details
        assert server.stop() == 0


def test_a_step_over_max_step_words_is_refused_before_any_work(server, stub):
    before = steps_scored(server)
    code, details = status_of(stub.ScoreNextWordsBatch, step(20, 40, scores_only=True), timeout=30)  # 800 words
    assert code == EXHAUSTED
    assert "800 given, at most 600 (limits.max_step_words)" in details, details
    assert steps_scored(server) == before  # nothing was scored
    assert last_call(server, "ScoreNextWordsBatch")["code"] == "RESOURCE_EXHAUSTED"
    assert len(stub.ScoreNextWordsBatch(step(15, 40, scores_only=True), timeout=30).items) == 15  # 600: at the limit


def test_a_step_whose_answer_would_exceed_the_message_limit_is_refused_up_front_and_logged_so(server, stub):
    """Each word's state token (about 300 bytes for this tiny model) makes 15 x 40 words an answer of about 200 kB:
    refused before the work, naming the limit, where gRPC used to fail it in the transport, after the work, and the
    server logged the call as OK. Without states the same step is answered."""
    before = steps_scored(server)
    code, details = status_of(stub.ScoreNextWordsBatch, step(15, 40), timeout=30)
    assert code == EXHAUSTED
    assert "the answer: about" in details and "more than 100000 (limits.max_message_bytes)" in details, details
    assert steps_scored(server) == before
    assert last_call(server, "ScoreNextWordsBatch")["code"] == "RESOURCE_EXHAUSTED"
    assert stub.ScoreNextWordsBatch(step(2, 40), timeout=30).items[1].words[0].state  # a small one has its states


def test_a_step_that_would_keep_more_states_than_the_cache_holds_is_refused(server, stub):
    code, details = status_of(stub.ScoreNextWordsBatch, step(15, 40, cache_states=True), timeout=30)
    assert code == EXHAUSTED and "more than the whole state cache (52428 bytes: state_cache.max_mb)" in details
    assert stub.ScoreNextWordsBatch(step(2, 10, cache_states=True), timeout=30).items[0].words[0].state_id


def test_each_message_of_a_stream_is_bounded_and_a_refusal_ends_the_stream_with_its_code(server):
    async def scenario() -> tuple[int, grpc.StatusCode, str]:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stream = LMServiceStub(channel).StreamNextWords(timeout=30)
            await stream.write(step(2, 5))
            answered = len((await stream.read()).items)
            await stream.write(step(20, 40, scores_only=True))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stream.read()
            return answered, info.value.code(), info.value.details()

    answered, code, details = asyncio.run(scenario())
    assert answered == 2 and code == EXHAUSTED and "(limits.max_step_words)" in details, details
    stream = server.wait_for(lambda r: r.get("method") == "StreamNextWords" and r.get("message") == "call", 10)
    assert stream["code"] == "RESOURCE_EXHAUSTED" and stream["steps"] == 1


def test_an_answer_over_the_message_limit_is_refused_with_the_limit_and_logged_with_its_code(server, stub):
    """ScoreSentences with per-token scores: a small request, an answer over the limit. The client used to get a
    transport error naming no limit, and the log said OK."""
    sentences = [" ".join(f"w{k % 30}" for k in range(i, i + 30)) for i in range(200)]
    request = pb.ScoreSentencesRequest(sentences=sentences, per_token=True)
    assert request.ByteSize() < LIMITS["max_message_bytes"]
    code, details = status_of(stub.ScoreSentences, request, timeout=30)
    assert code == EXHAUSTED and "more than 100000 (limits.max_message_bytes)" in details, details
    logged = last_call(server, "ScoreSentences")
    assert logged["code"] == "RESOURCE_EXHAUSTED" and logged["response_bytes"] > LIMITS["max_message_bytes"]
    assert stub.ScoreSentences(pb.ScoreSentencesRequest(sentences=sentences), timeout=30).sentences  # totals fit


def test_limit_refusals_name_the_config_key(server, stub):
    code, details = status_of(stub.ScoreNextWordsBatch, step(65, 1), timeout=30)
    assert (code, "items: 65 given, at most 64 (limits.max_items)" in details) == (EXHAUSTED, True), details
    code, details = status_of(stub.ScoreNextWordsBatch, step(1, 41), timeout=30)
    assert "items[0].candidates: 41 given, at most 40 (limits.max_candidates)" in details, details


# -- the memory of steps in flight, all calls together -------------------------------------------------------------


def test_the_budget_lets_steps_in_first_come_first_served_and_a_cancelled_one_gives_its_share_back():
    async def scenario() -> list[str]:
        budget, order, release = Budget(100), [], asyncio.Event()

        async def step(name: str, amount: int, hold: bool = False) -> None:
            async with budget.hold(amount):
                order.append(name)
                if hold:
                    await release.wait()

        first = asyncio.create_task(step("a 60", 60, hold=True))
        await asyncio.sleep(0)
        waiting = [asyncio.create_task(step(name, amount)) for name, amount in (("b 50", 50), ("c 10", 10))]
        gone = asyncio.create_task(step("d 30", 30))
        huge = asyncio.create_task(step("e 500", 500))  # more than the whole budget: alone, in its turn
        await asyncio.sleep(0.01)
        assert order == ["a 60"] and budget.used == 60  # c would fit, but waits behind b (no overtaking)
        gone.cancel()
        release.set()
        await asyncio.gather(first, *waiting, huge)
        assert gone.cancelled() and budget.used == 0 and not budget.waiting
        return order

    assert asyncio.run(scenario()) == ["a 60", "b 50", "c 10", "e 500"]


def test_steps_beyond_the_budget_wait_their_turn_and_are_all_answered(bundle, tmp_path):
    """A budget of 1 MB, and 12 steps of about 0.36 MB each (their state tokens, three times, and their words) at
    once: at most two are in flight at a time, so the engine never merges more than two; none fails."""
    config = write_config(tmp_path / "serve.toml", bundle, {**LIMITS, "steps_in_flight_mb": 1})
    with ServerProcess(config, tmp_path / "server.log") as server:

        async def scenario() -> list[int]:
            async with grpc.aio.insecure_channel(server.address) as channel:
                stub = LMServiceStub(channel)
                answers = await asyncio.gather(*(stub.ScoreNextWordsBatch(step(6, 40), timeout=60) for _ in range(12)))
                return [len(a.items) for a in answers]

        assert asyncio.run(scenario()) == [6] * 12
        text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
        samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
        batches = float(samples['lmserve_batch_calls_count{kind="steps"}'])
        assert float(samples['lmserve_batch_calls_sum{kind="steps"}']) == 12
        assert float(samples['lmserve_batch_calls_bucket{kind="steps",le="2.0"}']) == batches  # never 3 at once
        assert server.stop() == 0


# -- whose fault: INVALID_ARGUMENT for the request, INTERNAL (with a traceback) for the server -----------------------


def test_a_value_error_inside_the_engine_is_internal_and_logged_with_its_traceback(bundle, tmp_path, caplog):
    """A numpy-style ValueError raised while scoring is our bug: INTERNAL, and its traceback in the log. The
    server's own checks of a request (a candidate that is two words, a feature definition) stay INVALID_ARGUMENT."""
    config = load_config(write_config(tmp_path / "serve.toml", bundle))

    def broken(*args, **kwargs):
        raise ValueError("operands could not be broadcast together with shapes (3,16) (4,16)")

    async def scenario() -> dict[str, tuple[grpc.StatusCode, str]]:
        server = LMServer(config, ModelSet.load(config))
        port = await server.start("127.0.0.1", 0)
        lm = server.models.get("m").lm
        outcomes = {}
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = LMServiceStub(channel)
            calls = {
                "two words": lambda: stub.ScoreNextWordsBatch(_two_words(), timeout=30),
                "definition": lambda: stub.RescoreNBest(_bad_definition(), timeout=30),
                "sentences": lambda: stub.ScoreSentences(pb.ScoreSentencesRequest(sentences=["w1 w2"]), timeout=30),
                "step": lambda: stub.ScoreNextWordsBatch(step(2, 3), timeout=30),
                "next words": lambda: stub.ScoreNextWords(pb.ScoreNextWordsRequest(candidates=["w1"]), timeout=30),
            }
            for name, call in calls.items():
                if name == "sentences":  # from here on, the engine breaks
                    lm.score = lm.next_words_batch = lm.next_words = broken
                try:
                    await call()
                    outcomes[name] = (grpc.StatusCode.OK, "")
                except grpc.aio.AioRpcError as e:
                    outcomes[name] = (e.code(), e.details())
        await server.stop()
        return outcomes

    with caplog.at_level(logging.INFO, logger=LOGGER):
        outcomes = asyncio.run(scenario())
    assert outcomes["two words"] == (INVALID, "items[0].candidates[0] = 'w1 w2': expected one token, without spaces")
    assert outcomes["definition"][0] == INVALID and "feature definition" in outcomes["definition"][1]
    for name in ("sentences", "step", "next words"):
        code, details = outcomes[name]
        assert code == INTERNAL and "internal error (the server log has details)" in details, (name, details)
    tracebacks = [r for r in caplog.records if r.exc_info and r.getMessage() == "internal error"]
    assert len(tracebacks) == 3 and all("broadcast" in str(r.exc_info[1]) for r in tracebacks)


def _two_words() -> pb.ScoreNextWordsBatchRequest:
    return pb.ScoreNextWordsBatchRequest(items=[pb.NextWordsItem(candidates=["w1 w2"])])


def _bad_definition() -> pb.RescoreNBestRequest:
    request = pb.RescoreNBestRequest(lists=[pb.HypothesisList(id="u", hypotheses=[pb.Hypothesis(text="w1")])])
    request.lists[0].hypotheses[0].features["am"] = -1.0
    request.combination.weights.update({"am": 1.0})
    request.combination.definitions.append("x = 2*")
    return request


def test_a_stream_without_a_step_for_stream_idle_s_is_closed_and_frees_its_call(bundle, tmp_path):
    """A decoder that stops sending without closing its stream loses it after ``limits.stream_idle_s``."""
    config = write_config(tmp_path / "serve.toml", bundle, {**LIMITS, "stream_idle_s": 1.0})
    with ServerProcess(config, tmp_path / "server.log") as server, grpc.insecure_channel(server.address) as channel:
        stub = LMServiceStub(channel)

        def requests():
            yield step(1, 2)
            time.sleep(3)  # idle past the limit
            yield step(1, 2)

        answers, start = stub.StreamNextWords(requests(), timeout=30), time.perf_counter()
        next(answers)
        with pytest.raises(grpc.RpcError) as info:
            next(answers)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, info.value.details()
        assert "limits.stream_idle_s" in info.value.details() and time.perf_counter() - start < 2.9
        assert last_call(server, "StreamNextWords")["code"] == "DEADLINE_EXCEEDED"
        assert server.stop() == 0
