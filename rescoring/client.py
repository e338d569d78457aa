"""A small blocking client for ``lm-serve``: one method per RPC, plain Python arguments in, response messages out.

    with LMServeClient("127.0.0.1:50051") as client:
        client.score_sentences(["the cat sat"]).sentences[0].neural.logprob
        state = b""
        for word in ["the", "cat"]:
            state = client.score_next_words([word], state).words[0].state
        client.rescore_nbest(read_nbest("dev.jsonl"), profile="dev_clean").evaluation.rescored
        # a beam step: the candidates after each hypothesis' state, in one call
        step = client.score_next_words_batch([(b"", ["the", "a"]), (state, ["</s>"])])
        with client.stream_next_words() as stream:  # one stream per utterance
            step = stream.step([(b"", ["the", "a"])])

Errors arrive as ``grpc.RpcError`` with the server's status code and message; a call or a stream step that gets no
answer within ``timeout`` raises one with DEADLINE_EXCEEDED. Servers with TLS: ``LMServeClient(target,
ca="ca.pem")``, and with mutual TLS also ``cert="client.pem", key="client.key"``.

Threads and forks: a client (its channel) serves any number of threads; a stream answers one step at a time (steps
from several threads take turns). A forked child must not use its parent's client: make one there
(:meth:`LMServeClient.clone` makes it with the same settings without touching the parent's channel).

It lives in ``rescoring`` (with the client side of the wire messages) because ``lm-rescore --server`` uses it and
``rescoring`` must not import ``server``; the server imports it from here for ``lm-serve client``. Both sides share the
generated contract, ``lmserve.v1``. Nothing else in ``rescoring`` imports this module, so scoring never needs gRPC.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lmserve.rescoring.nbest import Hypothesis, NBestEntry, NBestList
from lmserve.v1 import lmserve_pb2 as pb
from lmserve.v1.lmserve_pb2_grpc import AdminStub, LMServiceStub

DEFAULT_TARGET = "127.0.0.1:50051"

NORMALISATIONS = {
    "exact": pb.NORMALISATION_EXACT,
    "self-normalised": pb.NORMALISATION_SELF_NORMALISED,
    "unnormalised": pb.NORMALISATION_UNNORMALISED,
}
"""The bundle's measured labels (``core.bundle``) as the wire enum."""


def channel_credentials(
    ca: str | Path | None = None, cert: str | Path | None = None, key: str | Path | None = None
) -> grpc.ChannelCredentials:
    """TLS credentials: ``ca`` the PEM file of the CA that signed the server's certificate (None: the system's
    roots); ``cert`` and ``key`` this client's certificate and key, for servers that ask for one (mutual TLS)."""
    if (cert is None) != (key is None):
        raise ValueError("a client certificate needs its key and a key its certificate: give both or neither")

    def read(path: str | Path | None) -> bytes | None:
        return None if path is None else Path(path).read_bytes()

    return grpc.ssl_channel_credentials(read(ca), read(key), read(cert))


