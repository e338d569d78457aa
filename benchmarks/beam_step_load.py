"""Beam steps against lm-serve: 16 concurrent decoders, beam 32 -> beam_step_load.json

    python -m benchmarks.beam_step_load [--decoders 16] [--beam 32] [--steps 100] [--results DIR]

A decoder walks LibriSpeech dev_other references word by word with a beam of ``--beam`` hypotheses: at each step
every hypothesis asks for ``--candidates`` next words (hypothesis 0 the reference's next word, the others random
words of the vocabulary, so the hypotheses' states differ) and goes on from the state of its first candidate; at a
sentence's end the beam starts the next one. One step, four ways (the same steps, the same server):

- ``batched``: one ScoreNextWordsBatch call with all the beam's items (one LSTM step; the server merges the steps of
  concurrent decoders);
- ``single``: one ScoreNextWords call per hypothesis, all of a step's calls at once;
- ``stream``: one StreamNextWords stream per decoder, a request per step (state tokens);
- ``stream_cache``: the same with the server's state cache (ids travel instead of 16 kB tokens; pruned states are
  released with the next request).

Per way: the latency of a step (until its last answer; p50/p99), steps/s, and the server's CPU seconds for all the
steps (/proc, server process and its children; the load generator runs on the same cores but is not counted).
Decoders step back to back unless ``--think-ms`` gives each its own work between steps (a sleep of 0 to 2× that,
uniformly: a real decoder's search between two LM steps, on other cores); first, one decoder alone gives the floor
(``one_decoder_p99_ms``): the latency of a batched beam step on an otherwise idle server. Back to back, 16 decoders
saturate the server and the latency is their number over its throughput; ``--think-curve`` runs the batched steps
again at lower offered loads (each decoder pausing T ms on average between steps), for the latency a decoder sees at
a given pace.
The server: the English LM bundle with its 4-gram at λ (``benchmarks/decoding.py``), 2 scoring threads of 1 ONNX
Runtime thread, micro-batching waits at most ``--max-wait-ms``. Metrics: ``p99_ms`` (batched), ``batched_cpu_s``,
``single_cpu_s``; targets p99 ≤ 15 ms and single/batched CPU ≥ 8.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

from benchmarks import common
from benchmarks.common import write_result
from benchmarks.decoding import add_model_arguments, cpu_seconds, percentiles, serve_config, walk_inputs
from lmserve.rescoring.client import next_words_batch_request
from lmserve.rescoring.scorer_args import add_device_argument
from lmserve.server.process import ServerProcess
from lmserve.v1 import lmserve_pb2 as pb
from lmserve.v1.lmserve_pb2_grpc import LMServiceStub

MODES = ("batched", "single", "stream", "stream_cache")
MODEL = "english"


class Walk:
    """One decoder's beam: the hypotheses' states and what each asks next."""

    def __init__(self, sentences: list[list[str]], vocab: list[str], beam: int, candidates: int, seed: int, cache):
        self.sentences, self.vocab, self.beam, self.candidates = sentences, vocab, beam, candidates
        self.rng = np.random.default_rng(seed)
        self.pauses = np.random.default_rng([seed, 1])  # apart from rng: the steps stay the same whatever the pauses
        self.cache = cache
        self.sentence, self.position = int(self.rng.integers(len(sentences))), 0
        self.states: list = [self.start()] * beam

    def start(self):
        return "" if self.cache else b""

    def items(self) -> list[tuple[bytes | str, list[str]]]:
        sentence = self.sentences[self.sentence]
        true = sentence[self.position] if self.position < len(sentence) else "</s>"
        # one draw for the whole step: the load generator shares the server's cores, and a numpy call per hypothesis
        # cost it about as much CPU as gRPC's own client side (py-spy)
        picks = self.rng.integers(len(self.vocab), size=(self.beam, self.candidates)).tolist()
        words = [[self.vocab[i] for i in row] for row in picks]
        words[0][0] = true
        return list(zip(self.states, words, strict=True))

    def advance(self, new_states: list) -> list:
        """The beam goes on from each hypothesis' first candidate; returns the states it dropped (cache ids)."""
        dropped = [s for s in self.states if s]
        self.position += 1
        if self.position > len(self.sentences[self.sentence]):  # </s> was scored: the next sentence
            self.sentence, self.position = (self.sentence + 1) % len(self.sentences), 0
            new_states = [self.start()] * self.beam
        self.states = new_states
        return dropped if self.cache else []


