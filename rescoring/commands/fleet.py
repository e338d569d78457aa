"""``lm-rescore nbest --server A,B,… --concurrency C``: the LM features of whole n-best lists from a fleet of
lm-serve replicas, with C ``RescoreNBest`` calls in flight.

Why whole lists through ``RescoreNBest``: the server runs a list's hypotheses through the LSTM as one prefix tree and
merges concurrent calls into batches (``server.batching``), which ``ScoreSentences`` (sentences one by one, the path
``tune --server`` keeps, since tuning needs every token's score) cannot do.

What a call asks for: the LM columns the weights use (``neural``, ``ngram``, ``interp`` at the weights' λ, the OOV
counts ``oov``, ``oov_lm``, ``oov_ngram``), each with weight 0, for lists that carry only their texts. The answer's
feature values are the engine's own sums (``lmscores.LMSums``), and everything else (definitions, weights, reranking,
the report) runs here, in the code of the offline run: the output is byte for byte the offline one whenever the
servers' LM scores are the offline scores (the same model; tests/test_rescore_at_scale.py,
``test_a_fleet_rescores_as_the_offline_run``, checks it).

Dispatch: each target is first asked ``GetModelInfo``; every target that answers must serve the same model (bundle
fingerprint, n-gram, text normalisation), and only those are sent lists. A call goes to the target with the fewest
calls in flight (ties in turn). ``UNAVAILABLE`` (a replica down, restarting or draining) puts the target aside for a
backoff that doubles with each failure in a row (``BACKOFF``), to be asked ``GetModelInfo`` again before it gets
more work, and the call goes again, to another target when one serves. Any other error ends the run with its status,
the target and the list. A call that has no answer ``deadline`` seconds after its first try (retries included; a list
that finds no target serving counts as tried) ends the run, naming every target and what it last said. Results come
back in input order.

grpc's futures API does the waiting: each answer's callback puts it on a queue that the calling thread reads, and
that thread alone decides what to send next (no thread pool, no locks).
"""

from __future__ import annotations

import queue
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import numpy as np
from tqdm import tqdm

from lmserve.rescoring.client import channel_credentials, channel_options, normalisation_name, text_settings_json
from lmserve.rescoring.features import NEEDS_LM
from lmserve.rescoring.lmscores import LMSums
from lmserve.rescoring.nbest import NBestList
from lmserve.rescoring.rescore import Setup
from lmserve.v1 import lmserve_pb2 as pb
from lmserve.v1.lmserve_pb2_grpc import LMServiceStub

BACKOFF = (0.1, 5.0)  # seconds a target is put aside after UNAVAILABLE: the first time, at most (doubling)
PROBE_SECONDS = 10.0  # GetModelInfo's own deadline
# what every target must agree on: ModelInfo's fields (normalisation_settings_json: the text normalisation settings)
_SAME_MODEL = ("name", "fingerprint", "ngram", "normalisation_settings_json")


class FleetError(OSError):
    """No answer in time, or an answer that cannot be used; the message names the targets and what they said."""


def parse_targets(text: str) -> list[str]:
    """``HOST:PORT,HOST:PORT,…`` (or gRPC's round-robin form ``ipv4:HOST:PORT,HOST:PORT``) -> one address each."""
    body = text.split(":", 1)[1] if text.startswith(("ipv4:", "ipv6:")) else text
    targets = [t.strip() for t in body.split(",")]
    if not all(targets):
        raise ValueError(f"--server {text!r}: expected HOST:PORT or several, comma-separated")
    if len(set(targets)) != len(targets):
        raise ValueError(f"--server {text!r}: a target is named twice")
    return targets


@dataclass
class _Target:
    address: str
    channel: grpc.Channel
    stub: LMServiceStub
    state: str = "new"  # new (to ask GetModelInfo) -> probing -> serving; back to new after UNAVAILABLE
    ready_at: float = 0.0  # put aside until then
    failures: int = 0  # UNAVAILABLE in a row
    in_flight: int = 0
    last_error: str = "not tried"

    def unavailable(self, error: grpc.RpcError, now: float) -> None:
        self.last_error = _status(error)
        if self.state == "new" and self.ready_at > now:  # put aside already, by another call of this outage
            return
        self.state = "new"
        self.failures += 1
        self.ready_at = now + min(BACKOFF[0] * 2 ** (self.failures - 1), BACKOFF[1])


def _status(error: grpc.RpcError) -> str:
    return f"{error.code().name}: {error.details()}"


