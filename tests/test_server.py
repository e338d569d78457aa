"""lm-serve end to end: the real server (``lm-serve serve`` in its own process, on a free loopback port) with tiny real
bundles and a real KenLM model, called through the real client and CLI. Every RPC, the decoder API's promise (steps
add up to the sentence score), health and reflection, the status code of each kind of bad request, deadlines, and a
clean shutdown on SIGTERM."""

import io
import json
import math
import re
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
from conftest import make_sentences, running_lm_serve
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from lmserve.rescoring.client import LMServeClient
from lmserve.rescoring.commands.cli import main as rescore_main
from lmserve.rescoring.lmscores import in_vocabulary
from lmserve.rescoring.nbest import Hypothesis, NBestEntry, NBestList, read_nbest, write_nbest
from lmserve.rescoring.ngram import NgramLM, build_ngram
from lmserve.rescoring.rescore import LanguageModels, Setup, reranked, setup_from_record, setup_record, tune
from lmserve.rescoring.scorer import Scorer
from lmserve.rescoring.tune import read_weights, write_weights
from lmserve.server.cli import main as serve_main
from lmserve.server.config import ConfigError, load_config
from lmserve.server.models import ModelSet
from lmserve.v1 import lmserve_pb2 as pb

LAMBDA = 0.4
SENTENCES = ["w1 w2 w3", "", "w5 zzz w7 w7", "w0 w3 w1 w4 w2 w9 w11"]
LIMITS = {
    "max_sentences": 20,
    "max_words": 30,
    "max_lists": 50,
    "max_hypotheses": 400,
    "max_candidates": 10,
    "max_message_bytes": 1 << 20,
}


def noisy_lists(n: int, seed: int) -> NBestList:
    """Each reference and 3 copies with one word replaced; a noisy 'am' score that often prefers a copy."""
    rng = np.random.default_rng(seed)
    entries = []
    for i, ref in enumerate(make_sentences(n, seed=seed)):
        texts = [ref]
        for _ in range(3):
            words = ref.split()
            words[int(rng.integers(len(words)))] = f"w{int(rng.integers(20, 40))}"
            texts.append(" ".join(words))
        am = rng.normal(0, 1, size=4)
        order = np.argsort(-am, kind="stable")
        entries.append(NBestEntry(f"utt{i}", [Hypothesis(texts[k], {"am": float(am[k])}) for k in order], [ref]))
    return NBestList(entries, f"lists{seed}")


@pytest.fixture(scope="module")
def setup_dir(bundles, tmp_path_factory):
    """A config with two models: an exact one with a 3-gram, λ and a tuned weights profile, and a self-normalised one."""
    root = tmp_path_factory.mktemp("serve")
    build_ngram((s.split() for s in make_sentences(300, seed=1)), 3, root / "train3", discount_fallback=True)
    exact, selfnorm = bundles[("full", 0.0)][1], bundles[("adaptive", 0.5)][1]
    models = LanguageModels.load(exact, root / "train3.bin", threads=1)
    dev = noisy_lists(30, 11)
    tuned = tune(
        dev, Setup.parse("am,neural,ngram,interp,length"), models.scores(dev), "wer", "am", (LAMBDA,), restarts=1
    )
    write_weights(root / "dev.weights.json", tuned.result, setup_record(models, tuned.setup))
    limits = "\n".join(f"{k} = {v}" for k, v in LIMITS.items())
    (root / "serve.toml").write_text(
        f'[server]\nworkers = 2\ndefault_model = "exact"\nmetrics_port = 0\n\n[limits]\n{limits}\n\n'
        f'[models.exact]\nbundle = "{exact}"\nngram = "train3.bin"\nlambda = {LAMBDA}\n'
        '[models.exact.profiles]\ndev = "dev.weights.json"\n\n'
        f'[models.selfnorm]\nbundle = "{selfnorm}"\n'
    )
    return root


@pytest.fixture(scope="module")
def server(setup_dir):
    """``lm-serve serve`` on a free port (conftest.running_lm_serve): its address, log and metrics URL."""
    with running_lm_serve(setup_dir, setup_dir / "serve.toml") as server:
        yield server.address, server.log_path, server.metrics_url


