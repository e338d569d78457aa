"""A remote DecoderLM as decoders really use it, against a real lm-serve: a hung server (SIGSTOP) fails a stream step
within its deadline, naming the server; one decoder shared by threads gives the results of one thread; pyctcdecode's
``decode_batch`` with a fork pool gives those of one process; ``fallback_ngram`` works from construction on and the
decoder returns to the server once it answers; the benchmark of all this runs end to end on a tiny bundle."""

import logging
import math
import multiprocessing
import signal
import socket
import threading
import time

import grpc
import numpy as np
import pytest
from conftest import make_sentences

from benchmarks.synthetic_ctc import Channel
from lmserve.rescoring.client import LMServeClient
from lmserve.rescoring.decoders.lm import DecoderLM, LMServeError
from lmserve.rescoring.ngram import NgramLM, build_ngram
from lmserve.server.process import ServerProcess

pytest.importorskip(
    "pyctcdecode",
    reason="pyctcdecode is not installed (pip install --no-deps pyctcdecode==0.5.0; make test installs it)",
)
from lmserve.rescoring.decoders.pyctcdecode_lm import build_ctcdecoder  # noqa: E402

LAMBDA = 0.4
LABELS = ["", " ", "w", *"0123456789"]
TEXTS = make_sentences(16, seed=5)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("decoder_client")
    build_ngram((s.split() for s in make_sentences(300, seed=1)), 3, root / "train3", discount_fallback=True)
    (root / "texts.txt").write_text("\n".join(make_sentences(12, seed=9)) + "\n")
    return root


@pytest.fixture(scope="module")
def bundle(bundles):
    return bundles[("full", 0.0)][1]


def write_config(root, bundle, name):
    path = root / name
    path.write_text(
        "[server]\nworkers = 1\n[state_cache]\nmax_mb = 8.0\n"
        f'[models.exact]\nbundle = "{bundle}"\nngram = "train3.bin"\nlambda = {LAMBDA}\n'
    )
    return path


@pytest.fixture(scope="module")
def server(root, bundle):
    with ServerProcess(write_config(root, bundle, "serve.toml"), root / "server.log") as server:
        yield server
        assert server.stop() == 0


@pytest.fixture(scope="module")
def emissions():
    rng = np.random.default_rng(11)
    channel = Channel(sub=0.15, dropped=0.05, ins=0.05)
    return [channel.emissions(t, LABELS, rng) for t in TEXTS]


def outcome(run, limit: float):
    """``run()`` in a thread: (its result or the exception it raised, seconds); the test fails if it is still going
    after ``limit`` seconds (it hangs)."""
    out = {}

    def target():
        try:
            out["value"] = run()
        except Exception as error:  # noqa: BLE001 (the caller checks what it was)
            out["value"] = error

    start = time.monotonic()
    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(limit)
    assert not worker.is_alive(), f"still waiting after {limit} s: {run}"
    return out["value"], time.monotonic() - start


def best(decoder, emissions):
    text, state, *_ = decoder.decode_beams(emissions, beam_width=8)[0]
    return text, state


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_hung_server_fails_a_stream_step_within_its_deadline_naming_the_server(root, bundle, caplog):
    with ServerProcess(write_config(root, bundle, "hung.toml"), root / "hung.log") as server:
        plain = DecoderLM.remote(server.address, "exact", timeout=2)
        fallback = DecoderLM.remote(server.address, "exact", timeout=2, fallback_ngram=root / "train3.bin")
        default = DecoderLM.remote(server.address, "exact")
        client = LMServeClient(server.address, timeout=2)
        stream = client.stream_next_words()
        starts = {lm: lm.start() for lm in (plain, fallback, default)}
        for lm, start in starts.items():  # each has its stream open, and answered
            assert math.isfinite(lm.score(start, "w1")[1].neural)
        assert stream.step([(b"", ["w1"])]).items[0].words[0].state
        server.send(signal.SIGSTOP)
        try:
            error, seconds = outcome(lambda: plain.score(starts[plain], "w2"), 20)
            assert isinstance(error, LMServeError), error
            assert str(error).startswith(f"lm-serve at {server.address}: DEADLINE_EXCEEDED: no answer")
            assert 1.9 <= seconds <= 6, seconds
            error, seconds = outcome(lambda: stream.step([(b"", ["w2"])]), 20)  # the client's own streams too
            assert isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.DEADLINE_EXCEEDED, error
            assert server.address in str(error) and 1.9 <= seconds <= 6, (error, seconds)
            with caplog.at_level(logging.WARNING, logger="lmserve.decoders"):
                (_, state), seconds = outcome(lambda: fallback.score(starts[fallback], "w2"), 20)
            assert math.isnan(state.neural) and fallback.fell_back and seconds <= 6
            assert any("DEADLINE_EXCEEDED" in r.getMessage() and "n-gram" in r.getMessage() for r in caplog.records)
            for closing in (plain.close, fallback.close, stream.close, client.close):
                outcome(closing, 10)
        finally:
            server.send(signal.SIGCONT)
        assert default.backend.streams[threading.current_thread()].step_timeout == 30.0  # the default deadline
        default.close()
        assert server.stop() == 0