def request(walk: Walk, items, release=()) -> pb.ScoreNextWordsBatchRequest:
    return next_words_batch_request(items, MODEL, cache_states=walk.cache, release=release)


def first_states(response) -> list:
    return [item.words[0].state_id or item.words[0].state for item in response.items]


async def decoder(stub, mode: str, walk: Walk, steps: int, latencies: list[float], think: float = 0.0) -> None:
    stream = None
    if mode.startswith("stream"):
        stream = stub.StreamNextWords()
    release: list[str] = []
    for _ in range(steps):
        items = walk.items()
        start = time.perf_counter()
        if mode == "single":
            calls = [
                stub.ScoreNextWords(pb.ScoreNextWordsRequest(model=MODEL, state=s, candidates=w), timeout=60)
                for s, w in items
            ]
            answers = await asyncio.gather(*calls)
            states = [a.words[0].state for a in answers]
        elif stream is not None:
            await stream.write(request(walk, items, release))
            states = first_states(await stream.read())
        else:
            states = first_states(await stub.ScoreNextWordsBatch(request(walk, items), timeout=60))
        latencies.append((time.perf_counter() - start) * 1000)
        release = walk.advance(states)
        if think:  # uniform on [0, 2 think]: decoders that paused alike would all ask at once, a burst each time
            await asyncio.sleep(2 * think * walk.pauses.random())
    if stream is not None:
        await stream.done_writing()
        await stream.read()  # the end of the stream (EOF)