@pytest.fixture(scope="module")
def client(server):
    with LMServeClient(server[0], timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def local(bundles, setup_dir):
    """The same models in this process, to check the served numbers against the engine's."""
    return ModelSet.load(load_config(setup_dir / "serve.toml"))


def status_of(call, *args, **kwargs) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kwargs)
    return info.value.code(), info.value.details()


# -- the service is up and discoverable ------------------------------------------------------------------------


def test_health_and_reflection(server, client):
    assert client.health() == "SERVING"
    assert client.health("lmserve.v1.LMService") == "SERVING"
    stub = reflection_pb2_grpc.ServerReflectionStub(client.channel)
    requests = [
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol="lmserve.v1.LMService"),
    ]
    listed, described = list(stub.ServerReflectionInfo(iter(requests), timeout=10))
    names = {s.name for s in listed.list_services_response.service}
    assert names == {  # (no lmserve.v1.Admin: off unless the config says admin = true)
        "lmserve.v1.LMService",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    }
    assert described.file_descriptor_response.file_descriptor_proto  # grpcurl can describe the service


def test_a_new_client_reaches_a_server_restarted_on_the_port_an_old_client_still_dials():
    """An open client whose server went away keeps redialling its address (round-robin), with a growing backoff. A
    client made once a server is back on that port must not share that connection and its backoff: with gRPC's
    process-wide pool it failed at once with UNAVAILABLE, "Connection refused" (a CI failure, when a test's server
    happened to get the port of an earlier one that a test still had a client for)."""

    def health_server(port: int) -> tuple[grpc.Server, int]:
        server = grpc.server(ThreadPoolExecutor(1))
        health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
        bound = server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        return server, bound

    first, port = health_server(0)
    with LMServeClient(f"127.0.0.1:{port}", timeout=5) as old:
        assert old.health() == "SERVING"
        first.stop(None)
        with pytest.raises(grpc.RpcError) as gone:
            old.health()
        assert gone.value.code() == grpc.StatusCode.UNAVAILABLE
        second, _ = health_server(port)
        try:
            with LMServeClient(f"127.0.0.1:{port}", timeout=5) as new:
                assert new.health() == "SERVING"
        finally:
            second.stop(None)


def test_list_models_and_model_info(client, local):
    listed = client.list_models()
    assert listed.default_model == "exact"
    assert [m.name for m in listed.models] == ["exact", "selfnorm"]
    exact, selfnorm = listed.models
    assert exact.normalisation == pb.NORMALISATION_EXACT and selfnorm.normalisation == pb.NORMALISATION_SELF_NORMALISED
    assert exact.ngram_order == 3 and exact.interpolation_weight == LAMBDA and not selfnorm.ngram
    assert [p.name for p in exact.profiles] == ["dev"] and not exact.manifest_json
    info = client.model_info("exact")
    scorer = local.get("exact").lm.scorer
    assert json.loads(info.manifest_json) == scorer.bundle.manifest
    assert info.fingerprint == scorer.fingerprint and info.vocab_size == len(scorer.bundle.tokens)
    profile = info.profiles[0]
    record = read_weights(local.get("exact").profiles["dev"].path)
    assert {w.feature: w.weight for w in profile.weights} == record["weights"]
    assert profile.metric == "wer" and profile.interpolation_weight == LAMBDA
    assert client.model_info().name == "exact"  # no name: the default model


# -- scoring ---------------------------------------------------------------------------------------------------


