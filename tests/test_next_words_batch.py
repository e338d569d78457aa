"""Beam steps in one call: ``InterpolatedLM.next_words_batch`` scores the candidates after many states in one LSTM
step exactly as ``next_words`` scores each alone; lm-serve's ScoreNextWordsBatch and StreamNextWords answer the same
(real server on a free port, real client), merge the steps of concurrent decoders, keep states as tokens or in the
state cache (ids, LRU eviction under a memory bound, TTL, release, a clear NOT_FOUND for an id that is gone), and
after a hot reload keep states valid when the bundle is the same and refuse them with FAILED_PRECONDITION when it
changed."""

import asyncio
import math
import time
import urllib.request

import grpc
import numpy as np
import pytest
from conftest import make_sentences

from lmserve.rescoring.client import LMServeClient
from lmserve.rescoring.decoder_state import DecoderState, StateError, decode
from lmserve.rescoring.interpolated import InterpolatedLM, Step
from lmserve.rescoring.ngram import NgramLM, build_ngram
from lmserve.rescoring.scorer import Scorer
from lmserve.server.process import ServerProcess
from lmserve.server.state_cache import ENTRY_OVERHEAD, StateCache, StateIdError
from lmserve.v1 import lmserve_pb2 as pb
from lmserve.v1.lmserve_pb2_grpc import LMServiceStub

LAMBDA = 0.4
SENTENCES = ["w1 w2 w3", "", "w5 zzz w7 w7", "w0 w3 w1 w4 w2 w9 w11"]


@pytest.fixture(scope="module")
def root(tmp_path_factory, bundles):
    root = tmp_path_factory.mktemp("steps")
    build_ngram((s.split() for s in make_sentences(300, seed=1)), 3, root / "train3", discount_fallback=True)
    return root


@pytest.fixture(scope="module")
def lm(bundles, root):
    return InterpolatedLM(Scorer(bundles[("full", 0.0)][1], threads=1), NgramLM(root / "train3.bin"), LAMBDA)


def write_config(root, bundles, name="serve.toml", bundle=("full", 0.0), cache="max_mb = 0.05\nttl_seconds = 30.0"):
    path = root / name
    path.write_text(
        "[server]\nworkers = 1\nmetrics_port = 0\nadmin = true\n"
        "[batching]\nmax_wait_ms = 50.0\n"
        "[limits]\nmax_items = 40\nmax_candidates = 8\n"
        f"[state_cache]\n{cache}\n"
        f'[models.exact]\nbundle = "{bundles[bundle][1]}"\nngram = "train3.bin"\nlambda = {LAMBDA}\n'
    )
    return path


@pytest.fixture(scope="module")
def server(root, bundles):
    with ServerProcess(write_config(root, bundles), root / "server.log") as server:
        yield server
        assert server.stop() == 0
    assert not [r for r in server.records if r.get("level") == "error"], "internal errors in the server log"


@pytest.fixture(scope="module")
def client(server):
    with LMServeClient(server.address, timeout=30) as c:
        yield c


def status_of(call, *args, **kwargs) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kwargs)
    return info.value.code(), info.value.details()


def walks(lm: InterpolatedLM) -> list[list[str]]:
    return [[*lm.scorer.normalizer.normalize(s), "</s>"] for s in SENTENCES]


# -- the engine ----------------------------------------------------------------------------------------------


