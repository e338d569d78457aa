"""What the lm-serve benchmarks share: the LibriSpeech rescoring server (a config, started as a child process), the
requests they replay (LibriSpeech dev_other 30-best lists, PTB test sentences), and a closed-loop load generator.

The load generator is our own asyncio client on one channel over loopback: ``concurrency`` callers, each sending its
next request as soon as the last one is answered, until a request count or a time limit is reached. Requests are
serialised once beforehand and responses are not parsed (the caller keeps the bytes), so that the load generator,
which shares the machine's cores with the server, spends as little CPU as a client can.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from benchmarks.common import DATA_DIR, RESULTS, ROOT, ensure_bundle, ptb_sentences
from benchmarks.rescoring_models import GUTENBERG
from lmserve.rescoring.client import hypothesis_list
from lmserve.rescoring.nbest import NBestEntry, read_nbest
from lmserve.rescoring.tune import read_weights
from lmserve.server.process import ServerProcess
from lmserve.v1 import lmserve_pb2 as pb

BUNDLE = GUTENBERG.bundle
# the same model exported with --quantize int8: LibriSpeech dev_other WER unchanged (3.53% with the tuned weights,
# every error count the same), the LM work of a call 1.7x faster
BUNDLE_INT8 = ROOT / "var" / "bundles" / "gutenberg_rescore_int8"
NGRAM = GUTENBERG.ngram
WEIGHTS = RESULTS / "rescore_librispeech_first_pass_plus_ours.weights.json"
PROFILE = "dev_clean"  # the weights file was tuned on dev_clean; the load replays dev_other
# used when the weights file is missing: the shape of the tuned ones (first-pass score, our LMs, length, OOVs)
INLINE_WEIGHTS = {"score": 1.0, "neural": 0.06, "ngram": 0.0, "length": -1.0, "oov": -5.7}
LAMBDA = 0.4
DEV_OTHER = DATA_DIR / "librispeech-nbest" / "dev_other.tar.gz"


@dataclass
class ServerSettings:
    """What the benchmarks vary or report: scoring threads, ONNX Runtime threads per scorer call, batching."""

    workers: int = 2
    engine: str = "threads"
    scorer_threads: int = 1
    batching: bool = True
    max_batch_tokens: int = 16384
    max_wait_ms: float = 10.0
    grace_seconds: float = 30.0

    def record(self) -> dict:
        return dict(self.__dict__)


def write_config(folder: Path, settings: ServerSettings, bundle: Path = BUNDLE) -> Path:
    """The LibriSpeech rescoring model (bundle, 4-gram, ``librispeech`` text, λ and the tuned weights profile)."""
    profile = f'[models.librispeech.profiles]\n{PROFILE} = "{WEIGHTS}"\n' if WEIGHTS.exists() else ""
    path = folder / "serve.toml"
    path.write_text(
        f'[server]\nworkers = {settings.workers}\nengine = "{settings.engine}"\n'
        f"scorer_threads = {settings.scorer_threads}\nmetrics_port = 0\n"
        f"grace_seconds = {settings.grace_seconds}\nmax_concurrent_calls = 256\nadmin = true\n"
        f"[batching]\nenabled = {str(settings.batching).lower()}\nmax_batch_tokens = {settings.max_batch_tokens}\n"
        f"max_wait_ms = {settings.max_wait_ms}\n"
        f'[models.librispeech]\nbundle = "{bundle}"\nngram = "{NGRAM}"\nnormalize = "librispeech"\n'
        f"lambda = {LAMBDA}\n{profile}"
    )
    return path


def served_bundle(precision: str) -> Path:
    """The rescoring model's bundle as ``fp32`` or ``int8`` (exported on first use, with its 4-gram)."""
    GUTENBERG.ensure()
    if precision == "fp32":
        return GUTENBERG.bundle
    return ensure_bundle(GUTENBERG.run, BUNDLE_INT8, quantize="int8", heldout=str(GUTENBERG.valid))


def start_server(
    folder: Path, settings: ServerSettings, name: str = "server", bundle: Path = BUNDLE, replicas: int = 1
) -> ServerProcess:
    """``lm-serve serve`` on free ports; with ``replicas``, its ``address`` is the round-robin target of them all."""
    folder.mkdir(parents=True, exist_ok=True)
    config = write_config(folder, settings, bundle)
    return ServerProcess(config, folder / f"{name}.log", "--replicas", str(replicas), start_timeout=300)


def combination() -> dict:
    """How the lists are combined: the tuned profile when its file is there, else inline weights."""
    if WEIGHTS.exists():
        return {"profile": PROFILE, "weights_file": str(WEIGHTS), "dev_metric": read_weights(WEIGHTS)["dev_metric"]}
    return {"weights": INLINE_WEIGHTS, "interpolation_weight": LAMBDA}


def dev_other_lists(seed: int = 0) -> list[NBestEntry]:
    """Every dev_other 30-best list in a fixed shuffled order (a time-limited run then sees a fair sample of list
    lengths), without references: decoders have none."""
    nbest = read_nbest(DEV_OTHER)
    order = np.random.default_rng(seed).permutation(len(nbest))
    return [NBestEntry(nbest.entries[i].id, nbest.entries[i].hypotheses) for i in order]


