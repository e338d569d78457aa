"""lm-serve when decoders lean on it: the memory of the worst calls its default limits allow, and health under a full
load of streams -> serve_limits.json

    python -m benchmarks.serve_limits [--bundle var/bundles/demo] [--streams 64] [--only server] [--results DIR]

A real ``lm-serve serve`` (``server.process.ServerProcess``) with the default ``[server]`` and ``[limits]`` serves the
demo bundle (``make demo``) or, where that is missing, a bundle of the same shape trained here in seconds
(var/serve_limits/). One section of metrics per part of the service, each a function in ``SECTIONS`` taking the
shared :class:`Setup`: ``server`` (:func:`server_section`: the peak RSS after the worst single call of each kind the
limits allow, sizes found by asking the server; the same step sent by ``--streams`` streams at once; health checks
failed meanwhile and while 4 x ``--streams`` more are attempted) and ``decoder_clients`` (:func:`decoder_clients`:
pyctcdecode over a remote ``DecoderLM`` of the shipped English LM, on synthetic emissions of dev_other references,
compared with one thread's results: a step on a SIGSTOPped server, one decoder shared by threads, a fork pool).
Figures: docs/benchmarks/serving.md ("Limits, health and decoder clients under load"); what they mean:
docs/decoders.md.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import multiprocessing
import signal
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

from benchmarks import decoding
from benchmarks.common import ROOT, add_results_option, run_measured, use_results, write_result
from benchmarks.serve_harness import rss_bytes
from benchmarks.synthetic_ctc import Channel
from lmserve.core.bundle import Bundle
from lmserve.rescoring.decoders.lm import DecoderLM
from lmserve.rescoring.decoders.pyctcdecode_lm import build_ctcdecoder
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


# -- decoder clients -------------------------------------------------------------------------------------------------


def bounded(run, limit: float) -> dict:
    """``run()`` in a thread of its own, waited for at most ``limit`` seconds: its result or error, and seconds
    (``hung`` when it is still going)."""
    out: dict = {}

    def target():
        try:
            out["result"] = run()
        except Exception as error:  # noqa: BLE001 (reported, not raised: a refusal is a result here)
            out["error"] = f"{type(error).__name__}: {error}"

    start = time.perf_counter()
    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(limit)
    out["seconds"] = time.perf_counter() - start
    if worker.is_alive():
        out["hung"] = f"no result within {limit:g} s"
    return out


def hung_server(server: ServerProcess, limit: float, step_timeout: float | None) -> dict:
    """Seconds from a step on a SIGSTOPped server until its error (``DecoderLM.remote``'s default deadline unless
    ``step_timeout`` is given)."""
    lm = DecoderLM.remote(server.address, "english", **({} if step_timeout is None else {"timeout": step_timeout}))
    start = lm.start()
    lm.score(start, "THE")  # a stream is open and has answered
    server.send(signal.SIGSTOP)
    try:
        run = bounded(lambda: lm.score(start, "A"), limit)
    finally:
        server.send(signal.SIGCONT)
    lm.close()
    if "error" in run:
        run["names_the_server"] = server.address in run["error"]
        run["deadline_exceeded"] = "DEADLINE_EXCEEDED" in run["error"]
    return run


def decoder_clients(
    bundle: Path = decoding.BUNDLE,
    ngram: Path | None = decoding.NGRAM,
    lam: float = decoding.LAMBDA,
    normalize: str | None = decoding.NORMALIZE,
    texts: list[str] | None = None,
    labels: list[str] = decoding.LABELS,
    utterances: int = 32,
    threads: int = 8,
    processes: int = 4,
    beam: int = 16,
    limit_s: float = 600.0,
    step_timeout: float | None = None,
) -> tuple[dict, dict]:
    """A remote DecoderLM under the ways decoders use it, against one thread of one process decoding first:
    ``hung_server_error_s`` (target: the deadline plus a second), and the results (text, or the best beam's LM score
    beyond 1e-6) that differ with one decoder shared by ``threads`` threads (``shared_decoder_wrong_results``) and
    with pyctcdecode's ``decode_batch`` over a fork pool (``fork_pool_wrong_results``, texts); -1 where it refused
    with an error, None where it hung past ``limit_s``."""
    texts = (texts or decoding.references("dev_other", utterances))[:utterances]
    channel = Channel()
    rng = np.random.default_rng(channel.seed)
    emissions = [channel.emissions(t, labels, rng) for t in texts]
    ngram = ngram if ngram and ngram.exists() else None

    def best(decoder, e: np.ndarray) -> tuple[str, float]:
        text, state, *_ = decoder.decode_beams(e, beam_width=beam)[0]
        return text, state.logprob

    runs: dict[str, dict] = {}
    shared: list = [None] * len(emissions)
    with tempfile.TemporaryDirectory() as tmp:
        config = decoding.serve_config(Path(tmp) / "server", bundle, ngram, lam if ngram else None, normalize)
        with ServerProcess(config, Path(tmp) / "server.log", start_timeout=300) as server:
            with DecoderLM.remote(server.address, "english") as lm:
                decoder = build_ctcdecoder(labels, lm, alpha=0.5, beta=1.0)
                start = time.perf_counter()
                reference = [best(decoder, e) for e in emissions]
                runs["one_thread"] = {"seconds": time.perf_counter() - start}

                def share(first: int) -> None:
                    for i in range(first, len(emissions), threads):
                        shared[i] = best(decoder, emissions[i])

                def run_threads():
                    workers = [threading.Thread(target=share, args=(k,)) for k in range(threads)]
                    for worker in workers:
                        worker.start()
                    for worker in workers:
                        worker.join()
                    if None in shared:
                        raise RuntimeError(f"{shared.count(None)} utterances not decoded (a thread raised)")

                runs["shared_decoder"] = bounded(run_threads, limit_s)
                with multiprocessing.get_context("fork").Pool(processes) as pool:
                    runs["fork_pool"] = bounded(lambda: decoder.decode_batch(pool, emissions, beam_width=beam), limit_s)
            runs["hung_server"] = hung_server(server, limit_s, step_timeout)
            server.stop()

    def count(run: dict, wrong) -> int | None:
        return None if "hung" in run else -1 if "error" in run else wrong()

    pool_texts = runs["fork_pool"].pop("result", None)
    metrics = {
        "hung_server_error_s": runs["hung_server"]["seconds"] if "error" in runs["hung_server"] else None,
        "shared_decoder_wrong_results": count(
            runs["shared_decoder"],
            lambda: sum(g[0] != e[0] or abs(g[1] - e[1]) > 1e-6 for g, e in zip(shared, reference, strict=True)),
        ),
        "fork_pool_wrong_results": count(
            runs["fork_pool"], lambda: sum(t != r[0] for t, r in zip(pool_texts, reference, strict=True))
        ),
    }
    runs["shared_decoder"].pop("result", None)
    details = {
        "targets": "hung_server_error_s <= 31 (the 30 s default deadline); both wrong-result counts 0 (-1: refused)",
        "runs": runs,
        "step_timeout": step_timeout or inspect.signature(DecoderLM.remote).parameters["timeout"].default,
        "utterances": len(texts),
        "threads": threads,
        "processes": processes,
        "beam": beam,
        "channel": channel.describe(),
        "model": {"bundle": str(bundle), "ngram": str(ngram) if ngram else None, "lambda": lam, "normalize": normalize},
        "decoder": "pyctcdecode (build_ctcdecoder, alpha 0.5, beta 1) over DecoderLM.remote: a stream per thread",
    }
    return metrics, details


# A part of the service measured: its metrics (into the result's "metrics") and details (under its own name).
SECTIONS: dict[str, Callable[[Setup], tuple[dict, dict]]] = {
    "server": server_section,
    "decoder_clients": lambda setup: decoder_clients(),
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