def test_a_batched_step_scores_every_item_as_next_words_alone(lm):
    first = lm.next_words(b"", ["w1", "w3"])
    states = [b"", first[0].state, first[1].state, first[0].state]
    candidates = [["w1", "w2", "</s>"], ["w2"], ["zzz", "w4", "w5", "w6", "</s>"], ["w3", "w3"]]
    batched = lm.next_words_batch([Step(s, c) for s, c in zip(states, candidates, strict=True)])
    scorer = lm.scorer
    for state, words, got in zip(states, candidates, batched, strict=True):
        alone = lm.next_words(state, words)
        assert [w.word for w in got] == words and [w.oov for w in got] == [w.oov for w in alone]
        for a, b in zip(got, alone, strict=True):
            assert a.neural == pytest.approx(b.neural, abs=1e-5) and a.ngram == b.ngram
            assert a.interpolated == pytest.approx(b.interpolated, abs=1e-5)
            mine, theirs = (decode(x.state, lm.fingerprint, scorer.layers, scorer.state_size, 10**6) for x in (a, b))
            assert mine.prev_id == theirs.prev_id and mine.ngram_context == theirs.ngram_context
            np.testing.assert_allclose(mine.h, theirs.h, atol=1e-5)
    # objects instead of tokens: the same states, unencoded; "none": scores only
    objects = lm.next_words_batch([Step(states[1], ["w2"], "objects")])[0][0]
    assert objects.state == b"" and isinstance(objects.after, DecoderState)
    np.testing.assert_allclose(objects.after.h, decode(batched[1][0].state, lm.fingerprint, 2, 16, 10**6).h, atol=1e-6)
    again = lm.next_words_batch([Step(objects.after, ["</s>"]), Step(batched[1][0].state, ["</s>"])])
    assert again[0][0].neural == pytest.approx(again[1][0].neural, abs=1e-6)
    bare = lm.next_words_batch([Step(b"", ["w1"], "none")])[0][0]
    assert bare.state == b"" and bare.after is None and bare.neural == pytest.approx(first[0].neural, abs=1e-6)


def test_batched_steps_walk_many_sentences_to_their_sentence_scores(lm):
    """All sentences advance together, one batched step per word position."""
    paths = walks(lm)
    states: list = [b""] * len(paths)
    totals = np.zeros((len(paths), 2))
    for depth in range(max(map(len, paths))):
        live = [i for i, p in enumerate(paths) if depth < len(p)]
        steps = lm.next_words_batch([Step(states[i], [paths[i][depth], "w0"], "objects") for i in live])
        for i, words in zip(live, steps, strict=True):
            totals[i] += words[0].neural, words[0].interpolated
            states[i] = words[0].after
    for (neural, interpolated), whole in zip(totals, lm.score(SENTENCES), strict=True):
        assert neural == pytest.approx(float(whole.neural.sum()), abs=1e-4)
        assert interpolated == pytest.approx(float(whole.interpolated.sum()), abs=1e-4)


def test_a_bad_item_is_named(lm):
    with pytest.raises(ValueError, match=r"items\[1\]\.candidates\[0\]"):
        lm.next_words_batch([Step(b"", ["w1"]), Step(b"", ["two words"])])
    with pytest.raises(ValueError, match=r"items\[0\]\.candidates: empty"):
        lm.next_words_batch([Step(b"", [])])
    with pytest.raises(StateError, match=r"items\[1\]\.state: checksum"):
        lm.next_words_batch([Step(b"", ["w1"]), Step(b"x" * 400, ["w1"])])


# -- the state cache -----------------------------------------------------------------------------------------


def small_state(context=("w1",)) -> DecoderState:
    return DecoderState(3, np.zeros((2, 16), np.float32), np.zeros((2, 16), np.float32), context)


def test_the_cache_evicts_least_recently_used_states_within_its_bound():
    now = [0.0]
    size = StateCache.size_of(small_state())
    assert size == 2 * 2 * 16 * 4 + 3 + ENTRY_OVERHEAD
    cache = StateCache(3 * size, ttl=10.0, clock=lambda: now[0])
    ids = [cache.put("m", b"f", small_state()) for _ in range(3)]
    cache.get(ids[0])  # now the most recently used
    fourth = cache.put("m", b"f", small_state())
    assert len(cache) == 3 and cache.bytes == 3 * size and cache.evicted == 1
    with pytest.raises(StateIdError, match="evicted: the state cache was full"):
        cache.get(ids[1])
    assert cache.get(ids[0]).state.prev_id == 3 and cache.get(fourth)
    assert cache.release([ids[2], "nonsense"]) == 1
    with pytest.raises(StateIdError, match="released by the client"):
        cache.get(ids[2])
    now[0] = 10.5  # ids[0] and fourth were used at 0
    with pytest.raises(StateIdError, match="expired: unused for more than .* 10 s"):
        cache.get(fourth)
    assert len(cache) == 0 and cache.bytes == 0 and cache.expired == 2
    with pytest.raises(StateIdError, match="not made by this server process"):
        cache.get("zzzzzz1")
    with pytest.raises(StateIdError, match="never made by this server"):
        cache.get(cache.tag + "ff")
    with pytest.raises(ValueError, match="more than the whole state cache"):
        StateCache(size - 1, 1.0).put("m", b"f", small_state())