def test_score_sentences_equals_the_engine(client, local, setup_dir):
    response = client.score_sentences(SENTENCES, "exact", per_token=True)
    assert response.model == "exact" and response.normalisation == pb.NORMALISATION_EXACT
    scorer, ngram = local.get("exact").lm.scorer, NgramLM(setup_dir / "train3.bin")
    for text, got, want in zip(SENTENCES, response.sentences, scorer.score(SENTENCES), strict=True):
        assert list(got.tokens) == [*want.words, "</s>"]
        assert got.oov == want.oov == ("zzz" in text)
        np.testing.assert_allclose(got.neural.token_logprobs, want.token_logprobs, rtol=1e-6)
        assert got.neural.logprob == pytest.approx(want.logprob, abs=1e-5)
        assert got.neural.log10prob == pytest.approx(want.logprob / math.log(10), abs=1e-5)
        ngram_tokens = ngram.token_logprobs(in_vocabulary(want.words, scorer.index))
        np.testing.assert_allclose(got.ngram.token_logprobs, ngram_tokens, rtol=1e-9)
        mixed = np.logaddexp(np.log(LAMBDA) + np.array(got.neural.token_logprobs), np.log(1 - LAMBDA) + ngram_tokens)
        assert got.interpolated.logprob == pytest.approx(mixed.sum(), abs=1e-9)
    plain = client.score_sentences(SENTENCES[:1], "selfnorm")
    assert plain.normalisation == pb.NORMALISATION_SELF_NORMALISED
    assert not plain.sentences[0].tokens and not plain.sentences[0].HasField("ngram")


@pytest.mark.parametrize("model", ["exact", "selfnorm"])
def test_next_word_steps_add_up_to_the_sentence_score(client, model):
    """The decoder API's promise: ScoreNextWords word by word, then </s>, equals ScoreSentences, for every model
    score, including an unknown word and the empty sentence."""
    whole = client.score_sentences(SENTENCES, model).sentences
    for text, sentence in zip(SENTENCES, whole, strict=True):
        state, totals = b"", {"neural": 0.0, "ngram": 0.0, "interpolated": 0.0}
        for word in [*text.split(), "</s>"]:
            (step,) = client.score_next_words([word], state, model).words
            assert step.word == word and step.oov == (word == "zzz")
            for name in totals:
                totals[name] += getattr(step, name)  # ngram, interpolated: 0 when unset
            state = step.state
        assert totals["neural"] == pytest.approx(sentence.neural.logprob, abs=1e-4)
        if model == "exact":
            assert totals["ngram"] == pytest.approx(sentence.ngram.logprob, abs=1e-4)
            assert totals["interpolated"] == pytest.approx(sentence.interpolated.logprob, abs=1e-4)
        else:
            assert not sentence.HasField("ngram") and totals["ngram"] == 0.0


def test_next_words_whole_vocabulary_and_top_k(client, local):
    tokens = local.get("exact").lm.scorer.bundle.tokens
    (first,) = client.score_next_words(["w1"]).words
    table = client.score_next_words(state=first.state, all_words=True).words
    assert [w.word for w in table] == [t for t in tokens if t != "<s>"] and not any(w.state for w in table)
    assert sum(math.exp(w.neural) for w in table) == pytest.approx(1.0, abs=0.02)  # exact model: all but <s>
    assert sum(math.exp(w.interpolated) for w in table) == pytest.approx(1.0, abs=0.02)
    best = client.score_next_words(state=first.state, top_k=3).words
    by_score = sorted(table, key=lambda w: -w.logprob)[:3]
    assert [w.word for w in best] == [w.word for w in by_score]
    again = client.score_next_words([best[0].word], first.state).words[0]
    assert again.logprob == pytest.approx(best[0].logprob, abs=1e-5)
    after = [client.score_next_words(["</s>"], w.state).words[0].logprob for w in (again, best[0])]
    assert after[0] == pytest.approx(after[1], abs=1e-5)  # either state goes on the same way


# -- rescoring -------------------------------------------------------------------------------------------------