class Fleet:
    """Channels to every target; :meth:`call` sends requests over them. Construction waits (up to ``deadline``
    seconds) until one target has said which model it serves (``info``)."""

    def __init__(
        self,
        targets: Sequence[str],
        model: str = "",
        concurrency: int = 8,
        deadline: float = 120.0,
        ca: str | None = None,
    ):
        if concurrency < 1:
            raise ValueError(f"--concurrency {concurrency}: expected at least 1 call in flight")
        if not deadline > 0:
            raise ValueError(f"--deadline {deadline}: expected a number of seconds above 0")
        self.addresses = list(targets)
        self.model = model
        self.concurrency = concurrency
        self.deadline = deadline
        options = [
            *channel_options(),  # round-robin: a target may resolve to several (dns:///a headless Service)
            ("grpc.initial_reconnect_backoff_ms", 100),  # a restarted replica is found again within a second or two
            ("grpc.max_reconnect_backoff_ms", 2000),
        ]
        self.targets = []
        for address in self.addresses:
            if ca is None:
                channel = grpc.insecure_channel(address, options=options)
            else:
                channel = grpc.secure_channel(address, channel_credentials(ca), options=options)
            self.targets.append(_Target(address, channel, LMServiceStub(channel)))
        self.info: pb.ModelInfo | None = None
        self.info_from = ""
        self.events: queue.Queue = queue.Queue()
        self.outstanding: set[grpc.Future] = set()
        self.generation = 0  # of call(): answers to the calls of an earlier one are dropped
        self.turn = 0
        try:
            self.call([])  # until a target has answered GetModelInfo
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for target in self.targets:
            target.channel.close()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def call(self, requests: Sequence[pb.RescoreNBestRequest], progress: bool = False) -> list[pb.Rescored]:
        """Every request's result, in order (module docstring: dispatch, retries, deadline)."""
        results: list[pb.Rescored | None] = [None] * len(requests)
        pending = deque(range(len(requests)))
        first_try: dict[int, float] = {}  # unanswered request -> when it was first sent (or found none serving)
        left = len(requests)
        start = time.monotonic()
        try:
            with tqdm(total=len(requests), desc="LM features (fleet)", unit="call", disable=not progress) as bar:
                while left or self.info is None:
                    now = time.monotonic()
                    self._probe(now)
                    while pending and self._busy() < self.concurrency:
                        target = self._pick(now)
                        if target is None:  # none serves: the first list waiting counts as tried
                            first_try.setdefault(pending[0], now)
                            break
                        i = pending.popleft()
                        first_try.setdefault(i, now)
                        self._send(target, i, requests[i], first_try[i] + self.deadline - now)
                    due = min(first_try.values(), default=start) + self.deadline
                    if now >= due:
                        raise self._timed_out(requests, list(first_try))
                    wake = min([due, *(t.ready_at for t in self.targets if t.ready_at > now)]) - now
                    try:
                        generation, kind, target, i, future = self.events.get(timeout=max(wake, 0.001))
                    except queue.Empty:
                        continue
                    if generation != self.generation:  # an answer to a call an earlier run gave up
                        continue
                    self.outstanding.discard(future)
                    if kind == "probe":
                        self._probed(target, future)
                        continue
                    target.in_flight -= 1
                    error = future.exception()
                    if error is None:
                        results[i] = future.result().result
                        del first_try[i]
                        target.failures = 0
                        left -= 1
                        bar.update(1)
                    elif error.code() == grpc.StatusCode.UNAVAILABLE:
                        target.unavailable(error, time.monotonic())
                        pending.appendleft(i)
                    elif error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                        target.last_error = _status(error)
                        raise self._timed_out(requests, [i])
                    else:
                        lists = [x.id for x in requests[i].lists]
                        raise FleetError(
                            f"lm-serve at {target.address}: {_status(error)} (the call for lists {_ids(lists)})"
                        )
        finally:
            self.generation += 1
            for future in self.outstanding:
                future.cancel()
            self.outstanding.clear()
            for target in self.targets:
                target.in_flight = 0
                if target.state == "probing":  # its question was given up: ask again next time
                    target.state = "new"
        return results

    def _busy(self) -> int:
        return sum(t.in_flight for t in self.targets)

    def _pick(self, now: float) -> _Target | None:
        """The serving target with the fewest calls in flight, ties in turn; None when none serves now."""
        n = len(self.targets)
        order = [self.targets[(self.turn + k) % n] for k in range(n)]
        serving = [t for t in order if t.state == "serving" and t.ready_at <= now]
        if not serving:
            return None
        best = min(serving, key=lambda t: t.in_flight)
        self.turn = (self.targets.index(best) + 1) % n
        return best

    def _send(self, target: _Target, i: int, request: pb.RescoreNBestRequest, timeout: float) -> None:
        target.in_flight += 1
        future = target.stub.RescoreNBest.future(request, timeout=max(timeout, 0.001))
        self._watch("call", target, i, future)

    def _probe(self, now: float) -> None:
        for target in self.targets:
            if target.state == "new" and target.ready_at <= now:
                target.state = "probing"
                request = pb.GetModelInfoRequest(model=self.info.name if self.info else self.model)
                self._watch("probe", target, -1, target.stub.GetModelInfo.future(request, timeout=PROBE_SECONDS))

    def _watch(self, kind: str, target: _Target, i: int, future: grpc.Future) -> None:
        self.outstanding.add(future)
        generation = self.generation
        future.add_done_callback(lambda f: self.events.put((generation, kind, target, i, f)))

    def _probed(self, target: _Target, future: grpc.Future) -> None:
        error = future.exception()
        if error is None:
            info = future.result().model
            if self.info is None:
                self.info, self.info_from = info, target.address
            differs = [name for name in _SAME_MODEL if getattr(info, name) != getattr(self.info, name)]
            if differs:
                raise FleetError(
                    f"lm-serve at {target.address} serves another model than {self.info_from}: {differs[0]} "
                    f"{getattr(info, differs[0])!r:.200} against {getattr(self.info, differs[0])!r:.200}; every "
                    "target must serve the same one"
                )
            target.state, target.failures, target.last_error = "serving", 0, "OK"
        elif error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            target.unavailable(error, time.monotonic())
        else:
            raise FleetError(f"lm-serve at {target.address}: {_status(error)}")

    def _timed_out(self, requests: Sequence[pb.RescoreNBestRequest], late: list[int]) -> FleetError:
        said = "; ".join(f"{t.address}: {t.last_error}" for t in self.targets)
        if self.info is None:
            return FleetError(f"no lm-serve target answered within --deadline {self.deadline:g} s ({said})")
        lists = [x.id for i in late for x in requests[i].lists]
        return FleetError(
            f"lists {_ids(lists)} had no answer within --deadline {self.deadline:g} s of their first try ({said})"
        )