# -- the server ----------------------------------------------------------------------------------------------


def test_a_batch_call_answers_as_the_engine(client, lm):
    first = client.score_next_words_batch([(b"", ["w1", "w3"])]).items[0].words
    items = [(b"", ["w1", "</s>"]), (first[0].state, ["w2", "zzz"]), (first[1].state, ["w4"])]
    response = client.score_next_words_batch(items)
    assert response.model == "exact" and response.normalisation == pb.NORMALISATION_EXACT
    for (state, words), got in zip(items, response.items, strict=True):
        alone = lm.next_words(state, words)
        assert [w.word for w in got.words] == words
        for a, b in zip(got.words, alone, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5) and a.oov == b.oov and a.ngram == b.ngram
            assert a.state and not a.state_id


@pytest.mark.parametrize("how", ["batch", "stream", "stream-cache"])
def test_steps_add_up_to_the_sentence_scores(client, lm, how):
    """Every sentence at once, one request per word position, states as tokens or cached ids."""
    paths = walks(lm)
    whole = client.score_sentences(SENTENCES).sentences
    cache = how == "stream-cache"
    stream = client.stream_next_words() if how.startswith("stream") else None
    states: list = ["" if cache else b""] * len(paths)
    totals = np.zeros((len(paths), 3))
    for depth in range(max(map(len, paths))):
        live = [i for i, p in enumerate(paths) if depth < len(p)]
        items = [(states[i], [paths[i][depth], "w0"]) for i in live]
        step = stream.step(items, cache_states=cache) if stream else client.score_next_words_batch(items)
        for i, words in zip(live, step.items, strict=True):
            word = words.words[0]
            totals[i] += word.neural, word.ngram, word.interpolated
            assert bool(word.state_id) == cache and bool(word.state) != cache
            states[i] = word.state_id or word.state
    if stream:
        stream.close()
    for total, sentence in zip(totals, whole, strict=True):
        assert total[0] == pytest.approx(sentence.neural.logprob, abs=1e-4)
        assert total[1] == pytest.approx(sentence.ngram.logprob, abs=1e-4)
        assert total[2] == pytest.approx(sentence.interpolated.logprob, abs=1e-4)


def batch_counts(server: ServerProcess, kind: str) -> tuple[float, float]:
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    label = f'{{kind="{kind}"}}'
    return tuple(float(samples.get(f"lmserve_batch_calls_{x}{label}", 0)) for x in ("count", "sum"))


def test_concurrent_decoders_steps_merge_into_one_engine_call(server):
    """16 decoders' steps sent at once: fewer engine calls than steps, and each answer as if alone."""
    requests = [
        pb.ScoreNextWordsBatchRequest(items=[pb.NextWordsItem(candidates=[f"w{i}", f"w{i + 1}"])] * 3)
        for i in range(16)
    ]

    async def send(together: bool):
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = LMServiceStub(channel)
            if together:
                return await asyncio.gather(*(stub.ScoreNextWordsBatch(r, timeout=30) for r in requests))
            return [await stub.ScoreNextWordsBatch(r, timeout=30) for r in requests]

    alone = asyncio.run(send(False))
    before = batch_counts(server, "steps")
    together = asyncio.run(send(True))
    batches, calls = (a - b for a, b in zip(batch_counts(server, "steps"), before, strict=True))
    assert calls == 16 and batches < calls
    for a, b in zip(alone, together, strict=True):
        for x, y in zip(a.items, b.items, strict=True):
            assert [w.word for w in x.words] == [w.word for w in y.words]
            assert [w.logprob for w in x.words] == pytest.approx([w.logprob for w in y.words], abs=1e-5)