def test_rescore_nbest_with_a_profile_equals_the_engine(client, local):
    lists = noisy_lists(20, 12)
    result = client.rescore_nbest(lists, "exact", profile="dev", bootstrap_samples=200)
    model = local.get("exact")
    setup = setup_from_record(read_weights(model.profiles["dev"].path))
    want, _ = reranked(lists, setup, model.lms.scores(lists))
    assert result.profile == "dev" and [w.feature for w in result.weights] == setup.features
    for got, expected in zip(result.lists, want, strict=True):
        assert [h.text for h in got.hypotheses] == [h.text for h in expected.hypotheses]
        for h, e in zip(got.hypotheses, expected.hypotheses, strict=True):
            assert h.score == pytest.approx(e.features["rescore"], abs=1e-6)
            assert set(h.features) == {"am", "neural", "ngram", "interp", "length", "rescore"}
    e = result.evaluation
    assert e.metric == "wer" and e.oracle <= e.rescored < e.first_pass and "bootstrap:200" in e.signature
    assert json.loads(e.report_json)["hypotheses"] == lists.num_hypotheses


def test_rescore_kbest_with_inline_weights_and_no_references(client):
    lists = noisy_lists(5, 13)
    for entry in lists:
        entry.references = []
    result = client.rescore_kbest(
        lists, "exact", weights={"tm": 1.0, "neural": 0.5}, definitions=["tm=2*am+0.1*length"]
    )
    assert not result.HasField("evaluation") and result.interpolation_weight == 0.0
    top = result.lists[0].hypotheses[0]
    assert top.score == pytest.approx(top.features["tm"] + 0.5 * top.features["neural"], abs=1e-9)
    with_refs = client.rescore_kbest(noisy_lists(5, 13), weights={"am": 1.0, "interp": 0.5}, bootstrap_samples=100)
    assert with_refs.evaluation.metric == "bleu" and with_refs.interpolation_weight == LAMBDA


# -- bad requests: a status code and a message, never a crash --------------------------------------------------


def test_bad_requests_get_the_right_status_codes(server, client):
    invalid, exhausted, not_found = (
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.NOT_FOUND,
    )
    lists = noisy_lists(2, 14)
    nan_feature = NBestList([NBestEntry("u", [Hypothesis("w1", {"am": float("nan")})])])
    long_sentence = " ".join(["w1"] * (LIMITS["max_words"] + 1))
    other_model_state = client.score_next_words(["w1"], model="selfnorm").words[0].state
    state = client.score_next_words(["w1"]).words[0].state
    cases = [
        (client.score_sentences, ([],), invalid, "sentences: empty"),
        (client.score_sentences, (["w1"] * (LIMITS["max_sentences"] + 1),), exhausted, "at most 20"),
        (client.score_sentences, ([long_sentence],), exhausted, "sentences[0]: words: 31 given, at most 30"),
        (client.score_sentences, (["w1 " * 400_000],), exhausted, "larger than max"),
        (client.score_sentences, (["w1"], "nope"), not_found, "unknown model 'nope'"),
        (client.rescore_nbest, (lists,), invalid, "give a profile"),
        (client.rescore_nbest, ([],), invalid, "lists: empty"),
        (client.rescore_nbest, (nan_feature,), invalid, "features['am'] = nan"),
        (client.score_next_words, ([],), invalid, "exactly one of"),
        (client.score_next_words, (["w1"] * (LIMITS["max_candidates"] + 1),), exhausted, "candidates: 11 given"),
        (client.score_next_words, (["two words"],), invalid, "one token"),
        (client.score_next_words, (["<s>"],), invalid, "empty state"),
        (client.score_next_words, (["w1"], b"not a state token"), invalid, "state:"),
        (client.score_next_words, (["w1"], other_model_state), invalid, "another model"),
        (client.score_next_words, (["w1"], state[:-1] + bytes([state[-1] ^ 1])), invalid, "checksum"),
        (client.score_next_words, (["w1"], state, "selfnorm"), invalid, "another model"),
        (client.model_info, ("nope",), not_found, "this server has ['exact', 'selfnorm']"),
    ]
    for call, args, code, message in cases:
        got_code, details = status_of(call, *args)
        assert (got_code, message in details) == (code, True), (call.__name__, args[:2], details)
    for kwargs, code, message in [
        ({"profile": "nope"}, not_found, "no weights profile 'nope'; it has ['dev']"),
        ({"weights": {"am": 1.0, "neural": float("nan")}}, invalid, "weights['neural'] = nan"),
        ({"weights": {"am": float("inf")}}, invalid, "weights['am'] = inf"),
        ({"weights": {"am": 1.0, "acoustic": 1.0}}, invalid, "unknown feature 'acoustic'"),
        ({"weights": {"am": 1.0}, "definitions": ["x = 2*"]}, invalid, "feature definition"),
        ({"weights": {"interp": 1.0}, "interpolation_weight": 1.5}, invalid, "interpolation_weight = 1.5"),
        ({"profile": "dev", "weights": {"am": 1.0}}, invalid, "give a profile or weights"),
        ({"weights": {"am": 1.0}, "bootstrap_samples": 10**6}, exhausted, "bootstrap_samples"),
    ]:
        got_code, details = status_of(client.rescore_nbest, lists, **kwargs)
        assert (got_code, message in details) == (code, True), (kwargs, details)
    partly = noisy_lists(2, 15)
    partly.entries[1].references = []
    assert status_of(client.rescore_nbest, partly, weights={"am": 1.0})[0] == invalid
    assert client.health() == "SERVING"


