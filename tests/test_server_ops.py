"""Operating lm-serve: hot reload (admin call and SIGHUP) under a stream of calls, a reload that fails, the drain on
SIGTERM, and TLS / mutual TLS with certificates made here by ``openssl``. Real servers in child processes on free
loopback ports; waits are on the server's log records or on the calls themselves."""

import asyncio
import os
import re
import signal
import subprocess
import threading
import time
import weakref
from collections import Counter
from pathlib import Path

import grpc
import numpy as np
import pytest
from conftest import make_sentences
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lmserve.rescoring.client import LMServeClient, hypothesis_list
from lmserve.rescoring.nbest import Hypothesis, NBestEntry
from lmserve.server.app import LMServer, admin_exposure, server_credentials
from lmserve.server.config import ConfigError, load_config
from lmserve.server.models import ModelSet
from lmserve.server.process import ServerProcess
from lmserve.v1 import lmserve_pb2 as pb
from lmserve.v1.lmserve_pb2_grpc import LMServiceStub

SENTENCES = ["w1 w2 w3", "w4 w5", ""]


def write_config(path: Path, bundle: Path, *sections: str, server: str = "", workers: int = 1) -> Path:
    admin = "" if "admin" in server else "admin = true\n"  # (off by default)
    head = f"[server]\nworkers = {workers}\ngrace_seconds = 60.0\n{admin}{server}"
    path.write_text("\n".join([head, *sections, f'[models.m]\nbundle = "{bundle}"\n']))
    return path


def status_of(call, *args, **kwargs) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kwargs)
    return info.value.code(), info.value.details()


def slow_request(seed: int = 0) -> pb.RescoreKBestRequest:
    """Seconds of work that is not scoring: a BLEU bootstrap of 10000 samples over 60 lists."""
    rng = np.random.default_rng(seed)
    request = pb.RescoreKBestRequest(bootstrap_samples=10_000)
    request.combination.weights.update({"am": 1.0, "neural": 0.3})
    for i, ref in enumerate(make_sentences(60, seed=seed)):
        hyps = [Hypothesis(ref, {"am": 0.0}), Hypothesis(f"{ref} w{i % 9}", {"am": float(rng.normal())})]
        request.lists.append(hypothesis_list(NBestEntry(f"s{i}", hyps, [ref])))
    return request


def logged_calls(server: ServerProcess, method: str) -> list[dict]:
    return [r for r in server.records if r.get("message") == "call" and r.get("method") == method]


# -- hot reload ------------------------------------------------------------------------------------------------


class CallStream:
    """Threads calling ScoreSentences back to back until stopped; every outcome, and which model answered (by its
    score of the first sentence), is kept."""

    def __init__(self, address: str, threads: int = 3):
        self.outcomes: list[str] = []
        self.neural: list[float] = []
        self.changed = threading.Condition()
        self.done = threading.Event()
        self.threads = [threading.Thread(target=self.run, args=(address,)) for _ in range(threads)]
        for thread in self.threads:
            thread.start()

    def run(self, address: str) -> None:
        with LMServeClient(address, timeout=30) as client:
            while not self.done.is_set():
                try:
                    response = client.score_sentences(SENTENCES)
                    outcome, neural = "OK", response.sentences[0].neural.logprob
                except grpc.RpcError as e:
                    outcome, neural = e.code().name, None
                with self.changed:
                    self.outcomes.append(outcome)
                    self.neural.append(neural)
                    self.changed.notify_all()

    def wait_for_answer(self, neural: float, timeout: float = 30) -> None:
        """Until a call of the stream, from now on, is answered with this score (by the model that gives it)."""
        with self.changed:
            start = len(self.neural)
            assert self.changed.wait_for(lambda: neural in self.neural[start:], timeout), "no such answer"

    def stop(self) -> list[str]:
        self.done.set()
        for thread in self.threads:
            thread.join()
        return self.outcomes


