"""A 10-minute soak of lm-serve at concurrency 32, hot reloads and a shutdown under load -> serve_soak.json

    python -m benchmarks.serve_soak [--minutes 10] [--engine processes|threads]

``serve_load``'s server (``--engine threads`` -> serve_soak_threads.json) gets 32 closed-loop callers (RescoreNBest,
ScoreSentences and decoders stepping ScoreNextWords with their states). Its RSS is sampled every 5 s (growth: the
last minute's median against the minute after a 1-minute warm-up); the models are reloaded at 40% of the time by
``Admin.ReloadModels`` and at 70% by SIGHUP (``failed_inflight_on_reload``); at the end SIGTERM under load: accepted
calls must be answered (``failed_inflight_on_shutdown``) and the server exit 0. ``errors``: failed calls before the
shutdown. Figures: docs/benchmarks/serving.md ("Soak, hot reload, graceful shutdown").
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import signal
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

from benchmarks.common import ptb_sentences, write_result
from benchmarks.serve_harness import (
    BUNDLE,
    ServerSettings,
    decoder_walks,
    dev_other_lists,
    nbest_requests,
    raw_method,
    rss_bytes,
    start_server,
)
from lmserve.core.bundle import Bundle
from lmserve.server.process import ServerProcess
from lmserve.v1 import lmserve_pb2 as pb
from lmserve.v1.lmserve_pb2_grpc import AdminStub, LMServiceStub

CALLERS = {"RescoreNBest": 22, "ScoreSentences": 6, "ScoreNextWords": 4}
REFUSED = ("UNAVAILABLE", "CANCELLED")  # a call the closing server did not take


@dataclass
class Call:
    method: str
    start: float
    end: float
    code: str


class Soak:
    def __init__(self, server: ServerProcess, seconds: float):
        self.server = server
        self.seconds = seconds
        self.calls: list[Call] = []
        self.rss: list[tuple[float, int]] = []
        self.reloads: list[dict] = []
        self.sigterm_at: float | None = None
        self.origin = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.origin

    async def call(self, method: str, call) -> tuple[str, object]:
        """Await one call, record it; its status code and response (None when it failed)."""
        start = self.now()
        code, response = "OK", None
        try:
            response = await call
        except grpc.aio.AioRpcError as e:
            code = e.code().name
        self.calls.append(Call(method, start, self.now(), code))
        return code, response

    def done(self, code: str) -> bool:
        """After SIGTERM a caller stops at its first refused call (or when the server is gone)."""
        return self.sigterm_at is not None and (code != "OK" or self.server.proc.poll() is not None)

    async def caller(self, method: str, requests: list[bytes], first: int, raw) -> None:
        for position in itertools.count(first):
            code, _ = await self.call(method, raw(requests[position % len(requests)], timeout=120))
            if self.done(code):
                return

    async def decoder(self, walks: list[list[list[str]]], first: int, stub) -> None:
        """Transcripts word by word, each step carrying the state of the last; a failed step starts a new one."""
        for position in itertools.count(first):
            state = b""
            for candidates in walks[position % len(walks)]:
                request = pb.ScoreNextWordsRequest(model="librispeech", state=state, candidates=candidates)
                code, response = await self.call("ScoreNextWords", stub.ScoreNextWords(request, timeout=120))
                if self.done(code):
                    return
                if response is None:
                    break
                state = response.words[0].state

    async def sample_rss(self) -> None:
        while self.server.proc.poll() is None and self.sigterm_at is None:
            self.rss.append((self.now(), rss_bytes(self.server.pid)))
            await asyncio.sleep(5)  # a sampling period, not a synchronisation

    async def operate(self, admin) -> None:
        """Reload by the admin call, then by SIGHUP, then stop the server with SIGTERM; at set times."""
        await asyncio.sleep(0.4 * self.seconds)
        start = self.now()
        response = await admin.ReloadModels(pb.ReloadModelsRequest(), timeout=300)
        self.reloads.append({"by": "admin", "start": start, "end": self.now(), "generation": response.generation})
        await asyncio.sleep(0.7 * self.seconds - self.now())
        mark = len(self.server.records)
        start = self.now()
        self.server.send(signal.SIGHUP)
        record = await asyncio.to_thread(
            self.server.wait_for, lambda r: r.get("message") in ("reloaded", "reload failed"), 300, mark
        )
        self.reloads.append({"by": "SIGHUP", "start": start, "end": self.now(), "outcome": record["message"]})
        await asyncio.sleep(self.seconds - self.now())
        self.sigterm_at = self.now()
        self.server.send(signal.SIGTERM)

    async def run(self, nbest: list[bytes], sentences: list[bytes], walks: list) -> None:
        options = [("grpc.max_receive_message_length", 64 << 20)]
        async with grpc.aio.insecure_channel(self.server.address, options=options) as channel:
            stub, admin = LMServiceStub(channel), AdminStub(channel)
            requests = {"RescoreNBest": nbest, "ScoreSentences": sentences}
            callers = [
                self.caller(method, requests[method], 97 * i, raw_method(channel, method))
                for method in requests
                for i in range(CALLERS[method])
            ]
            callers += [self.decoder(walks, 97 * i, stub) for i in range(CALLERS["ScoreNextWords"])]
            await asyncio.gather(self.operate(admin), self.sample_rss(), *callers)


def sentence_batches(size: int = 8) -> list[bytes]:
    sentences = ptb_sentences("test")
    return [
        pb.ScoreSentencesRequest(model="librispeech", sentences=sentences[i : i + size]).SerializeToString()
        for i in range(0, len(sentences), size)
    ]


def median_rss(samples: list[tuple[float, int]], start: float, end: float) -> float:
    inside = [rss for t, rss in samples if start <= t < end]
    if not inside:
        raise ValueError(f"no RSS sample between {start:.0f} s and {end:.0f} s: run longer")
    return statistics.median(inside)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=60.0, help="seconds before the RSS baseline")
    parser.add_argument(
        "--engine",
        choices=["processes", "threads"],
        default="processes",
        help="server.engine (threads: -> serve_soak_threads.json)",
    )
    args = parser.parse_args()
    seconds = args.minutes * 60
    settings = ServerSettings(engine=args.engine)
    nbest, sentences = nbest_requests(dev_other_lists()), sentence_batches()
    walks = decoder_walks(Bundle.load(BUNDLE).tokens)
    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(Path(tmp), settings)
        soak = Soak(server, seconds)
        asyncio.run(soak.run(nbest, sentences, walks))
        exit_code = server.wait(120)
        records = list(server.records)

    before = [c for c in soak.calls if c.start < soak.sigterm_at]
    after = [c for c in soak.calls if c.start >= soak.sigterm_at]
    errors = Counter(c.code for c in before if c.code != "OK" and c.end < soak.sigterm_at)
    in_reload = [c for c in soak.calls if any(c.start < r["end"] and c.end > r["start"] for r in soak.reloads)]
    stopping = next(i for i, r in enumerate(records) if r.get("message") == "stopping")
    drained = [r for r in records[stopping:] if r.get("message") == "call"]
    window = min(60.0, (soak.sigterm_at - args.warmup) / 3)
    baseline = median_rss(soak.rss, args.warmup, args.warmup + window)
    final = median_rss(soak.rss, soak.sigterm_at - window, soak.sigterm_at)
    ok_before = [c for c in before if c.code == "OK"]
    latency = {
        method: float(np.percentile([c.end - c.start for c in ok_before if c.method == method], 99) * 1000)
        for method in CALLERS
    }
    metrics = {
        "duration_s": soak.sigterm_at,
        "requests": len(before),
        "errors": sum(errors.values()),
        "rss_growth_fraction": final / baseline - 1,
        "rss_growth_percent": 100 * (final / baseline - 1),
        "failed_inflight_on_reload": sum(c.code != "OK" for c in in_reload),
        "failed_inflight_on_shutdown": sum(r["code"] != "OK" for r in drained),
        "failed_inflight": sum(c.code != "OK" for c in in_reload) + sum(r["code"] != "OK" for r in drained),
        "rps": len(ok_before) / soak.sigterm_at,
        "exit_code": exit_code,
        **{f"{method}_p99_ms": value for method, value in latency.items()},
    }
    write_result(
        "serve_soak" if args.engine == "processes" else f"serve_soak_{args.engine}",
        metrics,
        server=settings.record(),
        threads=f"server: 2 scoring {args.engine} x 1 ONNX Runtime intra-op thread per scorer call",
        callers=CALLERS,
        error_codes=dict(errors),
        calls_by_method=dict(Counter(c.method for c in before)),
        reloads=soak.reloads,
        calls_during_reloads=len(in_reload),
        shutdown={
            "sigterm_at_s": soak.sigterm_at,
            "answered_while_draining": len(drained),
            "codes_while_draining": dict(Counter(r["code"] for r in drained)),
            "client_codes_after_sigterm": dict(Counter(c.code for c in after)),
            "refused_after_sigterm": sum(c.code in REFUSED for c in after),
            "in_flight_at_sigterm": sum(c.end >= soak.sigterm_at for c in before),
            "in_flight_at_sigterm_failed": sum(
                c.end >= soak.sigterm_at and c.code not in ("OK", *REFUSED) for c in before
            ),
            "stopped_logged": records[-1].get("message") == "stopped",
        },
        rss_mb={
            "warmup_s": args.warmup,
            "window_s": window,
            "baseline": baseline / 2**20,
            "final": final / 2**20,
            "max": max(r for _, r in soak.rss) / 2**20,
            "samples": [(round(t, 1), round(r / 2**20, 1)) for t, r in soak.rss],
        },
    )
    print({k: round(v, 3) if isinstance(v, float) else v for k, v in metrics.items()})


if __name__ == "__main__":
    main()
