"""lm-serve when decoders lean on it: the memory of the worst calls its default limits allow, and health under a full
load of streams -> serve_limits.json

    python -m benchmarks.serve_limits [--bundle var/bundles/demo] [--streams 64] [--only server] [--results DIR]

A real ``lm-serve serve`` (``server.process.ServerProcess``) with the default ``[server]`` and ``[limits]`` serves the
demo bundle (``make demo``) or, where that is missing, a bundle of the same shape trained here in seconds
(var/serve_limits/). One section of metrics per part of the service, each a function in ``SECTIONS`` taking the
shared :class:`Setup`: ``server`` (:func:`server_section`: the peak RSS after the worst single call of each kind the
limits allow, sizes found by asking the server; the same step sent by ``--streams`` streams at once; health checks
failed meanwhile and while 4 x ``--streams`` more are attempted) and ``decoder_clients``
(``benchmarks.serve_decoder_clients`` on the shipped English LM). Figures: docs/benchmarks/serving.md ("Limits,
health and decoder clients under load").
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.common import ROOT, add_results_option, run_measured, use_results, write_result
from benchmarks.serve_harness import rss_bytes
from lmserve.core.bundle import Bundle
from lmserve.server.config import Limits, ServerSettings
from lmserve.server.process import ServerProcess
from lmserve.v1 import lmserve_pb2 as pb

DEMO_BUNDLE = ROOT / "var" / "bundles" / "demo"
BUILT = ROOT / "var" / "serve_limits"  # the stand-in bundle and its corpus, when there is no demo bundle
STEP_METHOD = "/lmserve.v1.LMService/ScoreNextWordsBatch"
STREAM_METHOD = "/lmserve.v1.LMService/StreamNextWords"
MODES = ("scores_only", "tokens", "cache_states")
HEALTH_INTERVAL = 0.05  # seconds between health checks while streams run


@dataclass
class Setup:
    """What every section gets: the bundle served, a scratch folder, and the options."""

    bundle: Path
    tmp: Path
    args: argparse.Namespace


# -- the bundle ---------------------------------------------------------------------------------------------------


def stand_in_bundle() -> Path:
    """A bundle of the demo's shape (2x128 LSTM, adaptive softmax, 10k words) trained for 20k tokens on Zipf-drawn
    text: its numbers mean nothing, its sizes (states, vocabulary) are the demo's."""
    bundle = BUILT / "bundle"
    if (bundle / "manifest.json").exists():
        return bundle
    BUILT.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    words = np.array([f"w{i}" for i in range(10_000)])
    weights = 1.0 / np.arange(1, len(words) + 1)
    for name, sentences in (("train", 30_000), ("valid", 200), ("test", 200)):
        lengths = rng.integers(3, 25, size=sentences)
        drawn = rng.choice(len(words), size=int(lengths.sum()), p=weights / weights.sum())
        lines, start = [], 0
        for length in lengths:
            lines.append(" ".join(words[drawn[start : start + length]]))
            start += length
        (BUILT / f"{name}.txt").write_text("\n".join(lines) + "\n")
    config = BUILT / "lm.toml"
    config.write_text(
        f'[data]\ntrain = "{BUILT / "train.txt"}"\nvalid = "{BUILT / "valid.txt"}"\ntest = "{BUILT / "test.txt"}"\n'
        'mode = "sentence"\n[model]\nembedding_size = 128\nhidden_size = 128\nlayers = 2\ndropout = 0.0\n'
        '[head]\ntype = "adaptive"\ncutoffs = [2000, 6000]\ndiv_value = 4.0\n[optimizer]\nname = "adam"\nlr = 0.002\n'
        '[train]\nbatch_size = 32\nepochs = 1\nmax_tokens = 20000\nloss_reduction = "token_mean"\nlog_interval = 50\n'
    )
    train = [sys.executable, "-m", "lmserve.training.cli"]
    run_measured([*train, "fit", str(config), "--out", str(BUILT / "run")], BUILT / "fit.log")
    run_measured([*train, "export", "--checkpoint", str(BUILT / "run"), "--out", str(bundle)], BUILT / "export.log")
    return bundle


# -- measuring the server -------------------------------------------------------------------------------------------


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident memory so far (VmHWM, kept by the kernel: nothing between samples is missed)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM in /proc/{pid}/status")


class RssSampler:
    """The RSS of a process and its children every ``interval`` seconds in a thread, while a block runs."""

    def __init__(self, pid: int, interval: float = 0.01):
        self.pid, self.interval = pid, interval
        self.peak = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, rss_bytes(self.pid))
            self.stop.wait(self.interval)

    def __enter__(self) -> RssSampler:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()

    @property
    def peak_mb(self) -> float:
        return self.peak / 2**20


