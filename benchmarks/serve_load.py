"""lm-serve under load, against the offline scorer and with micro-batching off -> serve_load.json (serve_load_fp32.json)

    python -m benchmarks.serve_load [--quick] [--rounds 3] [--precision int8|fp32]

The LibriSpeech rescoring model (Gutenberg 2x256 adaptive bundle, 4-gram, weights tuned on dev_clean) served by
``lm-serve`` with 2 scoring processes of 1 thread each; the load generator (``benchmarks.serve_harness``) replays
dev_other 30-best lists as RescoreNBest calls and PTB test sentences as ScoreSentences calls, closed-loop at
concurrency 1, 8 and 32. At 32, rounds take turns between the offline scorer (the same work without gRPC, as many
threads), the server with batching on and off, a threads engine (``threads_*``) and ``--replicas 2``; figures at 32
are medians over the rounds. ``engine_alone_*``: the concurrency-1 lists scored in this process, no gRPC. The
machine's load average before and after is recorded. Figures: docs/benchmarks/serving.md ("Throughput and latency").
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from benchmarks.common import ROOT, write_result
from benchmarks.serve_harness import (
    INLINE_WEIGHTS,
    LAMBDA,
    NGRAM,
    WEIGHTS,
    Load,
    ServerSettings,
    combination,
    dev_other_lists,
    nbest_requests,
    run_load,
    sentence_requests,
    served_bundle,
    start_server,
)
from lmserve.rescoring.lmscores import compute
from lmserve.rescoring.nbest import NBestEntry, NBestList
from lmserve.rescoring.rescore import LanguageModels, Setup, reranked, setup_from_record
from lmserve.rescoring.tune import read_weights


class Offline:
    """The server's work on lists without the server: ``threads`` threads sharing one scorer of 1 intra-op thread."""

    def __init__(self, threads: int, bundle: Path, lists_per_call: int = 64):
        self.threads = threads
        self.lists_per_call = lists_per_call
        self.models = LanguageModels.load(bundle, NGRAM, "librispeech", threads=1)
        if WEIGHTS.exists():
            self.setup = setup_from_record(read_weights(WEIGHTS))
        else:
            self.setup = Setup(list(INLINE_WEIGHTS), {}, LAMBDA, dict(INLINE_WEIGHTS))

    def work(self, chunk: list[NBestEntry]) -> None:
        lists = NBestList(chunk)
        models = self.models
        self.setup.choose(lists, compute(lists, models.scorer, models.ngram, models.normalizer))

    def one_by_one_ms(self, entries: list[NBestEntry]) -> np.ndarray:
        """Milliseconds of each list alone through compute and reranking: what the server does for one call."""
        models = self.models
        out = []
        for entry in entries:
            start = time.perf_counter()
            lists = NBestList([entry])
            reranked(lists, self.setup, compute(lists, models.scorer, models.ngram, models.normalizer))
            out.append(time.perf_counter() - start)
        return np.array(out) * 1000

    def rps(self, entries: list[NBestEntry]) -> float:
        """Lists per second over ``entries``."""
        chunks = [entries[i : i + self.lists_per_call] for i in range(0, len(entries), self.lists_per_call)]
        start = time.perf_counter()
        with ThreadPoolExecutor(self.threads) as pool:
            list(pool.map(self.work, chunks))
        return len(entries) / (time.perf_counter() - start)


def levels(address: str, requests: list[bytes], method: str, budget: dict[int, tuple[int, float]]) -> dict:
    """Each concurrency after a warm-up of a few calls per caller; (max requests, max seconds) per level."""
    out = {}
    for concurrency, (count, seconds) in budget.items():
        run_load(address, requests, method, concurrency, max_requests=2 * concurrency, max_seconds=30)
        load = run_load(address, requests, method, concurrency, max_requests=count, max_seconds=seconds)
        out[concurrency] = load.summary()
        print(method, out[concurrency], flush=True)
    return out