def decoder_walks(vocab: list[str], candidates: int = 8, seed: int = 0) -> list[list[list[str]]]:
    """A decoder's steps over dev_other's reference transcripts (then ``</s>``): per transcript, per step, the
    candidates, the true word first and ``candidates - 1`` other words of the vocabulary (drawn with ``seed``)."""
    rng = np.random.default_rng(seed)
    words = [w for w in vocab if w not in ("<s>", "</s>", "<unk>")]
    return [
        [
            [word, *(words[i] for i in rng.choice(len(words), candidates - 1, replace=False))]
            for word in [*entry.references[0].split(), "</s>"]
        ]
        for entry in read_nbest(DEV_OTHER)
    ]


def nbest_requests(lists: list[NBestEntry]) -> list[bytes]:
    """Each list as one RescoreNBest call, combined as :func:`combination` says."""
    chosen = combination()
    out = []
    for entry in lists:
        request = pb.RescoreNBestRequest(model="librispeech")
        request.lists.append(hypothesis_list(entry))
        if "profile" in chosen:
            request.combination.profile = chosen["profile"]
        else:
            request.combination.weights.update(chosen["weights"])
            request.combination.interpolation_weight = chosen["interpolation_weight"]
        out.append(request.SerializeToString())
    return out


def sentence_requests(seed: int = 0) -> list[bytes]:
    """Every PTB test sentence as one ScoreSentences call, shuffled."""
    sentences = ptb_sentences("test")
    order = np.random.default_rng(seed).permutation(len(sentences))
    return [pb.ScoreSentencesRequest(model="librispeech", sentences=[sentences[i]]).SerializeToString() for i in order]


@dataclass
class Load:
    """One closed-loop run: every call's latency and status code."""

    concurrency: int
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)  # of the calls answered OK, seconds
    codes: Counter = field(default_factory=Counter)

    @property
    def rps(self) -> float:
        return len(self.latencies) / self.seconds if self.seconds else 0.0

    def percentile_ms(self, q: float) -> float:
        return float(np.percentile(self.latencies, q) * 1000) if self.latencies else float("nan")

    def summary(self) -> dict:
        return {
            "concurrency": self.concurrency,
            "requests": sum(self.codes.values()),
            "ok": self.codes["OK"],
            "errors": sum(n for code, n in self.codes.items() if code != "OK"),
            "seconds": round(self.seconds, 3),
            "rps": self.rps,
            "p50_ms": self.percentile_ms(50),
            "p95_ms": self.percentile_ms(95),
            "p99_ms": self.percentile_ms(99),
            "mean_ms": float(np.mean(self.latencies) * 1000) if self.latencies else float("nan"),
        }


def raw_method(channel: grpc.aio.Channel, method: str):
    """A call that sends bytes and returns bytes: no (de)serialisation in the load generator."""
    return channel.unary_unary(f"/lmserve.v1.LMService/{method}")


async def closed_loop(
    address: str,
    requests: list[bytes],
    method: str,
    concurrency: int,
    max_requests: int,
    max_seconds: float,
    start_at: int = 0,
    timeout: float = 60.0,
) -> Load:
    """``concurrency`` callers replaying ``requests`` (cycling from ``start_at``) until ``max_requests`` calls are
    answered or ``max_seconds`` have passed; throughput counts the calls answered OK over the wall time. ``address``
    may name several replicas (``start_server(..., replicas=2).address``): calls then take turns between them."""
    load = Load(concurrency)
    options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.lb_policy_name", "round_robin")]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        call = raw_method(channel, method)
        issued = 0
        start = time.perf_counter()
        deadline = start + max_seconds

        async def caller() -> None:
            nonlocal issued
            while issued < max_requests and time.perf_counter() < deadline:
                request = requests[(start_at + issued) % len(requests)]
                issued += 1
                sent = time.perf_counter()
                try:
                    await call(request, timeout=timeout)
                except grpc.aio.AioRpcError as e:
                    load.codes[e.code().name] += 1
                    continue
                load.latencies.append(time.perf_counter() - sent)
                load.codes["OK"] += 1

        await asyncio.gather(*(caller() for _ in range(concurrency)))
        load.seconds = time.perf_counter() - start
    return load


def run_load(address: str, requests: list[bytes], method: str, concurrency: int, **limits) -> Load:
    return asyncio.run(closed_loop(address, requests, method, concurrency, **limits))


def rss_bytes(pid: int) -> int:
    """Resident set size of a process and its children (a server's scoring processes), from /proc."""
    total = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            total = int(line.split()[1]) * 1024
    for task in Path(f"/proc/{pid}/task").iterdir():  # a child belongs to the thread that started it
        with contextlib.suppress(FileNotFoundError):  # the thread, or the child, ended since
            for child in (task / "children").read_text().split():
                total += rss_bytes(int(child))
    return total