@pytest.mark.parametrize("kind", ["nbest", "kbest"])
def test_list_ids_are_checked_as_lm_rescore_checks_them(client, kind):
    """An id twice or an empty id is INVALID_ARGUMENT naming it (the server once answered OK, where lm-rescore
    refuses such a list: references, caches and reports find lists by id)."""
    call = client.rescore_nbest if kind == "nbest" else client.rescore_kbest
    twice, empty = noisy_lists(3, 16), noisy_lists(3, 16)
    twice.entries[2].id = "utt0"
    empty.entries[1].id = ""
    for lists, message in (
        (twice, "lists[2]: id 'utt0' appears twice (first at lists[0]); expected unique ids"),
        (empty, "lists[1]: id '' is empty; expected an id for every entry"),
    ):
        assert status_of(call, lists, weights={"am": 1.0}) == (grpc.StatusCode.INVALID_ARGUMENT, message)
    assert len(call(noisy_lists(3, 16), weights={"am": 1.0}).lists) == 3


def test_a_missing_feature_is_invalid_and_the_admin_service_is_off_by_default(client):
    """A hypothesis without a feature the weights use was once scored as if it were 0.0, the best log score; and
    Admin/ReloadModels answered anyone on the service port."""
    lists = NBestList([NBestEntry("u", [Hypothesis("w1 w2", {"am": -5.0}), Hypothesis("w3", {})], ["w1"])])
    code, details = status_of(client.rescore_nbest, lists, weights={"am": 1.0, "neural": 0.1})
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "(id 'u').hypotheses[1]: no feature 'am'" in details
    assert status_of(client.reload_models)[0] == grpc.StatusCode.UNIMPLEMENTED  # (the config has no admin = true)


def test_invalid_utf8_is_an_invalid_argument(client):
    """Clients of other languages can send any bytes; a string field that is not UTF-8 is named, not a crash."""
    raw = client.channel.unary_unary("/lmserve.v1.LMService/ScoreSentences")
    sentences_field = b"\x12\x03w1\xff"  # field 2 (sentences), length 3
    code, details = status_of(raw, sentences_field, timeout=10)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "UTF-8" in details


def test_deadlines_end_calls(server, client):
    """A call that outlives its deadline fails with DEADLINE_EXCEEDED, the server ends it (its log line says so)
    and keeps serving."""
    lists = noisy_lists(40, 16)
    before = len(server[1].read_text().splitlines())  # (earlier tests' calls may have ended otherwise)
    with LMServeClient(server[0], timeout=0.05) as hurried:
        code, _ = status_of(hurried.rescore_kbest, lists, weights={"am": 1.0}, bootstrap_samples=10_000)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    ended = None
    for _ in range(100):
        calls = [json.loads(line) for line in server[1].read_text().splitlines()[before:]]
        ended = [c["code"] for c in calls if c.get("method") == "RescoreKBest" and c["code"] != "OK"]
        if ended:
            break
        time.sleep(0.1)
    assert ended and ended[-1] in ("CANCELLED", "DEADLINE_EXCEEDED")
    assert client.score_sentences(["w1"]).sentences[0].neural.logprob < 0


