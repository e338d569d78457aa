"""A remote DecoderLM under the ways decoders use it: a hung server, threads, a fork pool -> serve_decoder_clients.json

    python -m benchmarks.serve_decoder_clients [--utterances 32] [--threads 8] [--processes 4] [--beam 16]

The English LM served by lm-serve on this machine (benchmarks/decoding.py: the bundle, its 4-gram at λ, LibriSpeech
text form), pyctcdecode with our adapter (``build_ctcdecoder`` over ``DecoderLM.remote``: a StreamNextWords stream
per thread, state tokens) on synthetic emissions of LibriSpeech dev_other references (benchmarks/synthetic_ctc.py).
The reference results are those of the same decoder in one thread of one process, decoded first.

- ``hung_server_error_s``: a decoder with ``DecoderLM.remote``'s default deadline (``timeout``, 30 s) takes a step,
  the server is stopped with SIGSTOP, and the next step is timed until it raises (``LMServeError``
  DEADLINE_EXCEEDED naming the server's address). Target: at most the deadline plus a second.
- ``shared_decoder_wrong_results``: one remote DecoderLM (and one pyctcdecode decoder) used by ``--threads`` threads
  at once, each decoding every ``--threads``-th utterance: how many results (the text, or the best beam's LM score
  beyond 1e-6) differ from the reference. -1 would mean that it refused the threads with an error instead (it does
  not: each thread steps on a stream of its own). Target: 0.
- ``fork_pool_wrong_results``: pyctcdecode's ``decode_batch`` with a fork pool of ``--processes`` workers (each
  worker connects anew after the fork): how many texts differ from the reference; -1 if it raised. Target: 0.

A run that is still going after ``--limit-s`` seconds (a hang) is reported as null, with ``hung`` in its details.
"""

from __future__ import annotations

import argparse
import inspect
import json
import multiprocessing
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from benchmarks.common import add_results_option, use_results, write_result
from benchmarks.decoding import LABELS, add_model_arguments, references, serve_config
from benchmarks.synthetic_ctc import Channel
from lmserve.rescoring.decoders.lm import DecoderLM
from lmserve.rescoring.decoders.pyctcdecode_lm import build_ctcdecoder
from lmserve.server.process import ServerProcess

MODEL = "english"


def bounded(run, limit: float) -> dict:
    """``run()`` in a thread of its own, waited for at most ``limit`` seconds: its result or error, and seconds."""
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


def best(decoder, emissions: np.ndarray, beam: int) -> tuple[str, float]:
    text, state, *_ = decoder.decode_beams(emissions, beam_width=beam)[0]
    return text, state.logprob


def differing(got: list[tuple[str, float]], expected: list[tuple[str, float]]) -> int:
    return sum(g[0] != e[0] or abs(g[1] - e[1]) > 1e-6 for g, e in zip(got, expected, strict=True))


def hung_server(address: str, server: ServerProcess, limit: float, step_timeout: float | None) -> dict:
    """Seconds from a step on a SIGSTOPped server until its error (the decoder with its default deadline unless
    ``step_timeout`` is given)."""
    lm = DecoderLM.remote(address, MODEL, **({} if step_timeout is None else {"timeout": step_timeout}))
    start = lm.start()
    lm.score(start, "THE")  # a stream is open and has answered
    server.send(signal.SIGSTOP)
    try:
        run = bounded(lambda: lm.score(start, "A"), limit)
    finally:
        server.send(signal.SIGCONT)
    lm.close()
    if "error" in run:
        run["names_the_server"] = address in run["error"]
        run["deadline_exceeded"] = "DEADLINE_EXCEEDED" in run["error"]
    return run


