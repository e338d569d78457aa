"""The server-side state cache under a long load: 64 decoders for 10 minutes -> state_cache_soak.json

    python -m benchmarks.state_cache_soak [--decoders 64] [--seconds 600] [--max-mb 64]

Each decoder keeps one StreamNextWords stream with ``cache_states``: a beam of ``--beam`` hypotheses walks
LibriSpeech dev_other references word by word (as in beam_step_load), its states are cache ids, and the states it
prunes are released with its next request. Every ``--abandon-every`` sentences a decoder drops its stream without
releasing anything (a crashed or careless client): those states stay until the cache's TTL or its memory bound
removes them, so the cache fills to its bound and must evict. Between steps a decoder "thinks" ``--think-ms`` (its
own search work). The cache is sized to hold the live beams (64 x 16 states of 16 kB is 16 MB) but not everything
abandoned in 10 minutes.

Reported: ``errors`` (failed steps of any kind: an evicted live state would be one), ``rss_growth_pct`` (the
server's resident memory at the end against after ``--warmup`` seconds), ``decoders``, ``seconds``; besides, the
cache's largest size seen in the server's metrics against its bound, evictions and expiries, steps and their
latency.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import grpc

from benchmarks.beam_step_load import Walk, first_states, request
from benchmarks.common import write_result
from benchmarks.decoding import add_model_arguments, percentiles, rss_mb, serve_config, walk_inputs
from lmserve.server.process import ServerProcess
from lmserve.v1.lmserve_pb2_grpc import LMServiceStub


def cache_metrics(url: str) -> dict:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for name in ("lmserve_state_cache_bytes", "lmserve_state_cache_states"):
        found = re.search(rf"^{name} (\S+)$", text, re.M)
        out[name] = float(found.group(1)) if found else 0.0
    for reason in ("evicted", "expired"):
        found = re.search(rf'^lmserve_state_cache_removed_total{{reason="{reason}"}} (\S+)$', text, re.M)
        out[reason] = float(found.group(1)) if found else 0.0
    return out


async def decoder(stub, walk: Walk, deadline: float, abandon_every: int, think: float, stats: dict) -> None:
    sentences_done = 0
    while time.perf_counter() < deadline:
        stream = stub.StreamNextWords()
        walk.states = [walk.start()] * walk.beam
        walk.position = 0
        release: list[str] = []
        try:
            while time.perf_counter() < deadline:
                sentence = walk.sentence
                start = time.perf_counter()
                await stream.write(request(walk, walk.items(), release))
                states = first_states(await stream.read())
                stats["latencies"].append((time.perf_counter() - start) * 1000)
                release = walk.advance(states)
                if walk.sentence != sentence:
                    sentences_done += 1
                    if abandon_every and sentences_done % abandon_every == 0:
                        walk.states = [walk.start()] * walk.beam  # its states dropped, none released
                        break
                if think:
                    await asyncio.sleep(think)
            stream.cancel()
        except grpc.RpcError as error:
            stats["errors"].append(f"{error.code().name}: {error.details()}")
            stream.cancel()


async def soak(address: str, walks: list[Walk], seconds: float, abandon_every: int, think: float) -> dict:
    stats: dict = {"latencies": [], "errors": []}
    options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        stub = LMServiceStub(channel)
        deadline = time.perf_counter() + seconds
        await asyncio.gather(*(decoder(stub, w, deadline, abandon_every, think, stats) for w in walks))
    return stats


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--decoders", type=int, default=64)
    parser.add_argument("--beam", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=600.0)
    parser.add_argument("--warmup", type=float, default=60.0, help="seconds before the first RSS reading")
    parser.add_argument("--max-mb", type=float, default=64.0, help="the state cache's bound")
    parser.add_argument("--ttl", type=float, default=120.0, help="the state cache's ttl_seconds")
    parser.add_argument("--abandon-every", type=int, default=3, help="sentences between abandoned streams (0: never)")
    parser.add_argument("--think-ms", type=float, default=10.0)
    parser.add_argument("--texts", type=Path, help="(tests) sentences to walk instead of LibriSpeech's")
    parser.add_argument("--no-write", action="store_true", help="print the result, write no file (tests)")
    args = parser.parse_args(argv)
    # the server's config lies in a temporary folder, against which a relative path would be resolved
    args.bundle = args.bundle.absolute()
    args.ngram = args.ngram.absolute() if args.ngram else None
    normalize, sentences, vocab, ngram = walk_inputs(args)
    walks = [Walk(sentences, vocab, args.beam, 1, i, cache=True) for i in range(args.decoders)]
    with tempfile.TemporaryDirectory() as tmp:
        config = serve_config(
            Path(tmp), args.bundle, ngram, args.lam if ngram else None, normalize, 2,
            state_cache_mb=args.max_mb, ttl_seconds=args.ttl,
        )  # fmt: skip
        with ServerProcess(config, Path(tmp) / "server.log", start_timeout=300) as server:
            samples: list[dict] = []
            stop = False

            def sample() -> None:
                started = time.perf_counter()
                while not stop:
                    samples.append({"t": time.perf_counter() - started, "rss_mb": rss_mb(server.pid)})
                    samples[-1] |= cache_metrics(server.metrics_url)
                    time.sleep(min(5.0, max(args.seconds / 50, 0.2)))

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            start = time.perf_counter()
            stats = asyncio.run(soak(server.address, walks, args.seconds, args.abandon_every, args.think_ms / 1000))
            seconds = time.perf_counter() - start
            stop = True
            sampler.join()
            final = {"rss_mb": rss_mb(server.pid), **cache_metrics(server.metrics_url)}
            server_errors = [r for r in server.records if r.get("level") == "error"]
            code = server.stop()
    warm = next((s for s in samples if s["t"] >= args.warmup), samples[0])
    bound = args.max_mb * 2**20
    peak_cache = max(s["lmserve_state_cache_bytes"] for s in [*samples, final])
    metrics = {
        "errors": len(stats["errors"]) + len(server_errors),
        "rss_growth_pct": 100 * (final["rss_mb"] - warm["rss_mb"]) / warm["rss_mb"],
        "decoders": args.decoders,
        "seconds": seconds,
    }
    extra = dict(
        targets={"errors": 0, "cache bytes": f"<= max_mb ({bound:.0f} bytes) throughout"},
        cache={
            "max_mb": args.max_mb,
            "ttl_seconds": args.ttl,
            "peak_bytes": peak_cache,
            "bound_held": peak_cache <= bound,
            "evicted": final["evicted"],
            "expired": final["expired"],
            "final_states": final["lmserve_state_cache_states"],
        },
        rss_mb={"after_warmup": warm["rss_mb"], "final": final["rss_mb"], "warmup_s": args.warmup},
        steps={**percentiles(stats["latencies"]), "per_s": len(stats["latencies"]) / seconds},
        error_examples=sorted(set(stats["errors"]))[:5] + [r.get("message", "") for r in server_errors[:5]],
        beam=args.beam,
        abandon_every=args.abandon_every,
        think_ms=args.think_ms,
        samples=samples[:: max(1, len(samples) // 100)],
        model={"bundle": str(args.bundle), "ngram": str(ngram) if ngram else None, "lambda": args.lam},
        exit_code=code,
    )
    return write_result("state_cache_soak", metrics, no_write=args.no_write, **extra)


if __name__ == "__main__":
    main()