def test_prometheus_metrics(server, client):
    """Calls by method and code, latency histograms, tokens scored and the unknown words among them, on the metrics
    port."""
    before = client.score_sentences(["w1 zzz w2", "w3"], "selfnorm")  # zzz: outside the vocabulary
    assert [s.oov for s in before.sentences] == [1, 0]
    client.score_next_words_batch([(b"", ["w1", "zzz"]), (b"", ["qqq"])], "selfnorm")  # a beam step: 2 unknown
    with client.stream_next_words() as stream:  # a stream counts its steps' unknown words when it ends
        stream.step([(b"", ["zzz", "w2"])], "selfnorm")
    status_of(client.model_info, "nope")
    stream_counted = 'lmserve_unknown_words_scored_total{method="StreamNextWords",model="selfnorm"}'
    for _ in range(50):  # the server counts the stream once it has seen it end, just after the client closed it
        samples = {}
        for line in urllib.request.urlopen(server[2], timeout=10).read().decode().splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                samples[name] = float(value)
        if stream_counted in samples and samples["lmserve_requests_in_flight"] == 0:
            break
        time.sleep(0.1)
    assert samples['lmserve_requests_total{code="OK",method="ScoreSentences"}'] >= 1
    assert samples['lmserve_requests_total{code="NOT_FOUND",method="GetModelInfo"}'] >= 1
    assert samples['lmserve_request_seconds_bucket{le="+Inf",method="ScoreSentences"}'] >= 1
    assert samples['lmserve_tokens_scored_total{method="ScoreSentences",model="selfnorm"}'] >= 6  # 4 + 2 tokens
    assert samples['lmserve_unknown_words_scored_total{method="ScoreSentences",model="selfnorm"}'] >= 1
    assert samples['lmserve_unknown_words_scored_total{method="ScoreNextWordsBatch",model="selfnorm"}'] >= 2
    assert samples[stream_counted] >= 1
    assert samples["lmserve_requests_in_flight"] == 0


# -- the command line ------------------------------------------------------------------------------------------