def test_cached_states_are_evicted_released_and_refused_clearly(server, client):
    first = client.score_next_words_batch([("", ["w1"])], cache_states=True).items[0].words[0]
    assert first.state_id and not first.state
    assert client.score_next_words_batch([(first.state_id, ["w2"])]).items[0].words[0].state  # an id in, a token out
    # about 98 states of the tiny model fit in 0.05 MB: 4 x 40 new ones push the first out
    for _ in range(4):
        client.score_next_words_batch([("", ["w2"])] * 40, cache_states=True)
    code, details = status_of(client.score_next_words_batch, [(first.state_id, ["w2"])])
    assert code == grpc.StatusCode.NOT_FOUND
    assert "items[0].state id" in details and "evicted: the state cache was full (52428 bytes" in details
    kept = client.score_next_words_batch([("", ["w3"])], cache_states=True).items[0].words[0].state_id
    client.score_next_words_batch([("", ["w4"])], release=[kept])
    code, details = status_of(client.score_next_words_batch, [(kept, ["w2"])])
    assert code == grpc.StatusCode.NOT_FOUND and "released by the client" in details
    code, details = status_of(client.score_next_words_batch, [("abcdef12", ["w2"])])
    assert code == grpc.StatusCode.NOT_FOUND and "not made by this server process" in details


def test_bad_batch_requests_get_the_right_status_codes(client):
    stub, bad = client.stub, grpc.StatusCode.INVALID_ARGUMENT
    cases = [
        (pb.ScoreNextWordsBatchRequest(), bad, "items: empty"),
        (pb.ScoreNextWordsBatchRequest(items=[pb.NextWordsItem(candidates=["w1"])] * 41), None, "items: 41 given"),
        (pb.ScoreNextWordsBatchRequest(items=[pb.NextWordsItem(candidates=["w1"] * 9)]), None, "candidates: 9 given"),
        (pb.ScoreNextWordsBatchRequest(items=[pb.NextWordsItem()]), bad, "items[0].candidates: empty"),
        (pb.ScoreNextWordsBatchRequest(items=[pb.NextWordsItem(state=b"x", state_id="y", candidates=["w1"])]), bad,
         "not both"),
        (pb.ScoreNextWordsBatchRequest(items=[pb.NextWordsItem(candidates=["w1"]), pb.NextWordsItem(
            state=b"x" * 300, candidates=["w1"])]), bad, "items[1].state: checksum"),
        (pb.ScoreNextWordsBatchRequest(items=[pb.NextWordsItem(candidates=["<s>"])]), bad, "sentences start"),
        (pb.ScoreNextWordsBatchRequest(items=[pb.NextWordsItem(candidates=["w1"])], cache_states=True,
         scores_only=True), bad, "at most one"),
        (pb.ScoreNextWordsBatchRequest(model="nope", items=[pb.NextWordsItem(candidates=["w1"])]),
         grpc.StatusCode.NOT_FOUND, "unknown model"),
    ]  # fmt: skip
    for request, code, message in cases:
        got, details = status_of(stub.ScoreNextWordsBatch, request, timeout=30)
        assert got == (code or grpc.StatusCode.RESOURCE_EXHAUSTED) and message in details, (message, details)
    # a stream ends with the status of its bad request; the steps before it were answered
    with client.stream_next_words() as stream:
        assert stream.step([(b"", ["w1"])]).items[0].words[0].state
        code, details = status_of(stream.step, [(b"", ["two words"])])
        assert code == bad and "items[0].candidates[0]" in details
    scores = client.score_next_words_batch([(b"", ["w1", "w2"])], scores_only=True).items[0].words
    assert all(not w.state and not w.state_id for w in scores) and math.isfinite(scores[1].logprob)