def channel_options(max_message_bytes: int = 64 << 20) -> list[tuple[str, int | str]]:
    """The options of every channel to ``lm-serve``: messages up to ``max_message_bytes`` each way, calls round-robin
    over the target's addresses, and connections of the channel's own.

    The last matters when a server restarts on its port: gRPC's default pool shares one connection per address among
    all the channels of a process, and round-robin keeps reconnecting a dead one, with a backoff of up to two minutes.
    A client made after the restart would take over that backoff and fail at once with UNAVAILABLE ("Connection
    refused") while the server is up, as long as any older channel to the same address is still open."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.lb_policy_name", "round_robin"),
        ("grpc.use_local_subchannel_pool", 1),
    ]


class LMServeClient:
    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        timeout: float | None = 60.0,
        max_message_bytes: int = 64 << 20,
        tls: bool = False,
        ca: str | Path | None = None,
        cert: str | Path | None = None,
        key: str | Path | None = None,
    ):
        """``target``: ``HOST:PORT``, or replicas as ``ipv4:HOST:PORT,HOST:PORT`` (or a DNS name with several
        addresses): calls go round-robin over them (the service keeps no session, so any replica answers any call).
        ``timeout``: the deadline of each call and, by default, of each stream step, in seconds (None: none).
        ``tls``: connect with TLS, which ``ca``, ``cert`` and ``key`` imply (see :func:`channel_credentials`)."""
        self.target = target
        self.timeout = timeout
        self.settings = dict(
            target=target, timeout=timeout, max_message_bytes=max_message_bytes, tls=tls, ca=ca, cert=cert, key=key
        )
        options = channel_options(max_message_bytes)
        if tls or ca or cert or key:
            self.channel = grpc.secure_channel(target, channel_credentials(ca, cert, key), options=options)
        else:
            self.channel = grpc.insecure_channel(target, options=options)
        self.stub = LMServiceStub(self.channel)
        self.admin = AdminStub(self.channel)

    def __enter__(self) -> LMServeClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def clone(self) -> LMServeClient:
        """A new client with this one's settings and a channel of its own (a forked child's: the parent's channel
        belongs to the parent, and gRPC's threads that served it did not cross the fork)."""
        return LMServeClient(**self.settings)

    def score_sentences(self, sentences: Sequence[str], model: str = "", per_token: bool = False):
        request = pb.ScoreSentencesRequest(model=model, sentences=sentences, per_token=per_token)
        return self.stub.ScoreSentences(request, timeout=self.timeout)

    def rescore_nbest(self, lists: Iterable[NBestEntry | pb.HypothesisList], model: str = "", **combination):
        """ASR lists; ``combination``: ``profile=NAME`` or ``weights={feature: weight}`` (with ``definitions``,
        ``interpolation_weight``), and ``bootstrap_samples``. Returns the ``Rescored`` result."""
        request = pb.RescoreNBestRequest(model=model, lists=_lists(lists))
        _combine(request, **combination)
        return self.stub.RescoreNBest(request, timeout=self.timeout).result

    def rescore_kbest(self, lists: Iterable[NBestEntry | pb.HypothesisList], model: str = "", **combination):
        """MT lists, evaluated with BLEU; as :meth:`rescore_nbest`."""
        request = pb.RescoreKBestRequest(model=model, lists=_lists(lists))
        _combine(request, **combination)
        return self.stub.RescoreKBest(request, timeout=self.timeout).result

    def score_next_words(
        self,
        candidates: Sequence[str] = (),
        state: bytes = b"",
        model: str = "",
        top_k: int = 0,
        all_words: bool = False,
    ):
        request = pb.ScoreNextWordsRequest(
            model=model, state=state, candidates=candidates, top_k=top_k, all_words=all_words
        )
        return self.stub.ScoreNextWords(request, timeout=self.timeout)

    def score_next_words_batch(
        self,
        items: Iterable[tuple[bytes | str, Sequence[str]]],
        model: str = "",
        cache_states: bool = False,
        scores_only: bool = False,
        release: Sequence[str] = (),
    ):
        """One beam step (ScoreNextWordsBatch): ``items`` are (state, candidates), a state being a token (bytes; b""
        starts a sentence) or a cached state's id (str); ``release``: cached ids no longer needed."""
        request = next_words_batch_request(items, model, cache_states, scores_only, release)
        return self.stub.ScoreNextWordsBatch(request, timeout=self.timeout)

    def stream_next_words(self, timeout: float | None = None, step_timeout: float | None = ...) -> NextWordsStream:
        """A StreamNextWords stream (one per utterance, say); ``timeout``: the whole stream's deadline (default
        none: a stream lasts as long as its decoder needs); ``step_timeout``: each step's (default: the client's
        ``timeout``; None: none)."""
        return NextWordsStream(self, timeout, self.timeout if step_timeout is ... else step_timeout)

    def list_models(self):
        return self.stub.ListModels(pb.ListModelsRequest(), timeout=self.timeout)

    def model_info(self, model: str = ""):
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(model=model), timeout=self.timeout).model

    def reload_models(self):
        """Load the server's models again (Admin.ReloadModels); FAILED_PRECONDITION when they could not be loaded
        (the server keeps the old ones)."""
        return self.admin.ReloadModels(pb.ReloadModelsRequest(), timeout=self.timeout)

    def health(self, service: str = "") -> str:
        """SERVING, NOT_SERVING, ... of the whole server (``""``) or one service."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=self.timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def next_words_batch_request(
    items: Iterable[tuple[bytes | str, Sequence[str]]],
    model: str = "",
    cache_states: bool = False,
    scores_only: bool = False,
    release: Sequence[str] = (),
) -> pb.ScoreNextWordsBatchRequest:
    request = pb.ScoreNextWordsBatchRequest(
        model=model, cache_states=cache_states, scores_only=scores_only, release_state_ids=release
    )
    for state, candidates in items:
        item = request.items.add(candidates=candidates)
        if isinstance(state, str):
            item.state_id = state
        else:
            item.state = state
    return request


class StreamStepTimeout(grpc.RpcError):
    """A stream step that got no answer within its deadline (a hung or overloaded server): DEADLINE_EXCEEDED, as a
    call's deadline gives; the stream is cancelled."""

    def __init__(self, target: str, seconds: float):
        self.target, self.seconds = target, seconds
        super().__init__(f"lm-serve at {target}: DEADLINE_EXCEEDED: {self.details()}")

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return f"no answer to a StreamNextWords step within {self.seconds:g} s (the stream was cancelled)"


_END = object()  # the server ended the stream