def test_client_cli(server, client, tmp_path, monkeypatch, capsys):
    target = ["client", "--server", server[0]]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("\n".join(SENTENCES).encode() + b"\n")))
    assert serve_main([*target, "score", "--model", "exact"]) == 0
    printed = [float(x) for x in capsys.readouterr().out.split()]
    want = [s.neural.logprob for s in client.score_sentences(SENTENCES, "exact").sentences]
    np.testing.assert_allclose(printed, want, atol=1e-5)

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"w1 w2\n")))
    assert serve_main([*target, "score", "--format", "jsonl", "--score", "interpolated", "--log10"]) == 0
    record = json.loads(capsys.readouterr().out)
    interpolated = client.score_sentences(["w1 w2"], "exact").sentences[0].interpolated
    assert list(record) == ["text", "logprob", "log10prob", "oov"] and record["text"] == "w1 w2"
    assert record["logprob"] == pytest.approx(interpolated.logprob)

    lists, out = tmp_path / "lists.jsonl", tmp_path / "out.jsonl"
    write_nbest(noisy_lists(6, 17), lists, "jsonl")
    assert serve_main([*target, "rescore", str(lists), "--profile", "dev", "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["profile"] == "dev" and summary["evaluation"]["metric"] == "wer"
    for entry in read_nbest(out):
        scores = [h.features["rescore"] for h in entry.hypotheses]
        assert scores == sorted(scores, reverse=True) and all(h.rank for h in entry.hypotheses)

    assert serve_main([*target, "models"]) == 0
    assert [m["name"] for m in json.loads(capsys.readouterr().out)["models"]] == ["exact", "selfnorm"]
    assert serve_main([*target, "info", "nope"]) == 1
    assert "NOT_FOUND: unknown model 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("form", [["--format", "jsonl", "--per-token"], ["--format", "jsonl"], ["--per-token"], []])
def test_client_score_and_lm_rescore_score_print_a_score_alike(server, bundles, tmp_path, monkeypatch, capsys, form):
    """The same score, laid out the same way by both commands (``rescoring.score_lines``)."""
    (tmp_path / "s.txt").write_text("w1 w2 w3\nw9\n")
    assert (
        serve_main(
            ["client", "--server", server[0], "score", "--model", "exact", "--input", str(tmp_path / "s.txt"), *form]
        )
        == 0
    )
    served = capsys.readouterr().out.splitlines()
    assert (
        rescore_main(["score", "--lm", str(bundles[("full", 0.0)][1]), "--input", str(tmp_path / "s.txt"), *form]) == 0
    )
    local = capsys.readouterr().out.splitlines()
    assert len(served) == len(local) == 2
    for a, b in zip(served, local, strict=True):
        if "jsonl" in form:
            a, b = json.loads(a), json.loads(b)
            assert list(a) == list(b) and a["text"] == b["text"] and a["oov"] == b["oov"]
            assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-4)
            assert [w for w, _ in a.get("tokens", [])] == [w for w, _ in b.get("tokens", [])]
        else:
            (total_a, *tokens_a), (total_b, *tokens_b) = a.split("\t"), b.split("\t")
            assert float(total_a) == pytest.approx(float(total_b), abs=1e-4) and len(tokens_a) == len(tokens_b)
            words = [[pair.split("=")[0] for pair in t.split()] for t in (*tokens_a, *tokens_b)]
            assert words[: len(words) // 2] == words[len(words) // 2 :]


def test_client_rescore_writes_the_html_report(server, tmp_path, capsys):
    """``lm-serve client rescore --html``: the page of ``lm-rescore nbest --html`` from the server's answer."""
    from test_report_html import assert_offline, page_data

    lists, out, page = tmp_path / "lists.jsonl", tmp_path / "out.jsonl", tmp_path / "report.html"
    write_nbest(noisy_lists(6, 17), lists, "jsonl")
    target = ["client", "--server", server[0], "rescore", str(lists), "--model", "exact", "--profile", "dev"]
    assert serve_main([*target, "--out", str(out), "--html", str(page)]) == 0
    summary = json.loads(capsys.readouterr().out)
    html = page.read_text()
    assert_offline(html)
    data = page_data(html)
    assert data["report"]["rescored"]["wer"] == pytest.approx(summary["evaluation"]["rescored"])
    assert data["report"]["normalisation"] == "exact"
    assert [u["k"] for u in data["utterances"]] == [e.hypotheses[0].rank for e in read_nbest(out)]


def test_client_rescore_takes_the_feature_default_its_error_advises(server, tmp_path, capsys):
    """A list whose hypothesis lacks a feature is refused with advice to give --feature-default, which ``lm-serve
    client rescore`` once did not accept."""
    lists = noisy_lists(3, 18)
    del lists.entries[1].hypotheses[2].features["am"]
    write_nbest(lists, tmp_path / "l.jsonl", "jsonl")
    target = ["client", "--server", server[0], "rescore", str(tmp_path / "l.jsonl"), "--weights", "am=1,neural=0.1"]
    assert serve_main(target) == 2
    assert "--feature-default am=VALUE" in capsys.readouterr().err
    assert serve_main([*target, "--feature-default", "am=-100"]) == 0
    assert json.loads(capsys.readouterr().out)["lists"] == 3


def test_lm_rescore_with_server_scores_as_the_loaded_models_do(server, setup_dir, tmp_path, capsys):
    """``lm-rescore --server``: the service's per-token scores equal the ones of the same models loaded here, and a
    weights file tuned through the server sends ``nbest`` back to it. 120 hypotheses against the server's limit of
    20 sentences per call: the client splits its requests."""
    dev, test = tmp_path / "dev.jsonl", tmp_path / "test.jsonl"
    write_nbest(noisy_lists(30, 21), dev, "jsonl")
    write_nbest(noisy_lists(10, 22), test, "jsonl")
    tune_args = ["tune", str(dev), "--metric", "wer", "--features", "am,neural,ngram,interp,length", "--fixed", "am"]
    tune_args += ["--lambdas", str(LAMBDA), "--restarts", "1", "--quiet"]
    exact = ["--lm", str(read_weights(setup_dir / "dev.weights.json")["setup"]["lm"]), "--ngram"]
    exact.append(str(setup_dir / "train3.bin"))
    served = ["--server", server[0], "--server-model", "exact"]
    for name, models in (("local", exact), ("remote", served)):
        out = ["--out", str(tmp_path / f"{name}.weights.json"), "--cache", str(tmp_path / f"{name}.lmscores.jsonl")]
        assert rescore_main([*tune_args, *models, *out]) == 0
    capsys.readouterr()

    def cached(name):
        lines = (tmp_path / f"{name}.lmscores.jsonl").read_text().splitlines()[1:]
        return [h for line in lines for h in json.loads(line)["hypotheses"]]

    local, remote = cached("local"), cached("remote")
    assert len(remote) == 120
    for a, b in zip(local, remote, strict=True):
        assert a["oov"] == b["oov"]
        np.testing.assert_allclose(a["neural"], b["neural"], atol=1e-4)
        np.testing.assert_allclose(a["ngram"], b["ngram"], atol=1e-5)
    setup = read_weights(tmp_path / "remote.weights.json")["setup"]
    assert setup["server"] == server[0] and setup["model"] == "exact"

    weights = ["--weights", str(tmp_path / "remote.weights.json")]
    chosen = {}
    for name, models in (("remote", []), ("local", exact)):  # the weights file names the server; --lm overrides it
        out = tmp_path / f"test.{name}.jsonl"
        assert rescore_main(["nbest", str(test), *weights, *models, "--out", str(out), "--quiet"]) == 0
        chosen[name] = [entry.hypotheses[0].text for entry in read_nbest(out)]
    assert chosen["remote"] == chosen["local"]
    capsys.readouterr()

    args = ["nbest", str(test), *weights, *served, "--ngram", "x.bin", "--out", str(tmp_path / "x.jsonl")]
    assert rescore_main(args) == 2
    assert "leave out --ngram" in capsys.readouterr().err
    assert (
        rescore_main([*tune_args, "--server", server[0], "--server-model", "nope", "--out", str(tmp_path / "x")]) == 2
    )
    assert "NOT_FOUND: unknown model 'nope'" in capsys.readouterr().err


# -- configs ---------------------------------------------------------------------------------------------------


def test_config_errors_name_the_key(setup_dir, tmp_path):
    base = (setup_dir / "serve.toml").read_text()
    cases = {
        "[server]\nprot = 1\n" + base.split("\n", 1)[1]: "unknown key server.prot",
        base.replace("workers = 2", 'workers = "2"'): "server.workers = '2': expected an integer",
        base.replace(f"lambda = {LAMBDA}", "lambda = 1.5"): "models.exact.lambda = 1.5",
        base.replace('default_model = "exact"', 'default_model = "x"'): "server.default_model = 'x'",
        "[server]\nport = 1\n": "no models",
    }
    for text, message in cases.items():
        path = setup_dir / "bad.toml"
        path.write_text(text)
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(path)
    mismatched = setup_dir / "mismatched.toml"
    mismatched.write_text(base.replace("[models.exact.profiles]", 'normalize = "lower"\n[models.exact.profiles]'))
    with pytest.raises(ConfigError, match="tuned with normalize = None, the model uses 'lower'"):
        ModelSet.load(load_config(mismatched))


def test_a_scorer_fingerprint_is_the_bundles(bundles):
    """Replicas loading the same bundle agree on the fingerprint (state tokens move between them)."""
    bundle = bundles[("full", 0.0)][1]
    assert Scorer(bundle, threads=1).fingerprint == Scorer(Path(bundle), threads=1).fingerprint
    assert Scorer(bundle, threads=1).fingerprint != Scorer(bundles[("adaptive", 0.5)][1], threads=1).fingerprint