def step_request(items: int, words: int, vocab: list[str], state: bytes, mode: str) -> bytes:
    """A ScoreNextWordsBatch (or stream) request of ``words`` candidates spread over ``items`` items after
    ``state``, states answered as ``mode`` says."""
    per_item = -(-words // items)
    request = pb.ScoreNextWordsBatchRequest(scores_only=mode == "scores_only", cache_states=mode == "cache_states")
    rng = np.random.default_rng(words)
    for i in range(items):
        count = min(per_item, words - i * per_item)
        if count <= 0:
            break
        request.items.add(state=state, candidates=[vocab[k] for k in rng.integers(len(vocab), size=count)])
    return request.SerializeToString()


class Server:
    """The running server, a channel to it, and what it takes to build its worst steps."""

    def __init__(self, process: ServerProcess, bundle: Path):
        self.process = process
        self.channel = grpc.insecure_channel(process.address, options=[("grpc.max_receive_message_length", 64 << 20)])
        self.step = self.channel.unary_unary(STEP_METHOD)
        self.vocab = [w for w in Bundle.load(bundle).tokens if not (w.startswith("<") and w.endswith(">"))]
        first = pb.ScoreNextWordsBatchRequest(items=[pb.NextWordsItem(candidates=[self.vocab[10]])])
        answer = pb.ScoreNextWordsBatchResponse.FromString(self.step(first.SerializeToString(), timeout=60))
        self.state = answer.items[0].words[0].state  # a state token mid-sentence: as long as a decoder's

    def request(self, words: int, mode: str) -> bytes:
        return step_request(min(Limits().max_items, words), words, self.vocab, self.state, mode)

    def allowed(self, request: bytes) -> bool:
        """Whether the server takes a step (refused up front: RESOURCE_EXHAUSTED before any work)."""
        try:
            self.step(request, timeout=300)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            return False
        return True

    def largest(self, mode: str) -> int:
        """The most words a step of ``mode`` may have under the server's limits (bisection on its refusals)."""
        low, high = 1, Limits().max_step_words
        if self.allowed(self.request(high, mode)):
            return high
        while high - low > max(1, low // 100):  # to within 1%
            middle = (low + high) // 2
            low, high = (middle, high) if self.allowed(self.request(middle, mode)) else (low, middle)
        return low

    def close(self) -> None:
        self.channel.close()


async def health_checks(address: str, stop: asyncio.Event) -> list[tuple[str, float]]:
    """Liveness checks (service "", a probe's 5-s timeout) every HEALTH_INTERVAL until ``stop``: each status (or
    the error's code) and its seconds."""
    checks = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while not stop.is_set():
            start = time.perf_counter()
            try:
                response = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
                status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
            except grpc.aio.AioRpcError as e:
                status = e.code().name
            checks.append((status, time.perf_counter() - start))
            await asyncio.sleep(HEALTH_INTERVAL)
    return checks


def health_summary(checks: list[tuple[str, float]]) -> dict:
    seconds = [s for _, s in checks]
    return {
        "checks": len(checks),
        "failed": sum(status != "SERVING" for status, _ in checks),
        "max_s": max(seconds, default=0.0),
        "p50_s": float(np.median(seconds)) if seconds else 0.0,
    }


async def readiness(channel: grpc.aio.Channel) -> str:
    stub = health_pb2_grpc.HealthStub(channel)
    response = await stub.Check(health_pb2.HealthCheckRequest(service="lmserve.v1.LMService"), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


async def streams_under_load(address: str, request: bytes, streams: int, rounds: int, small: bytes) -> dict:
    """``streams`` streams each send ``request`` ``rounds`` times at once, while health is checked; then, with them
    closed, 4 x ``streams`` streams try to open at once (a ``small`` step each), held open while health is
    checked again."""
    stop = asyncio.Event()
    checks = asyncio.create_task(health_checks(address, stop))
    options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        call = channel.stream_stream(STREAM_METHOD)

        async def stepping() -> tuple[int, str]:
            stream, answered = call(timeout=600), 0
            try:
                for _ in range(rounds):
                    await stream.write(request)
                    await stream.read()
                    answered += 1
                await stream.done_writing()
                return answered, "OK"
            except grpc.aio.AioRpcError:
                return answered, (await stream.code()).name

        start = time.perf_counter()
        outcomes = await asyncio.gather(*(stepping() for _ in range(streams)))
        seconds = time.perf_counter() - start
        stop.set()
        loaded = await checks

        stop = asyncio.Event()
        checks = asyncio.create_task(health_checks(address, stop))
        held = []

        async def attempt() -> str:
            stream = call(timeout=600)
            try:
                await stream.write(small)
                await stream.read()
            except grpc.aio.AioRpcError:
                return (await stream.code()).name
            held.append(stream)
            return "OK"

        attempts = await asyncio.gather(*(attempt() for _ in range(4 * streams)))
        ready_when_full = await readiness(channel)
        await asyncio.sleep(1.0)  # health checks with every slot taken
        for stream in held:
            await stream.done_writing()
        stop.set()
        attempted = await checks
    return {
        "stepping": {"seconds": seconds, "steps_answered": sum(a for a, _ in outcomes)}
        | {"codes": sorted({code for _, code in outcomes})},
        "attempted": {
            "streams": 4 * streams,
            "accepted": attempts.count("OK"),
            "refused": attempts.count("RESOURCE_EXHAUSTED"),
            "codes": dict(Counter(attempts)),
            "readiness_when_full": ready_when_full,
        },
        "health_while_stepping": health_summary(loaded),
        "health_while_attempted": health_summary(attempted),
    }


def server_section(setup: Setup) -> tuple[dict, dict]:
    config = setup.tmp / "serve.toml"
    config.write_text(f'[server]\nmetrics_port = 0\n[models.m]\nbundle = "{setup.bundle}"\n')
    streams = setup.args.streams or ServerSettings().max_concurrent_calls
    with ServerProcess(config, setup.tmp / "server.log", start_timeout=300) as process:
        server = Server(process, setup.bundle)
        idle_rss = rss_bytes(process.pid) / 2**20
        issue = step_request(1024, 1024 * 1000, server.vocab, b"", "scores_only")
        issue_refused = not server.allowed(issue)
        calls = {}
        for mode in MODES:
            words = server.largest(mode)
            request = server.request(words, mode)
            with RssSampler(process.pid) as sampler:
                start = time.perf_counter()
                answer = server.step(request, timeout=600)
                seconds = time.perf_counter() - start
            calls[mode] = {
                "words": words,
                "request_mb": len(request) / 2**20,
                "answer_mb": len(answer) / 2**20,
                "seconds": seconds,
                "sampled_peak_rss_mb": sampler.peak_mb,
            }
        worst_call_peak = peak_rss_mb(process.pid)
        worst = max(MODES, key=lambda m: calls[m]["sampled_peak_rss_mb"])
        small = server.request(8, "tokens")
        request = server.request(calls[worst]["words"], worst)
        with RssSampler(process.pid) as sampler:
            load = asyncio.run(streams_under_load(process.address, request, streams, setup.args.rounds, small))
        streams_peak = peak_rss_mb(process.pid)
        server.close()
        assert process.stop() == 0, process.log_text()
        logged = Counter(r["code"] for r in process.records if r.get("method") == "StreamNextWords" and "code" in r)
    metrics = {
        "worst_call_peak_rss_mb": worst_call_peak,
        "streams_peak_rss_mb": streams_peak,
        "health_failures_at_max_streams": load["health_while_stepping"]["failed"]
        + load["health_while_attempted"]["failed"],
        "streams_refused_of_attempted": load["attempted"]["refused"],
        "issue_call_refused": issue_refused,
    }
    details = {
        "idle_rss_mb": idle_rss,
        "issue_call": {"items": 1024, "candidates": 1000, "request_mb": len(issue) / 2**20},
        "worst_calls": calls,
        "streams": {
            "count": streams,
            "rounds": setup.args.rounds,
            "step": worst,
            "sampled_peak_rss_mb": sampler.peak_mb,
        }
        | load,
        "streams_logged_codes": dict(logged),
        "limits": Limits().__dict__,
        "max_concurrent_calls": ServerSettings().max_concurrent_calls,
    }
    return metrics, details


def decoder_clients_section(setup: Setup) -> tuple[dict, dict]:
    """The decoder clients against a server of the English LM (``benchmarks.serve_decoder_clients``, which also
    writes its own result): a hung server's error, one remote DecoderLM shared by 8 threads, a fork pool."""
    from benchmarks import serve_decoder_clients

    result = serve_decoder_clients.main(["--no-write"])
    return result["metrics"], {k: v for k, v in result.items() if k != "metrics"}


# A part of the service measured: its metrics (into the result's "metrics") and details (under its own name).
SECTIONS: dict[str, Callable[[Setup], tuple[dict, dict]]] = {
    "server": server_section,
    "decoder_clients": decoder_clients_section,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", type=Path, help="the bundle to serve (default: var/bundles/demo, else built)")
    parser.add_argument("--streams", type=int, default=0, help="streams at once (default: max_concurrent_calls)")
    parser.add_argument("--rounds", type=int, default=3, help="worst steps each stream sends")
    parser.add_argument("--only", choices=sorted(SECTIONS), action="append", help="run only these sections (a trial)")
    add_results_option(parser)
    args = parser.parse_args()
    use_results(args.results)
    bundle = (args.bundle or (DEMO_BUNDLE if (DEMO_BUNDLE / "manifest.json").exists() else stand_in_bundle())).resolve()
    metrics, details = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only or SECTIONS:
            folder = Path(tmp) / name
            folder.mkdir()
            metrics_of, details[name] = SECTIONS[name](Setup(bundle, folder, args))
            metrics |= metrics_of
    write_result("serve_limits", metrics, bundle=str(bundle), sections=details)
    print(metrics)


if __name__ == "__main__":
    main()