def _ids(ids: list[str]) -> str:
    shown = ", ".join(repr(x) for x in ids[:3])
    return shown + (f" and {len(ids) - 3} more" if len(ids) > 3 else "")


class FleetLanguageModels:
    """Duck-types ``rescoring.rescore.LanguageModels`` for ``lm-rescore nbest`` (``available``, ``scores``,
    ``paths``, ``normalisation``, ``fingerprint``): ``scores`` gives each list's LM feature sums at the setup's λ
    from the fleet, ``lists_per_call`` lists a call."""

    available = True

    def __init__(self, fleet: Fleet, setup: Setup, lists_per_call: int = 1):
        if lists_per_call < 1:
            raise ValueError(f"--lists-per-call {lists_per_call}: expected at least 1")
        info = fleet.info
        self.fleet = fleet
        read = {*setup.features, *(term for terms in setup.definitions.values() for term in terms)}
        self.columns = [name for name in NEEDS_LM if name in read]
        self.lam = setup.lam if "interp" in self.columns else None
        self.lists_per_call = lists_per_call
        self.normalisation = normalisation_name(info.normalisation)
        self.paths = {
            "server": ",".join(fleet.addresses),
            "model": info.name,
            "lm": info.bundle,
            "ngram": info.ngram or None,
            "normalize": None,
        }
        self.fingerprint = {
            "server_model": info.name,
            "neural": info.fingerprint,
            "ngram": info.ngram or None,
            "normalizer": text_settings_json(info),
        }

    def scores(self, nbest: NBestList, cache=None, progress: bool = False) -> list[LMSums] | None:
        """``cache`` is not used: the servers answer with sums over tokens, not the token scores a cache holds."""
        if not self.columns:
            return None
        combination = pb.Combination(weights=dict.fromkeys(self.columns, 0.0), interpolation_weight=self.lam or 0.0)
        entries = nbest.entries
        requests = [
            pb.RescoreNBestRequest(
                model=self.fleet.info.name,
                lists=[
                    pb.HypothesisList(id=e.id, hypotheses=[pb.Hypothesis(text=h.text) for h in e.hypotheses])
                    for e in entries[start : start + self.lists_per_call]
                ],
                combination=combination,
            )
            for start in range(0, len(entries), self.lists_per_call)
        ]
        ranked = [x for result in self.fleet.call(requests, progress) for x in result.lists]
        return [self._sums(x) for x in ranked]

    def _sums(self, ranked: pb.RankedList) -> LMSums:
        """A ranked list's LM columns back in the order of its hypotheses (``original_rank``)."""
        n = len(ranked.hypotheses)
        values = {name: np.empty(n, dtype=np.float64) for name in self.columns}
        for h in ranked.hypotheses:
            features = h.features
            for name, column in values.items():
                column[h.original_rank - 1] = features[name]
        oov = values.get("oov")
        return LMSums(
            neural=values.get("neural"),
            ngram=values.get("ngram"),
            interp=values.get("interp"),
            lam=self.lam,
            oov=np.zeros(n, dtype=np.int64) if oov is None else oov.astype(np.int64),
            tokens=None,  # not in the answer, and no feature reads it
            oov_lm=None if values.get("oov_lm") is None else values["oov_lm"].astype(np.int64),
            oov_ngram=None if values.get("oov_ngram") is None else values["oov_ngram"].astype(np.int64),
        )