async def measure(
    address: str, mode: str, walks: list[Walk], steps: int, think: float = 0.0
) -> tuple[list[float], float]:
    latencies: list[float] = []
    options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        stub = LMServiceStub(channel)
        start = time.perf_counter()
        await asyncio.gather(*(decoder(stub, mode, w, steps, latencies, think) for w in walks))
        return latencies, time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--decoders", type=int, default=16)
    parser.add_argument("--beam", type=int, default=32)
    parser.add_argument("--candidates", type=int, default=1, help="next words each hypothesis asks for")
    parser.add_argument("--steps", type=int, default=100, help="steps per decoder and way")
    parser.add_argument("--warmup", type=int, default=10, help="steps per decoder before each way, not measured")
    add_device_argument(parser)  # cuda: the server's LSTM steps on the GPU (issue 32's GPU row)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-wait-ms", type=float, default=2.0)
    parser.add_argument(
        "--think-ms", type=float, default=0.0, help="a decoder's own work between steps (0: steps back to back)"
    )
    parser.add_argument(
        "--think-curve",
        default="",
        help="comma-separated think times (ms): batched steps again at each, the latency at that offered load "
        "(p99_ms_think_T)",
    )
    parser.add_argument("--solo-steps", type=int, default=30, help="batched steps of one decoder alone (0: none)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--texts", type=Path, help="(tests) sentences to walk instead of LibriSpeech's")
    parser.add_argument("--no-write", action="store_true", help="print the result, write no file (tests)")
    common.add_results_option(parser)
    args = parser.parse_args(argv)
    common.use_results(args.results)
    # the server reads its config from a temporary folder, and a relative path there is relative to that folder:
    # the paths given are the current directory's
    args.bundle = args.bundle.absolute()
    args.ngram = args.ngram.absolute() if args.ngram else None
    normalize, sentences, vocab, ngram = walk_inputs(args)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        config = serve_config(
            Path(tmp), args.bundle, ngram, args.lam if ngram else None, normalize, args.workers,
            max_wait_ms=args.max_wait_ms, device=args.device,
        )  # fmt: skip
        with ServerProcess(config, Path(tmp) / "server.log", start_timeout=300) as server:
            if args.solo_steps:  # the floor: one decoder's batched step on an otherwise idle server
                walks = [Walk(sentences, vocab, args.beam, args.candidates, 99, False)]
                asyncio.run(measure(server.address, "batched", walks, 3))
                latencies, _ = asyncio.run(measure(server.address, "batched", walks, args.solo_steps))
                results["batched_one_decoder"] = percentiles(latencies)
                print("batched_one_decoder", json.dumps(results["batched_one_decoder"]), flush=True)
            runs = [(mode, mode, args.think_ms) for mode in args.modes.split(",")]
            runs += [(f"batched_think_{t}", "batched", float(t)) for t in filter(None, args.think_curve.split(","))]
            for row, mode, think_ms in runs:
                cache, think = mode == "stream_cache", think_ms / 1000
                walks = [Walk(sentences, vocab, args.beam, args.candidates, i, cache) for i in range(args.decoders)]
                asyncio.run(measure(server.address, mode, walks, args.warmup, think))
                before = cpu_seconds(server.pid)
                latencies, seconds = asyncio.run(measure(server.address, mode, walks, args.steps, think))
                cpu = cpu_seconds(server.pid) - before
                steps = len(latencies)
                results[row] = {
                    **percentiles(latencies),
                    "think_ms": think_ms,
                    "steps": steps,
                    "seconds": seconds,
                    "steps_per_s": steps / seconds,
                    "server_cpu_s": cpu,
                    "server_cpu_ms_per_step": 1000 * cpu / steps,
                }
                print(row, json.dumps(results[row]), flush=True)
            errors = [r for r in server.records if r.get("level") == "error"]
            server.stop()
    batched, single = results.get("batched", {}), results.get("single", {})
    metrics = {
        "p99_ms": batched.get("p99_ms"),
        "batched_cpu_s": batched.get("server_cpu_s"),
        "single_cpu_s": single.get("server_cpu_s"),
    }
    if batched and single:
        metrics["cpu_ratio_single_over_batched"] = single["server_cpu_s"] / batched["server_cpu_s"]
    if "batched_one_decoder" in results:
        metrics["one_decoder_p99_ms"] = results["batched_one_decoder"]["p99_ms"]
    for mode in ("stream", "stream_cache"):
        if mode in results:
            metrics[f"{mode}_p99_ms"] = results[mode]["p99_ms"]
            metrics[f"{mode}_cpu_s"] = results[mode]["server_cpu_s"]
    for row, figures in results.items():
        if row.startswith("batched_think_"):
            metrics[f"p99_ms_think_{row.removeprefix('batched_think_')}"] = figures["p99_ms"]
            metrics[f"steps_per_s_think_{row.removeprefix('batched_think_')}"] = figures["steps_per_s"]
    extra = dict(
        targets={"p99_ms": "<= 15", "single_cpu_s / batched_cpu_s": ">= 8"},
        decoders=args.decoders,
        beam=args.beam,
        candidates=args.candidates,
        steps_per_decoder=args.steps,
        think_ms=args.think_ms,
        modes=results,
        server={
            "workers": args.workers,
            "scorer_threads": 1,
            "max_wait_ms": args.max_wait_ms,
            "engine": "threads",
            "device": args.device,
        },
        model={"bundle": str(args.bundle), "ngram": str(ngram) if ngram else None, "lambda": args.lam},
        server_errors=len(errors),
        note="load generator on the same machine and cores as the server; server CPU from /proc",
    )
    return write_result("beam_step_load", metrics, no_write=args.no_write, **extra)


if __name__ == "__main__":
    main()