@pytest.mark.parametrize("engine", ["threads", "processes"])
def test_reload_swaps_models_under_load_and_a_failed_one_keeps_them(bundles, tmp_path, engine):
    """With ``engine = "processes"`` the scoring processes must pick up each generation too (the scores change)."""
    old, new = bundles[("full", 0.0)][1], bundles[("full", 0.5)][1]
    broken = tmp_path / "broken.bundle"
    broken.mkdir()
    (broken / "manifest.json").write_text("{ not json")
    config = write_config(tmp_path / "serve.toml", old, server=f'engine = "{engine}"\n')
    with (
        ServerProcess(config, tmp_path / "server.log", "--log-level", "debug") as server,
        LMServeClient(server.address, timeout=60) as client,
    ):
        first = client.model_info()
        scores = {"old": client.score_sentences(SENTENCES).sentences[0].neural.logprob}
        slow = client.stub.RescoreKBest.future(slow_request(), timeout=60)  # in flight across the reload
        server.wait_for(lambda r: r.get("message") == "call started" and r["method"] == "RescoreKBest", 30)
        stream = CallStream(server.address)

        write_config(config, new, server=f'engine = "{engine}"\n')
        reloaded = client.reload_models()
        assert reloaded.generation == 2 and reloaded.default_model == "m"
        assert reloaded.models[0].fingerprint == client.model_info().fingerprint != first.fingerprint
        scores["new"] = client.score_sentences(SENTENCES).sentences[0].neural.logprob
        assert scores["new"] != scores["old"]
        stream.wait_for_answer(scores["new"])

        write_config(config, old, server=f'engine = "{engine}"\n')  # and back, by signal
        mark = len(server.records)
        server.send(signal.SIGHUP)
        server.wait_for(lambda r: r.get("message") == "reloaded", 60, after=mark)
        assert client.list_models().generation == 3 and client.model_info().fingerprint == first.fingerprint
        stream.wait_for_answer(scores["old"])

        write_config(config, broken, server=f'engine = "{engine}"\n')
        code, details = status_of(client.reload_models)
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        assert "still serving generation 3" in details and str(broken) in details
        mark = len(server.records)
        server.send(signal.SIGHUP)
        failed = server.wait_for(lambda r: r.get("message") == "reload failed", 60, after=mark)
        assert str(broken) in failed["error"]
        assert client.list_models().generation == 3 and client.model_info().fingerprint == first.fingerprint

        outcomes = stream.stop()
        result = slow.result().result
        assert server.stop() == 0
    assert outcomes and set(outcomes) == {"OK"}, (
        f"failed calls during reloads: {outcomes.count('OK')} OK of {len(outcomes)}"
    )
    # the call in flight finished on the model it started with, after the swap
    slow_line = logged_calls(server, "RescoreKBest")[0]
    assert slow_line["code"] == "OK"
    assert server.records.index(slow_line) > next(i for i, r in enumerate(server.records) if r["message"] == "reloaded")
    with ServerProcess(write_config(tmp_path / "old.toml", old), tmp_path / "old.log") as reference:
        with LMServeClient(reference.address, timeout=60) as old_client:
            request = slow_request()
            request.bootstrap_samples = 10
            expected = old_client.stub.RescoreKBest(request).result
    assert [h.features["neural"] for x in result.lists for h in x.hypotheses] == [
        h.features["neural"] for x in expected.lists for h in x.hypotheses
    ]


@pytest.mark.parametrize("engine", ["threads", "processes"])
def test_a_reload_frees_the_old_models(bundles, tmp_path, engine):
    """Once swapped out and past their last call, nothing holds the old models: each set is the size of its graphs
    and n-gram, and a reload that kept them would grow the process by that much every time (the scoring processes'
    pool, which starts new workers with the current models, holds references to them, not the models)."""
    config = load_config(
        write_config(tmp_path / "serve.toml", bundles[("full", 0.0)][1], server=f'engine = "{engine}"\n')
    )

    async def scenario() -> bool:
        server = LMServer(config, ModelSet.load(config))
        port = await server.start(port=0)
        old = weakref.ref(server.models.get("m"))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = LMServiceStub(channel)
            await stub.ScoreSentences(pb.ScoreSentencesRequest(sentences=SENTENCES), timeout=30)
            await server.reloader.reload()
            await stub.ScoreSentences(pb.ScoreSentencesRequest(sentences=SENTENCES), timeout=30)
        held = old() is not None
        await server.stop()
        return held

    assert not asyncio.run(scenario())


# -- scoring processes -----------------------------------------------------------------------------------------