def shared_decoder(decoder, emissions: list[np.ndarray], threads: int, beam: int, limit: float) -> tuple[dict, list]:
    results: list = [None] * len(emissions)
    errors: list[str] = []

    def share(first: int) -> None:
        try:
            for i in range(first, len(emissions), threads):
                results[i] = best(decoder, emissions[i], beam)
        except Exception as error:  # noqa: BLE001 (counted: a refusal is a result here)
            errors.append(f"{type(error).__name__}: {error}")

    def run():
        workers = [threading.Thread(target=share, args=(k,)) for k in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()

    out = bounded(run, limit)
    if errors:
        out["error"] = errors[0]
        out["errors"] = len(errors)
    return out, results


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--utterances", type=int, default=32)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--processes", type=int, default=4, help="the fork pool's workers")
    parser.add_argument("--beam", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=0.5)
    parser.add_argument("--beta", type=float, default=1.0)
    parser.add_argument("--limit-s", type=float, default=600.0, help="a run still going after this is a hang")
    parser.add_argument("--step-timeout", type=float, help="(tests) the hung decoder's deadline, not the default")
    parser.add_argument("--labels", default="", help="(tests) CTC labels as one string after the blank")
    parser.add_argument("--texts", type=Path, help="(tests) sentences to decode instead of LibriSpeech's")
    parser.add_argument("--no-write", action="store_true", help="print the result, write no file (tests)")
    add_results_option(parser)
    args = parser.parse_args(argv)
    use_results(args.results)
    labels = ["", *args.labels] if args.labels else LABELS
    normalize = args.normalize or None
    texts = args.texts.read_text().splitlines() if args.texts else references("dev_other", args.utterances)
    texts = texts[: args.utterances]
    channel = Channel()
    rng = np.random.default_rng(channel.seed)
    emissions = [channel.emissions(t, labels, rng) for t in texts]
    ngram = args.ngram if args.ngram and args.ngram.exists() else None
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        config = serve_config(tmp / "server", args.bundle, ngram, args.lam if ngram else None, normalize, workers=2)
        with ServerProcess(config, tmp / "server.log", start_timeout=300) as server:
            with DecoderLM.remote(server.address, MODEL) as lm:
                decoder = build_ctcdecoder(labels, lm, alpha=args.alpha, beta=args.beta)
                start = time.perf_counter()
                reference = [best(decoder, e, args.beam) for e in emissions]
                runs["one_thread"] = {"seconds": time.perf_counter() - start}
                runs["shared_decoder"], shared = shared_decoder(
                    decoder, emissions, args.threads, args.beam, args.limit_s
                )
                with multiprocessing.get_context("fork").Pool(args.processes) as pool:
                    runs["fork_pool"] = bounded(
                        lambda: decoder.decode_batch(pool, emissions, beam_width=args.beam), args.limit_s
                    )
            runs["hung_server"] = hung_server(server.address, server, args.limit_s, args.step_timeout)
            server.stop()

    def count(run: dict, wrong) -> int | None:
        if "hung" in run:
            return None
        return -1 if "error" in run else wrong()

    metrics = {
        "hung_server_error_s": runs["hung_server"]["seconds"] if "error" in runs["hung_server"] else None,
        "shared_decoder_wrong_results": count(runs["shared_decoder"], lambda: differing(shared, reference)),
        "fork_pool_wrong_results": count(
            runs["fork_pool"],
            lambda: sum(t != r[0] for t, r in zip(runs["fork_pool"]["result"], reference, strict=True)),
        ),
    }
    for run in runs.values():
        run.pop("result", None)  # (the texts: compared above)
    for name, run in runs.items():
        print(f"{name}: {json.dumps(run)}", flush=True)
    extra = dict(
        targets="hung_server_error_s <= 31 (the 30 s default deadline); both wrong-result counts 0 (-1: refused)",
        runs=runs,
        step_timeout=args.step_timeout or inspect.signature(DecoderLM.remote).parameters["timeout"].default,
        utterances=len(texts),
        threads=args.threads,
        processes=args.processes,
        beam=args.beam,
        alpha=args.alpha,
        beta=args.beta,
        channel=channel.describe(),
        cores=os.cpu_count(),
        model={
            "bundle": str(args.bundle),
            "ngram": str(ngram) if ngram else None,
            "lambda": args.lam,
            "normalize": normalize,
        },
        decoder="pyctcdecode (build_ctcdecoder) over DecoderLM.remote: a StreamNextWords stream per thread, tokens",
    )
    if args.no_write:
        print(json.dumps({"metrics": metrics, **extra}, indent=1))
    else:
        write_result("serve_decoder_clients", metrics, **extra)
    return {"metrics": metrics, **extra}


if __name__ == "__main__":
    main()