def test_without_a_cache_ids_are_refused_and_a_short_ttl_expires_them(root, bundles):
    config = write_config(root, bundles, "short.toml", cache="max_mb = 1.0\nttl_seconds = 0.3")
    none = write_config(root, bundles, "none.toml", cache="max_mb = 0")
    with ServerProcess(config, root / "short.log") as server, LMServeClient(server.address, timeout=30) as client:
        state_id = client.score_next_words_batch([("", ["w1"])], cache_states=True).items[0].words[0].state_id
        time.sleep(0.6)
        code, details = status_of(client.score_next_words_batch, [(state_id, ["w2"])])
        assert code == grpc.StatusCode.NOT_FOUND and "expired: unused for more than the state cache's ttl" in details
        assert server.stop() == 0
    with ServerProcess(none, root / "none.log") as server, LMServeClient(server.address, timeout=30) as client:
        code, details = status_of(client.score_next_words_batch, [("", ["w1"])], cache_states=True)
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "no state cache" in details
        assert server.stop() == 0


def test_a_reload_keeps_states_of_the_same_bundle_and_refuses_those_of_a_changed_one(root, bundles):
    config = write_config(root, bundles, "reload.toml")
    with ServerProcess(config, root / "reload.log") as server, LMServeClient(server.address, timeout=30) as client:
        with client.stream_next_words() as stream:  # a decoder mid-utterance, with a token and a cached state
            words = stream.step([(b"", ["w1"]), ("", ["w1"])], cache_states=False).items
            token = words[0].words[0].state
            state_id = stream.step([("", ["w1"])], cache_states=True).items[0].words[0].state_id
            before = stream.step([(token, ["w2"]), (state_id, ["w2"])]).items
            assert client.reload_models().generation == 2  # the same bundle again
            after = stream.step([(token, ["w2"]), (state_id, ["w2"])]).items
            assert [i.words[0].logprob for i in after] == pytest.approx([i.words[0].logprob for i in before])
            write_config(root, bundles, "reload.toml", bundle=("full", 0.5))
            assert client.reload_models().generation == 3  # another bundle under the same name
            for item, where in (((token, ["w2"]), "items[0].state"), ((state_id, ["w2"]), "items[0].state_id")):
                code, details = status_of(client.score_next_words_batch, [item])
                assert code == grpc.StatusCode.FAILED_PRECONDITION, details
                assert details.startswith(where) and "before a reload (generation 2" in details
                assert "restart the sentence" in details
            code, details = status_of(stream.step, [(token, ["w2"])])
            assert code == grpc.StatusCode.FAILED_PRECONDITION
        code, details = status_of(client.score_next_words, ["w2"], token)  # the single-step call says the same
        assert code == grpc.StatusCode.FAILED_PRECONDITION and details.startswith("state: a state of model 'exact'")
        assert server.stop() == 0


def test_streams_a_client_walks_away_from_are_not_left_in_flight(root, bundles):
    """Cancelled streams (and streams closed under the server's generator) end their call: a drain finds none."""
    config = write_config(root, bundles, "walkaway.toml")

    async def walk_away(address: str) -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = LMServiceStub(channel)
            for _ in range(5):
                stream = stub.StreamNextWords()
                for _ in range(3):
                    await stream.write(pb.ScoreNextWordsBatchRequest(items=[pb.NextWordsItem(candidates=["w1"])]))
                    await stream.read()
                stream.cancel()

    with ServerProcess(config, root / "walkaway.log") as server:
        asyncio.run(walk_away(server.address))
        time.sleep(0.5)
        assert server.stop() == 0
    (stopping,) = [r for r in server.records if r["message"] == "stopping"]
    assert stopping["in_flight"] == 0
    calls = [r for r in server.records if r["message"] == "call" and r["method"] == "StreamNextWords"]
    assert len(calls) == 5 and {r["steps"] for r in calls} == {3}
