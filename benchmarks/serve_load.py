"""lm-serve under load, against the offline scorer and with micro-batching off -> serve_load.json

    python -m benchmarks.serve_load [--quick]

The LibriSpeech rescoring model (Gutenberg 2x256 adaptive bundle, 4-gram, the weights tuned on dev_clean) served by
``lm-serve`` in a child process with 2 scoring threads of 1 ONNX Runtime thread each, on loopback; the load generator
(``benchmarks.serve_harness``) replays dev_other 30-best lists as RescoreNBest calls (one list a call) and PTB test
sentences as ScoreSentences calls (one sentence a call), closed-loop at concurrency 1, 8 and 32.

- ``offline_rps``: the same lists through the same work without gRPC (``rescoring.lmscores.compute`` and the
  weights' choice) in this process, on as many threads as the server scores with (2, of 1 intra-op thread), 64
  lists per compute call (its default).
- batching on vs off: two servers, identical but for ``[batching] enabled``, loaded at concurrency 32 in turns
  (on, off, on, off, ...); the speedup is the ratio of their median throughputs, fair under changing machine load.

The load generator shares the machine's cores with the server (2 on the reference machine), as a co-located decoder
would; it pre-serialises requests and does not parse responses to take as little of them as it can.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.common import write_result
from benchmarks.serve_harness import (
    BUNDLE,
    DEV_OTHER,
    INLINE_WEIGHTS,
    LAMBDA,
    NGRAM,
    WEIGHTS,
    ServerSettings,
    combination,
    nbest_requests,
    run_load,
    sentence_requests,
    start_server,
)
from rescoring.lmscores import compute
from rescoring.nbest import NBestList, read_nbest
from rescoring.rescore import LanguageModels, Setup, setup_from_record
from rescoring.tune import read_weights

LEVELS = (1, 8, 32)


def offline_rps(threads: int, lists_per_call: int = 64, limit: int | None = None) -> dict:
    """Lists per second of compute + choice over dev_other, ``threads`` threads sharing one scorer (as the server)."""
    models = LanguageModels.load(BUNDLE, NGRAM, "librispeech", threads=1)
    if WEIGHTS.exists():
        setup = setup_from_record(read_weights(WEIGHTS))
    else:
        setup = Setup(list(INLINE_WEIGHTS), {}, LAMBDA, dict(INLINE_WEIGHTS))
    entries = read_nbest(DEV_OTHER).entries[:limit]
    chunks = [entries[i : i + lists_per_call] for i in range(0, len(entries), lists_per_call)]

    def work(chunk) -> None:
        lists = NBestList(chunk)
        setup.choose(lists, compute(lists, models.scorer, models.ngram, models.normalizer))

    work(chunks[0][:4])  # warm-up: first runs of the graphs
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(work, chunks))
    seconds = time.perf_counter() - start
    return {"rps": len(entries) / seconds, "lists": len(entries), "seconds": seconds, "threads": threads}


def levels(address: str, requests: list[bytes], method: str, budget: dict[int, tuple[int, float]]) -> dict:
    """Each concurrency after a warm-up of a few calls per caller; (max requests, max seconds) per level."""
    out = {}
    for concurrency, (count, seconds) in budget.items():
        run_load(address, requests, method, concurrency, max_requests=2 * concurrency, max_seconds=30)
        load = run_load(address, requests, method, concurrency, max_requests=count, max_seconds=seconds)
        out[concurrency] = load.summary()
        print(method, out[concurrency], flush=True)
    return out


def on_vs_off(on: str, off: str, requests: list[bytes], method: str, rounds: int, count: int, seconds: float) -> dict:
    """Concurrency 32 against both servers in turns; the median throughput and p99 of each, and their ratio."""
    runs = {"on": [], "off": []}
    for _ in range(rounds):
        for name, address in (("on", on), ("off", off)):
            load = run_load(address, requests, method, 32, max_requests=count, max_seconds=seconds)
            runs[name].append(load.summary())
            print(method, name, runs[name][-1], flush=True)
    median = {name: statistics.median(r["rps"] for r in results) for name, results in runs.items()}
    return {
        "on_rps": median["on"],
        "off_rps": median["off"],
        "speedup": median["on"] / median["off"],
        "on_p99_ms": statistics.median(r["p99_ms"] for r in runs["on"]),
        "off_p99_ms": statistics.median(r["p99_ms"] for r in runs["off"]),
        "runs": runs,
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
    parser.add_argument("--rounds", type=int, default=3, help="turns of batching on and off")
    args = parser.parse_args()
    scale = 0.1 if args.quick else 1.0
    nbest_budget = {1: (600, 20 * scale), 8: (2000, 20 * scale), 32: (2864, 30 * scale)}
    sentence_budget = {1: (1000, 10 * scale), 8: (3761, 10 * scale), 32: (3761, 15 * scale)}
    on_settings = ServerSettings(max_batch_tokens=args.max_batch_tokens, max_wait_ms=args.max_wait_ms)
    off_settings = ServerSettings(batching=False, max_batch_tokens=args.max_batch_tokens, max_wait_ms=args.max_wait_ms)

    lists, sentences = nbest_requests(), sentence_requests()
    with tempfile.TemporaryDirectory() as tmp:
        with start_server(Path(tmp) / "on", on_settings) as on, start_server(Path(tmp) / "off", off_settings) as off:
            nbest = levels(on.address, lists, "RescoreNBest", nbest_budget)
            text = levels(on.address, sentences, "ScoreSentences", sentence_budget)
            sizes = batch_sizes(on.metrics_url)
            nbest_switch = on_vs_off(on.address, off.address, lists, "RescoreNBest", args.rounds, 2864, 15 * scale)
            text_switch = on_vs_off(on.address, off.address, sentences, "ScoreSentences", args.rounds, 3761, 10 * scale)
            codes = (on.stop(), off.stop())
    offline = offline_rps(on_settings.workers, limit=200 if args.quick else None)
    print("offline", offline, flush=True)

    metrics = {}
    for concurrency, figures in nbest.items():
        for key in ("rps", "p50_ms", "p95_ms", "p99_ms"):
            metrics[f"c{concurrency}_{key}"] = figures[key]
    metrics["offline_rps"] = offline["rps"]
    metrics["c32_vs_offline"] = nbest[32]["rps"] / offline["rps"]
    metrics["batching_speedup_c32"] = nbest_switch["speedup"]
    metrics["batching_on_c32_rps"] = nbest_switch["on_rps"]
    metrics["batching_off_c32_rps"] = nbest_switch["off_rps"]
    metrics["batching_off_c32_p99_ms"] = nbest_switch["off_p99_ms"]
    for concurrency, figures in text.items():
        for key in ("rps", "p50_ms", "p99_ms"):
            metrics[f"sentences_c{concurrency}_{key}"] = figures[key]
    metrics["sentences_batching_speedup_c32"] = text_switch["speedup"]
    metrics["errors"] = sum(f["errors"] for f in [*nbest.values(), *text.values()])
    print({k: round(v, 3) for k, v in metrics.items()})
    if args.quick:
        return  # a check of the script: no result file
    write_result(
        "serve_load",
        metrics,
        server=on_settings.record(),
        threads="server: 2 scoring threads x 1 ONNX Runtime intra-op thread per scorer call; offline: the same",
        combination=combination(),
        rescore_nbest=nbest,
        score_sentences=text,
        batch_sizes_on=sizes,
        batching_rescore_nbest=nbest_switch,
        batching_score_sentences=text_switch,
        offline=offline,
        exit_codes=codes,
        quick=args.quick,
        load_generator="asyncio, one loopback channel, closed loop, requests pre-serialised, responses unparsed",
    )


if __name__ == "__main__":
    main()