@pytest.mark.parametrize("cache_states", [False, True], ids=["tokens", "cached"])
def test_one_remote_decoder_shared_by_threads_gives_the_results_of_one_thread(server, emissions, cache_states):
    with DecoderLM.remote(server.address, "exact", cache_states=cache_states) as lm:
        decoder = build_ctcdecoder(LABELS, lm, alpha=0.8, beta=0.5)
        alone = [best(decoder, e) for e in emissions]
        shared: list = [None] * len(emissions)

        def share(first):
            for i in range(first, len(emissions), 8):
                shared[i] = best(decoder, emissions[i])

        def run():
            threads = [threading.Thread(target=share, args=(k,)) for k in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()

        error, _ = outcome(run, 120)
        assert error is None
        assert [s[0] for s in shared] == [a[0] for a in alone]
        assert [s[1].logprob for s in shared] == pytest.approx([a[1].logprob for a in alone], abs=1e-5)
        assert [s[1].neural for s in shared] == pytest.approx([a[1].neural for a in alone], abs=1e-5)


@pytest.mark.parametrize("cache_states", [False, True], ids=["tokens", "cached"])
def test_decode_batch_with_a_fork_pool_gives_the_results_of_one_process(server, emissions, cache_states):
    with DecoderLM.remote(server.address, "exact", cache_states=cache_states) as lm:
        decoder = build_ctcdecoder(LABELS, lm, alpha=0.8, beta=0.5)
        alone = [decoder.decode(e, beam_width=8) for e in emissions]
        with multiprocessing.get_context("fork").Pool(2) as pool:
            forked, _ = outcome(lambda: decoder.decode_batch(pool, emissions, beam_width=8), 120)
        assert forked == alone
        assert decoder.decode(emissions[0], beam_width=8) == alone[0]  # the parent's own streams go on


def test_a_server_down_at_construction_falls_back_and_returns_once_it_answers(root, bundle, emissions, caplog):
    port = free_port()
    ngram = NgramLM(root / "train3.bin")
    with caplog.at_level(logging.WARNING, logger="lmserve.decoders"):
        lm = DecoderLM.remote(f"127.0.0.1:{port}", "exact", fallback_ngram=root / "train3.bin", retry_server=0.5)
        decoder = build_ctcdecoder(LABELS, lm, alpha=0.8, beta=0.5)
        text, state = best(decoder, emissions[0])
        assert lm.fell_back and math.isnan(state.neural)
        assert state.logprob == pytest.approx(ngram.score(text.split()), abs=1e-6)  # the n-gram alone
        config = write_config(root, bundle, "back.toml")
        with ServerProcess(config, root / "back.log", "--port", str(port)) as server:
            time.sleep(0.6)
            text, state = best(decoder, emissions[1])  # a new utterance: asks the server again, which answers
            assert not lm.fell_back and math.isfinite(state.neural)
            with DecoderLM.remote(server.address, "exact") as direct:
                expected_text, expected = best(build_ctcdecoder(LABELS, direct, alpha=0.8, beta=0.5), emissions[1])
            assert text == expected_text and state.logprob == pytest.approx(expected.logprob, abs=1e-5)
            lm.close()
            assert server.stop() == 0
    warnings = [r.getMessage() for r in caplog.records if r.name == "lmserve.decoders"]
    assert len(warnings) == 2, warnings
    assert f"lm-serve at 127.0.0.1:{port}: UNAVAILABLE" in warnings[0] and "n-gram" in warnings[0]
    assert "answers again" in warnings[1]


def test_the_benchmark_measures_a_hung_server_threads_and_a_fork_pool(root, bundle):
    from benchmarks.serve_limits import decoder_clients

    texts = (root / "texts.txt").read_text().splitlines()
    metrics, details = decoder_clients(
        bundle,
        root / "train3.bin",
        LAMBDA,
        None,
        texts,
        ["", *" w0123456789"],
        12,
        beam=8,
        processes=2,
        limit_s=120,
        step_timeout=2,
    )
    assert 1.9 <= metrics["hung_server_error_s"] <= 6, details["runs"]
    assert metrics["shared_decoder_wrong_results"] == 0 and metrics["fork_pool_wrong_results"] == 0, details["runs"]
    assert details["runs"]["hung_server"]["names_the_server"] and details["runs"]["hung_server"]["deadline_exceeded"]


def test_a_beam_step_over_the_servers_max_step_words_goes_in_several_requests(root, bundle):
    """The server refuses a request of more than limits.max_step_words words (all items' candidates); a remote
    DecoderLM told the limit splits its step into requests under it, and scores every word as the local bundle."""
    config = root / "serve_small_steps.toml"
    config.write_text(write_config(root, bundle, "serve_small.toml").read_text() + "[limits]\nmax_step_words = 50\n")
    words = [f"w{i}" for i in range(12)]
    local = DecoderLM.local(bundle, root / "train3.bin", LAMBDA)
    with ServerProcess(config, root / "server_small_steps.log") as server:
        with DecoderLM.remote(server.address, "exact", max_step_words=50) as remote:
            sent, request = [], remote.backend._request
            remote.backend._request = lambda items, keep: (
                sent.append(sum(len(w) for _, w in items)),
                request(items, keep),
            )[1]
            results = []
            for lm in (local, remote):
                states = [state for _, state in lm.score_many([(lm.start(), w, False) for w in words])]
                # one beam step of 12 states x 10 words = 120 words: three requests of at most 50
                results.append(lm.score_many([(state, w, False) for state in states for w in words[:10]]))
            assert [score for score, _ in results[1]] == pytest.approx([score for score, _ in results[0]], abs=1e-4)
            assert remote.calls == 2 and sent == [12, 50, 50, 20]  # one DecoderLM step each, in requests under 50
        with DecoderLM.remote(server.address, "exact", max_step_words=1000) as unsplit:
            states = [state for _, state in unsplit.score_many([(unsplit.start(), w, False) for w in words])]
            with pytest.raises(LMServeError, match="RESOURCE_EXHAUSTED.*max_step_words"):
                unsplit.score_many([(state, w, False) for state in states for w in words[:10]])
        assert server.stop() == 0