def pooled(loads: list[Load]) -> dict:
    """Median throughput of the rounds and latency percentiles over all their calls."""
    latencies = np.concatenate([load.latencies for load in loads]) * 1000
    return {
        "rps": statistics.median(load.rps for load in loads),
        "p50_ms": float(np.percentile(latencies, 50)),
        "p95_ms": float(np.percentile(latencies, 95)),
        "p99_ms": float(np.percentile(latencies, 99)),
        "errors": sum(n for load in loads for code, n in load.codes.items() if code != "OK"),
        "rounds": [load.summary() for load in loads],
    }


def batch_sizes(metrics_url: str) -> dict:
    """Mean calls and tokens per batch by kind, from the server's Prometheus metrics."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    out = {}
    for kind in ("lists", "sentences"):
        label = f'{{kind="{kind}"}}'
        batches = float(samples.get(f"lmserve_batch_calls_count{label}", 0))
        if batches:
            out[kind] = {
                "batches": batches,
                "mean_calls": float(samples[f"lmserve_batch_calls_sum{label}"]) / batches,
                "mean_tokens": float(samples[f"lmserve_batch_tokens_sum{label}"]) / batches,
            }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--quick", action="store_true", help="a tenth of the time; writes no result (checks the script)"
    )
    parser.add_argument("--max-wait-ms", type=float, default=ServerSettings.max_wait_ms)
    parser.add_argument("--max-batch-tokens", type=int, default=ServerSettings.max_batch_tokens)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of offline / batching on / batching off at 32")
    parser.add_argument(
        "--precision", choices=["int8", "fp32"], default="int8", help="the bundle served (and scored offline)"
    )
    args = parser.parse_args()
    bundle = served_bundle(args.precision)
    scale = 0.1 if args.quick else 1.0
    c1_lists = int(600 * scale)
    nbest_budget = {1: (c1_lists, 30 * scale), 8: (2000, 20 * scale)}
    sentence_budget = {1: (1000, 10 * scale), 8: (3761, 10 * scale), 32: (3761, 15 * scale)}
    per_round = int(1500 * scale)  # lists per round at concurrency 32 (~6 s: past the first seconds' uneven batches)
    batching = dict(max_batch_tokens=args.max_batch_tokens, max_wait_ms=args.max_wait_ms)
    on_settings = ServerSettings(engine="processes", **batching)
    off_settings = ServerSettings(engine="processes", batching=False, **batching)
    threads_settings = ServerSettings(engine="threads", **batching)
    replica_settings = ServerSettings(engine="threads", workers=1, **batching)
    load_before = os.getloadavg()

    lists = dev_other_lists()
    requests, sentences = nbest_requests(lists), sentence_requests()
    offline = Offline(on_settings.workers, bundle)
    offline.work(lists[:4])  # first runs of the graphs
    alone = offline.one_by_one_ms(lists[:c1_lists])  # the lists the concurrency-1 run sends
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        servers = {"on": on_settings, "off": off_settings, "threads": threads_settings, "replicas": replica_settings}
        on, off, threads, replicas = (
            stack.enter_context(start_server(Path(tmp) / n, c, bundle=bundle, replicas=2 if n == "replicas" else 1))
            for n, c in servers.items()
        )
        targets = {name: server.address for name, server in zip(servers, (on, off, threads, replicas), strict=True)}
        nbest = levels(on.address, requests, "RescoreNBest", nbest_budget)
        threads_c1 = levels(threads.address, requests, "RescoreNBest", {1: nbest_budget[1]})[1]
        for target in targets.values():
            run_load(target, requests, "RescoreNBest", 32, max_requests=64, max_seconds=30)
        rounds = {"offline": [], **{name: [] for name in targets}}
        for r in range(args.rounds):
            start = r * per_round  # the lists of the round, cycling like the load generator
            rounds["offline"].append(offline.rps([lists[(start + i) % len(lists)] for i in range(per_round)]))
            for name, target in targets.items():
                load = run_load(
                    target, requests, "RescoreNBest", 32, max_requests=per_round, max_seconds=60, start_at=start
                )
                rounds[name].append(load)
            print(f"round {r}: offline {rounds['offline'][-1]:.1f}, "
                  + ", ".join(f"{name} {rounds[name][-1].rps:.1f}" for name in targets), flush=True)  # fmt: skip
        sizes = batch_sizes(on.metrics_url)
        text = levels(on.address, sentences, "ScoreSentences", sentence_budget)
        text_off = levels(off.address, sentences, "ScoreSentences", {32: sentence_budget[32]})[32]
        codes = [server.stop() for server in (on, off, threads, replicas)]
    nbest[32], batching_off, two_replicas = pooled(rounds["on"]), pooled(rounds["off"]), pooled(rounds["replicas"])
    in_threads = pooled(rounds["threads"])
    offline_rps = statistics.median(rounds["offline"])

    metrics = {}
    for concurrency, figures in nbest.items():
        for key in ("rps", "p50_ms", "p95_ms", "p99_ms"):
            metrics[f"c{concurrency}_{key}"] = figures[key]
    for q in (50, 95, 99):
        metrics[f"engine_alone_c1_p{q}_ms"] = float(np.percentile(alone, q))
    metrics["offline_rps"] = offline_rps
    metrics["c32_vs_offline"] = nbest[32]["rps"] / offline_rps
    metrics["threads_c32_rps"] = in_threads["rps"]
    metrics["threads_c32_p99_ms"] = in_threads["p99_ms"]
    metrics["threads_c32_vs_offline"] = in_threads["rps"] / offline_rps
    for key in ("rps", "p50_ms", "p99_ms"):
        metrics[f"threads_c1_{key}"] = threads_c1[key]
    metrics["replicas_c32_rps"] = two_replicas["rps"]
    metrics["replicas_c32_p99_ms"] = two_replicas["p99_ms"]
    metrics["replicas_c32_vs_offline"] = two_replicas["rps"] / offline_rps
    metrics["batching_speedup_c32"] = nbest[32]["rps"] / batching_off["rps"]
    metrics["batching_off_c32_rps"] = batching_off["rps"]
    metrics["batching_off_c32_p99_ms"] = batching_off["p99_ms"]
    for concurrency, figures in text.items():
        for key in ("rps", "p50_ms", "p99_ms"):
            metrics[f"sentences_c{concurrency}_{key}"] = figures[key]
    metrics["sentences_batching_off_c32_rps"] = text_off["rps"]
    metrics["sentences_batching_speedup_c32"] = text[32]["rps"] / text_off["rps"]
    metrics["errors"] = sum(
        f["errors"]
        for f in [*nbest.values(), batching_off, in_threads, threads_c1, two_replicas, *text.values(), text_off]
    )
    print({k: round(v, 3) for k, v in metrics.items()})
    if args.quick:
        return  # a check of the script: no result file
    write_result(
        "serve_load" if args.precision == "int8" else "serve_load_fp32",
        metrics,
        bundle=str(bundle.relative_to(ROOT)),
        precision=args.precision,
        server=on_settings.record(),
        threads="server: 2 scoring processes x 1 ONNX Runtime intra-op thread; offline: 2 threads x 1 intra-op thread",
        combination=combination(),
        rescore_nbest=nbest,
        rescore_nbest_batching_off_c32=batching_off,
        rescore_nbest_threads={"1": threads_c1, "32": in_threads, "server": threads_settings.record()},
        rescore_nbest_two_replicas_c32={**two_replicas, "server": {**replica_settings.record(), "replicas": 2}},
        offline={"rounds_rps": rounds["offline"], "threads": offline.threads, "lists_per_call": 64},
        lists_per_round_c32=per_round,
        score_sentences=text,
        score_sentences_batching_off_c32=text_off,
        batch_sizes_on_after_rescore_nbest=sizes,
        exit_codes=codes,
        load_average_before_after=[load_before, os.getloadavg()],
        load_generator="asyncio, one loopback channel, closed loop, requests pre-serialised, responses unparsed",
    )


if __name__ == "__main__":
    main()