class NextWordsStream:
    """One StreamNextWords stream: :meth:`step` sends a request and waits for its answer (the stream keeps one
    server and one connection for all of a decoder's steps), at most ``step_timeout`` seconds. An error ends the
    stream: :meth:`step` raises the ``grpc.RpcError`` with the server's status code (:class:`StreamStepTimeout`
    when the deadline passed), and later steps raise it again. Steps from several threads take turns.

    A thread reads the answers, so that a step can stop waiting: gRPC's iterator of a stream's responses has no
    deadline of its own, and a server that stops answering (SIGSTOP, a lost peer) would block the decoder forever."""

    def __init__(self, client: LMServeClient, timeout: float | None = None, step_timeout: float | None = None):
        self.client = client
        self.step_timeout = step_timeout
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        self.answers: queue.SimpleQueue = queue.SimpleQueue()
        self.responses = client.stub.StreamNextWords(iter(self.requests.get, None), timeout=timeout)
        self.turn = threading.Lock()
        self.failure: BaseException | None = None
        self.closed = False
        self.reader = threading.Thread(target=self._read, name="lmserve-stream", daemon=True)
        self.reader.start()

    def _read(self) -> None:
        try:
            for response in self.responses:
                self.answers.put(response)
        except grpc.RpcError as error:
            self.answers.put(error)
        else:
            self.answers.put(_END)

    def step(
        self,
        items: Iterable[tuple[bytes | str, Sequence[str]]],
        model: str = "",
        cache_states: bool = False,
        scores_only: bool = False,
        release: Sequence[str] = (),
    ):
        request = next_words_batch_request(items, model, cache_states, scores_only, release)
        with self.turn:
            if self.closed:
                raise ValueError("the stream is closed")
            if self.failure is not None:
                raise self.failure
            self.requests.put(request)
            try:
                answer = self.answers.get(timeout=self.step_timeout)
            except queue.Empty:
                self.failure = StreamStepTimeout(self.client.target, self.step_timeout)
                self.requests.put(None)  # (gRPC's thread that sends the requests ends)
                self.responses.cancel()
                raise self.failure from None
            if answer is _END:
                answer = RuntimeError(f"lm-serve at {self.client.target} ended the stream without an answer")
            if isinstance(answer, BaseException):
                self.failure = answer
                raise answer
            return answer

    def end(self) -> None:
        """End the requests without waiting (the server then ends its side); :meth:`close` waits for that."""
        if not self.closed:
            self.closed = True
            self.requests.put(None)

    def close(self, timeout: float | None = ...) -> None:
        """End the stream: the requests end, and the server ends its side; one that does not within ``timeout``
        (default: the step deadline), a hung server, is cancelled."""
        self.end()
        self.reader.join(self.step_timeout if timeout is ... else timeout)
        if self.reader.is_alive():
            self.responses.cancel()

    def cancel(self) -> None:
        """End the stream at once, whatever the server does."""
        self.end()
        self.responses.cancel()

    def __enter__(self) -> NextWordsStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _lists(lists: Iterable[NBestEntry | pb.HypothesisList]) -> list[pb.HypothesisList]:
    return [x if isinstance(x, pb.HypothesisList) else hypothesis_list(x) for x in lists]


def _combine(
    request,
    profile: str = "",
    weights: Mapping[str, float] | None = None,
    definitions: Sequence[str] = (),
    interpolation_weight: float = 0.0,
    bootstrap_samples: int = 0,
) -> None:
    request.combination.CopyFrom(
        pb.Combination(
            profile=profile,
            weights=dict(weights or {}),
            definitions=definitions,
            interpolation_weight=interpolation_weight,
        )
    )
    request.bootstrap_samples = bootstrap_samples


def normalisation_name(value: int) -> str | None:
    """The wire enum of score normalisation back to the bundle's label (None for unspecified)."""
    return next((name for name, v in NORMALISATIONS.items() if v == value), None)


def text_settings_json(info: pb.ModelInfo) -> str:
    """A model's *text* normalisation settings (``core.textnorm.TextNormalizer.to_dict()`` as JSON). The wire field is
    ``normalisation_settings_json``, a name older than the rule that a bare "normalisation" is score normalisation
    (docs/design.md, Names), and kept for compatibility: read it through this."""
    return info.normalisation_settings_json


def hypothesis_list(entry: NBestEntry) -> pb.HypothesisList:
    """A list to send; ``rank`` and ``source`` only where the entry has them (an empty source is present on the wire:
    a source of no words)."""
    message = pb.HypothesisList(
        id=entry.id,
        hypotheses=[pb.Hypothesis(text=h.text, features=h.features, rank=h.rank) for h in entry.hypotheses],
        references=entry.references,
    )
    if entry.source is not None:
        message.source = entry.source
    return message


def ranked_lists(result: pb.Rescored) -> NBestList:
    """A response's ranked lists as an n-best list to write; ranks are the decoder's."""
    entries = [
        NBestEntry(
            ranked.id,
            [Hypothesis(h.text, dict(h.features), h.original_rank) for h in ranked.hypotheses],
        )
        for ranked in result.lists
    ]
    return NBestList(entries, "response")