def test_scoring_processes_answer_like_threads_and_a_dead_one_is_replaced(bundles, tmp_path):
    bundle = bundles[("full", 0.0)][1]
    lists = slow_request().lists[:8]
    answers = {}
    for engine in ("threads", "processes"):
        config = write_config(tmp_path / f"{engine}.toml", bundle, server=f'engine = "{engine}"\n', workers=2)
        with ServerProcess(config, tmp_path / f"{engine}.log") as server, LMServeClient(server.address) as client:
            request = pb.RescoreNBestRequest(lists=lists)
            request.combination.weights.update({"am": 1.0, "neural": 0.3, "length": -0.5})
            answers[engine] = [client.score_sentences(SENTENCES), client.stub.RescoreNBest(request, timeout=30)]
            if engine == "processes":
                pids = server.wait_for(lambda r: r.get("message") == "scoring processes", 1)["pids"]
                assert len(set(pids)) == 2 and server.pid not in pids
                os.kill(pids[0], signal.SIGKILL)
                failed, deadline = 0, time.monotonic() + 30
                while not any(r.get("message") == "scoring processes replaced" for r in server.records):
                    assert time.monotonic() < deadline, "the dead scoring process was not replaced"
                    try:
                        client.score_sentences(SENTENCES)
                    except grpc.RpcError as e:  # the call that met the broken pool
                        assert e.code() == grpc.StatusCode.INTERNAL
                        failed += 1
                assert failed <= 1
                answers["replaced"] = [client.score_sentences(SENTENCES), client.stub.RescoreNBest(request, timeout=30)]
    assert answers["processes"] == answers["threads"] == answers["replaced"]


# -- graceful shutdown -----------------------------------------------------------------------------------------


def test_sigterm_drains_the_calls_in_flight_and_refuses_new_ones(bundles, tmp_path):
    config = write_config(tmp_path / "serve.toml", bundles[("full", 0.0)][1])
    with (
        ServerProcess(config, tmp_path / "server.log", "--log-level", "debug") as server,
        LMServeClient(server.address, timeout=60) as client,
    ):
        health = health_pb2_grpc.HealthStub(client.channel).Watch(health_pb2.HealthCheckRequest(service=""))
        assert next(health).status == health_pb2.HealthCheckResponse.SERVING
        calls = [client.stub.RescoreKBest.future(slow_request(seed), timeout=60) for seed in range(3)]
        server.wait_for(lambda r: r.get("message") == "call started" and r["method"] == "RescoreKBest", 30, count=3)
        server.send(signal.SIGTERM)
        assert next(health).status == health_pb2.HealthCheckResponse.NOT_SERVING
        stopping = server.wait_for(lambda r: r.get("message") == "stopping", 30)
        assert stopping["in_flight"] >= 3
        with LMServeClient(server.address, timeout=10) as late:  # refused: by the closed port, or by gRPC as it stops
            assert status_of(late.score_sentences, ["w1"])[0] in (
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.CANCELLED,
            )
        results = [call.result() for call in calls]  # none fails
        assert server.wait() == 0
    assert all(len(r.result.lists) == 60 for r in results)
    lines = [r["message"] for r in server.records if r.get("level") != "debug"]
    assert lines[-1] == "stopped" and "grace period over" not in lines
    ends = logged_calls(server, "RescoreKBest")
    assert [r["code"] for r in ends] == ["OK"] * 3
    assert all(server.records.index(r) > server.records.index(stopping) for r in ends)  # answered during the drain
    assert not logged_calls(server, "ScoreSentences")  # the late call never reached the service


def test_calls_cut_short_when_the_grace_period_runs_out_leave_a_json_log(bundles, tmp_path):
    """Past ``grace_seconds`` the calls still in flight are cancelled: they get UNAVAILABLE or CANCELLED, the server
    exits 0, and every line of its log is JSON (once gRPC's own task of each such call, left for ``asyncio.run``
    to cancel, printed a bare CancelledError traceback into the log)."""
    config = write_config(tmp_path / "serve.toml", bundles[("full", 0.0)][1])
    config.write_text(config.read_text().replace("grace_seconds = 60.0", "grace_seconds = 0.2"))
    with (
        ServerProcess(config, tmp_path / "server.log", "--log-level", "debug") as server,
        LMServeClient(server.address, timeout=60) as client,
    ):
        calls = [client.stub.RescoreKBest.future(slow_request(seed), timeout=60) for seed in range(3)]
        server.wait_for(lambda r: r.get("message") == "call started" and r["method"] == "RescoreKBest", 30, count=3)
        server.send(signal.SIGTERM)
        assert server.wait() == 0
    # one worker runs the calls in turn: the first may end inside the grace (seen in CI), the last cannot
    cut = [call.exception() for call in calls if call.exception() is not None]
    assert cut, "all three calls ended inside 0.2 s: the requests are too quick to test the cut"
    codes = {error.code() for error in cut}
    assert codes <= {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}, codes
    assert not [r["message"] for r in server.records if r.get("level") == "raw"]  # every line JSON
    lines = [r["message"] for r in server.records if r.get("level") != "debug"]
    assert "grace period over" in lines and lines[-1] == "stopped", lines


