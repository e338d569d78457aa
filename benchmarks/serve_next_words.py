"""ScoreNextWords step latency with 8 candidates -> serve_next_words.json

    python -m benchmarks.serve_next_words [--steps 3000]

A decoder's use of the service: walk LibriSpeech dev_other reference transcripts word by word (then ``</s>``),
each step one call with 8 candidates (the true next word and 7 other words of the vocabulary, drawn once with a fixed
seed) and the state of the previous step's true word. One decoder (concurrency 1) gives the step latency; 8
independent decoders show how steps scale (the service does not batch decoder steps). Same server as
``serve_load``: the LibriSpeech rescoring model with its 4-gram and λ, 2 scoring threads of 1 ONNX Runtime thread.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

from benchmarks.common import write_result
from benchmarks.serve_harness import BUNDLE, DEV_OTHER, ServerSettings, start_server
from lmserve.core.bundle import Bundle
from lmserve.rescoring.nbest import read_nbest
from lmserve.v1 import lmserve_pb2 as pb
from lmserve.v1.lmserve_pb2_grpc import LMServiceStub

CANDIDATES = 8


def sentences(vocab: list[str], seed: int = 0) -> list[list[list[str]]]:
    """Per transcript, per step: the candidates, the true word first."""
    rng = np.random.default_rng(seed)
    words = [w for w in vocab if w not in ("<s>", "</s>", "<unk>")]
    out = []
    for entry in read_nbest(DEV_OTHER):
        steps = []
        for word in [*entry.references[0].split(), "</s>"]:
            others = [words[i] for i in rng.choice(len(words), CANDIDATES - 1, replace=False)]
            steps.append([word, *others])
        out.append(steps)
    return out


async def decode(address: str, walks: list[list[list[str]]], decoders: int, max_steps: int, max_seconds: float):
    """``decoders`` callers, each walking its own transcripts; every step's latency, and the wall time."""
    latencies: list[float] = []
    taken = 0
    async with grpc.aio.insecure_channel(address) as channel:
        stub = LMServiceStub(channel)
        start = time.perf_counter()
        deadline = start + max_seconds

        async def decoder(first: int) -> None:
            nonlocal taken
            for walk in walks[first::decoders]:
                state = b""
                for candidates in walk:
                    if taken >= max_steps or time.perf_counter() > deadline:
                        return
                    taken += 1
                    sent = time.perf_counter()
                    request = pb.ScoreNextWordsRequest(model="librispeech", state=state, candidates=candidates)
                    response = await stub.ScoreNextWords(request, timeout=30)
                    latencies.append(time.perf_counter() - sent)
                    state = response.words[0].state

        await asyncio.gather(*(decoder(i) for i in range(decoders)))
        seconds = time.perf_counter() - start
    return np.array(latencies), seconds


def summary(latencies: np.ndarray, seconds: float) -> dict:
    ms = latencies * 1000
    return {
        "steps": len(latencies),
        "seconds": seconds,
        "steps_per_s": len(latencies) / seconds,
        "p50_ms": float(np.percentile(ms, 50)),
        "p95_ms": float(np.percentile(ms, 95)),
        "p99_ms": float(np.percentile(ms, 99)),
        "mean_ms": float(ms.mean()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=3000, help="steps per measurement (at most)")
    parser.add_argument("--seconds", type=float, default=60.0, help="time per measurement (at most)")
    args = parser.parse_args()
    settings = ServerSettings()
    with tempfile.TemporaryDirectory() as tmp, start_server(Path(tmp), settings) as server:
        walks = sentences(Bundle.load(BUNDLE).tokens)
        asyncio.run(decode(server.address, walks, 1, 100, 30))  # warm-up
        one = summary(*asyncio.run(decode(server.address, walks, 1, args.steps, args.seconds)))
        print("1 decoder", one, flush=True)
        eight = summary(*asyncio.run(decode(server.address, walks, 8, args.steps, args.seconds)))
        print("8 decoders", eight, flush=True)
        code = server.stop()
    metrics = {
        "p50_ms": one["p50_ms"],
        "p95_ms": one["p95_ms"],
        "p99_ms": one["p99_ms"],
        "steps_per_s": one["steps_per_s"],
        "c8_steps_per_s": eight["steps_per_s"],
        "c8_p50_ms": eight["p50_ms"],
        "c8_p99_ms": eight["p99_ms"],
    }
    write_result(
        "serve_next_words",
        metrics,
        candidates=CANDIDATES,
        server=settings.record(),
        threads="server: 2 scoring threads x 1 ONNX Runtime intra-op thread per call",
        one_decoder=one,
        eight_decoders=eight,
        exit_code=code,
    )
    print({k: round(v, 3) for k, v in metrics.items()})


if __name__ == "__main__":
    main()