# -- replicas --------------------------------------------------------------------------------------------------


def test_replicas_take_turns_reload_and_drain_as_one_service(bundles, tmp_path):
    """``--replicas 2``: two processes on their own ports, one ``listening`` line with the round-robin target; the
    client's round-robin sends each call to the next replica, the answers are the same wherever they come from, and
    SIGHUP / SIGTERM reach both."""
    config = write_config(tmp_path / "serve.toml", bundles[("full", 0.0)][1])
    with ServerProcess(config, tmp_path / "server.log", "--replicas", "2") as server:
        ports = server.wait_for(lambda r: r.get("message") == "listening" and "replica" not in r, 1)["ports"]
        assert server.address == f"ipv4:127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}" and ports[0] != ports[1]
        with LMServeClient(server.address, timeout=30) as client:
            answers = {client.score_sentences(SENTENCES).sentences[0].neural.logprob for _ in range(20)}
            mark = len(server.records)
            server.send(signal.SIGHUP)
            server.wait_for(lambda r: r.get("message") == "reloaded", 60, after=mark, count=2)
            assert client.list_models().generation == 2
        assert server.stop() == 0
    served = Counter(r["replica"] for r in logged_calls(server, "ScoreSentences"))
    reloaded = {r["replica"] for r in server.records if r.get("message") == "reloaded"}
    stopped = [r.get("replica") for r in server.records if r.get("message") == "stopped"]
    assert len(answers) == 1
    # strict turns once both connections are up; the first calls may all go to the one that was ready first
    assert sum(served.values()) == 20 and min(served[0], served[1]) >= 5, served
    assert reloaded == {0, 1} and sorted(stopped, key=str) == [0, 1, None]  # None: the supervisor, last


def test_replicas_stop_together_when_one_exits(bundles, tmp_path):
    config = write_config(tmp_path / "serve.toml", bundles[("full", 0.0)][1])
    with ServerProcess(config, tmp_path / "server.log", "--replicas", "2") as server:
        first = server.wait_for(lambda r: r.get("message") == "listening" and r.get("replica") == 0, 1)
        os.kill(first["pid"], signal.SIGKILL)
        assert server.wait() == 1
    assert any(r.get("message") == "a replica exited: stopping the others" for r in server.records)
    assert [r.get("replica") for r in server.records if r.get("message") == "stopped"][:1] == [1]


# -- TLS ---------------------------------------------------------------------------------------------------------


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def certificate(folder: Path, name: str, ca: str | None, extensions: str = "") -> None:
    """``name.key`` and ``name.pem`` (EC P-256, one day): a self-signed CA when ``ca`` is None, else signed by it."""
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", f"{name}.key"]
    if ca is None:
        openssl("req", "-x509", *key, "-out", f"{name}.pem", "-days", "1", "-subj", f"/CN={name}", cwd=folder)
        return
    openssl("req", *key, "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=folder)
    (folder / f"{name}.ext").write_text(extensions or "basicConstraints=CA:FALSE\n")
    openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
        "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext", cwd=folder,
    )  # fmt: skip


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tls")
    certificate(folder, "ca", None)
    certificate(folder, "server", "ca", "subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    certificate(folder, "client", "ca", "extendedKeyUsage=clientAuth\n")
    certificate(folder, "rogue_ca", None)
    certificate(folder, "rogue", "rogue_ca", "extendedKeyUsage=clientAuth\n")
    return folder


def tls_config(tmp_path: Path, bundle: Path, certs: Path, mutual: bool) -> Path:
    tls = f'[tls]\ncert = "{certs / "server.pem"}"\nkey = "{certs / "server.key"}"\n'
    if mutual:
        tls += f'client_ca = "{certs / "ca.pem"}"\n'
    return write_config(tmp_path / "serve.toml", bundle, tls)


def answers(address: str, **tls) -> bool:
    """Whether a call over a fresh channel with these TLS settings gets an answer (False: the handshake failed)."""
    with LMServeClient(address, timeout=10, **tls) as client:
        try:
            return client.score_sentences(["w1"]).sentences[0].neural.logprob < 0
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE, e.details()
            return False


def test_tls_needs_the_servers_ca(bundles, certs, tmp_path):
    config = tls_config(tmp_path, bundles[("full", 0.0)][1], certs, mutual=False)
    with ServerProcess(config, tmp_path / "server.log") as server:
        assert server.records[-1]["tls"] == "server"
        assert answers(server.address, ca=certs / "ca.pem")
        assert answers(server.address, ca=certs / "ca.pem", cert=certs / "client.pem", key=certs / "client.key")
        assert not answers(server.address)  # plaintext
        assert not answers(server.address, ca=certs / "rogue_ca.pem")  # a server we cannot verify
        assert server.stop() == 0


def test_mutual_tls_needs_a_client_certificate_from_its_ca(bundles, certs, tmp_path):
    config = tls_config(tmp_path, bundles[("full", 0.0)][1], certs, mutual=True)
    with ServerProcess(config, tmp_path / "server.log") as server:
        assert server.records[-1]["tls"] == "mutual"
        assert answers(server.address, ca=certs / "ca.pem", cert=certs / "client.pem", key=certs / "client.key")
        assert not answers(server.address, ca=certs / "ca.pem")  # no client certificate
        assert not answers(server.address, ca=certs / "ca.pem", cert=certs / "rogue.pem", key=certs / "rogue.key")
        assert not answers(server.address)
        assert server.stop() == 0


def test_tls_batching_and_admin_config_errors_name_the_key(bundles, certs, tmp_path):
    bundle = bundles[("full", 0.0)][1]
    cases = {
        ('[tls]\ncert = "server.pem"\n', ""): "tls.key is missing",
        ('[tls]\ncert = "a"\nkey = "b"\nca = "c"\n', ""): "unknown key tls.ca",
        ("[batching]\nenabled = 1\n", ""): "batching.enabled = 1: expected true or false",
        ("[batching]\nmax_wait_ms = -1\n", ""): "batching.max_wait_ms = -1.0",
        ("", "admin = 1\n"): "server.admin = 1: expected true or false",
        ("", 'engine = "fork"\n'): "server.engine = 'fork': expected one of ['threads', 'processes']",
    }
    for (section, server), message in cases.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(write_config(tmp_path / "bad.toml", bundle, section, server=server))
    (tmp_path / "not.pem").write_text("hello")
    tls = f'[tls]\ncert = "not.pem"\nkey = "{certs / "server.key"}"\n'
    config = load_config(write_config(tmp_path / "tls.toml", bundle, tls))
    with pytest.raises(ConfigError, match=re.escape(f"tls.cert = '{tmp_path / 'not.pem'}': expected a PEM file")):
        server_credentials(config.tls)
    config.tls.key = tmp_path / "missing.key"
    with pytest.raises(ConfigError, match="tls.key = .*missing.key': cannot read it"):
        server_credentials(config.tls)


def admin_config(tmp_path: Path, admin: bool, tls: str = ""):
    path = tmp_path / "serve.toml"
    path.write_text(f'[server]\nadmin = {str(admin).lower()}\n{tls}\n[models.m]\nbundle = "b"\n')
    return load_config(path)


@pytest.mark.parametrize(
    ("host", "admin", "tls", "warned"),
    [
        ("0.0.0.0", True, "", "without TLS"),
        ("10.1.2.3", True, '[tls]\ncert = "c"\nkey = "k"\n', "with TLS but no client_ca"),
        ("::", True, "", "without TLS"),
        ("0.0.0.0", True, '[tls]\ncert = "c"\nkey = "k"\nclient_ca = "ca"\n', None),
        ("127.0.0.1", True, "", None),
        ("::1", True, "", None),
        ("localhost", True, "", None),
        ("0.0.0.0", False, "", None),
    ],
)
def test_an_admin_service_open_to_the_network_is_warned_about(tmp_path, host, admin, tls, warned):
    message = admin_exposure(admin_config(tmp_path, admin, tls), host)
    if warned is None:
        assert message is None
    else:
        assert f"admin = true on {host}, {warned}: anyone who reaches the port can reload the models" in message


def test_the_shipped_serve_config_serves_what_make_demo_writes():
    """``configs/serve_demo.toml`` (README: "Serving") reads, and names the bundle, n-gram and weights file that the
    Makefile's demo target writes: renaming one there without the other fails here."""
    root = Path(__file__).resolve().parents[1]
    config = load_config(root / "configs" / "serve_demo.toml")
    demo = (root / "Makefile").read_text().split("\ndemo:", 1)[1].split("\n\n", 1)[0]
    [model] = config.models.values()
    written = [model.bundle, model.ngram, *model.profiles.values()]
    for path in written:
        assert path.resolve().is_relative_to(root / "var")
        assert str(path.resolve().relative_to(root)) in demo, f"make demo does not write {path}"
