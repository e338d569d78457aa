"""The ``lmserve.v1.LMService`` servicer: check a request against the limits, run the engine (``rescoring``) in the
scoring thread pool, translate the result. Nothing here scores.

Every method (and the Admin service's, ``server.admin``) goes through :func:`LMServicer.handler`, which parses the
request bytes itself (so invalid UTF-8 is an ``INVALID_ARGUMENT`` naming the message, not an internal error) and
serialises the response itself (once: its size goes in the log line), maps
errors to status codes, and logs one JSON line per call (and counts it in the Prometheus metrics, when the server has
them). Sentence scores and the LM scores of lists go through the micro-batchers (``server.batching``), in chunks
(sentences, lists) with the deadline checked between them, so a call whose deadline passed or whose client went away
stops within one chunk instead of scoring to the end.

The model set is read once per call (``self.models``): a reload swaps the attribute, and a call goes on with the
models it started with. The servicer remembers the bundle fingerprints of the models it served before, so that a
decoder state of a model since reloaded with another bundle is refused as such (FAILED_PRECONDITION: restart the
sentence), not as a stranger's.

Decoder steps: ScoreNextWordsBatch and each request of a StreamNextWords stream go through the ``steps`` batcher,
so that the beam steps of concurrent decoders run as one LSTM step; states travel as tokens, or stay in the state
cache (``server.state_cache``) and travel as ids.

Bounds: the work of a call is bounded before it is done. A step's words (items x candidates) are at most
``limits.max_step_words``, its answer's estimated size at most ``limits.max_message_bytes`` and the states it would
keep at most the state cache's size; an answer that still comes out larger is refused (RESOURCE_EXHAUSTED) instead of
failing in the transport after the work, logged as what it was. Calls of our services beyond
``server.max_concurrent_calls`` are refused here, logged and counted, and health checks never are (the limit is ours,
not gRPC's); ``on_saturation`` hears when the limit is reached and left (the server's readiness).

Status codes: a ``RequestError`` (``server.errors``) carries its own; unknown models and profiles are NOT_FOUND, a
state token the model cannot continue from INVALID_ARGUMENT (``decoder_state.StateError``). Any other exception is a
fault of ours, whatever its type: INTERNAL, logged with its traceback.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor

import grpc
from google.protobuf.message import DecodeError

from lmserve.core.words import words as words_of
from lmserve.rescoring import decoder_state, lmscores
from lmserve.rescoring.context import states_after
from lmserve.rescoring.decoder_state import OtherModelState, StateError
from lmserve.rescoring.features import check_features, parse_definition
from lmserve.rescoring.interpolated import NextWord, Step
from lmserve.rescoring.nbest import Hypothesis, NBestEntry, NBestList
from lmserve.rescoring.nbest.checks import check_ids
from lmserve.rescoring.rescore import Setup, references_of, report, reranked
from lmserve.rescoring.scorer import BOS
from lmserve.server import messages
from lmserve.server.batching import Batcher, Budget, Expired
from lmserve.server.config import Batching, Limits, StateCacheSettings
from lmserve.server.errors import RequestError, invalid, request_checks, too_many
from lmserve.server.logs import LOGGER
from lmserve.server.metrics import Metrics
from lmserve.server.models import ModelSet, ServedModel, UnknownModel
from lmserve.server.state_cache import StateCache, StateIdError
from lmserve.v1 import lmserve_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["LMService"]
SENTENCES_PER_CHUNK = 256  # a chunk keeps the scorer's batches full and stops a cancelled call within ~0.1 s
LISTS_PER_CHUNK = 16
DEFAULT_BOOTSTRAP_SAMPLES = 1000
MAX_BOOTSTRAP_SAMPLES = 10000
# a NextWord on the wire beyond its word and state: tags, lengths, four doubles, the oov flag, the item's framing
WORD_BYTES = 48
STATE_ID_BYTES = 24  # a state id and its framing (``state_cache``: a tag and a counter)
WORD_OBJECT_BYTES = 512  # a scored word on its way to the answer: the engine's NextWord and its message
CONTEXT_BYTES = 32  # a cached state's n-gram context in a token, about (its words are not looked up to estimate)

log = logging.getLogger(LOGGER)


def score_sentences(model: ServedModel, sentences: list[str]) -> list:
    return model.lm.score(sentences)


def score_steps(model: ServedModel, steps: list[Step]) -> list[list[NextWord]]:
    return model.lm.next_words_batch(steps)


def score_lists(
    model: ServedModel, lists: list[tuple[list[str], float | None, tuple[str, ...]]]
) -> list[lmscores.LMSums]:
    """The LM features of every hypothesis of each (texts, λ, context) list: one engine call for all the lists, and
    their sums over tokens (interp at the list's λ) taken here, for all the lists at once, so that what comes back
    from a scoring process is a few short arrays a list and the server process reranks without touching token
    scores. Lists with a document context (``rescoring.context.states_after``) are scored apart from those without,
    so that a list's scores never depend on which other calls' lists share its batch."""
    lms = model.lms
    rows: list = [None] * len(lists)
    for in_context in (False, True):
        group = [i for i, (_, _, context) in enumerate(lists) if bool(context) == in_context]
        if not group:
            continue
        nbest = NBestList([NBestEntry("", [Hypothesis(text) for text in lists[i][0]]) for i in group])
        start = functools.partial(states_after, contexts=[lists[i][2] for i in group]) if in_context else None
        scored = lmscores.compute(nbest, lms.scorer, lms.ngram, lms.normalizer, start=start)
        for i, row in zip(group, scored, strict=True):
            rows[i] = row
    return lmscores.summed(rows, [lam for _, lam, _ in lists])


class LMServicer:
    def __init__(
        self,
        models: ModelSet,
        limits: Limits,
        pool: Executor,
        workers: int,
        batching: Batching,
        metrics: Metrics | None = None,
        engine: Executor | None = None,
        state_cache: StateCacheSettings | None = None,
        max_calls: int | None = None,
    ):
        """``pool``: threads for the work of single calls (next-word steps, reranking with a bootstrap);
        ``engine``: where the batchers' scorer calls run (``server.engine``), by default the same threads;
        ``workers``: how many run at once; ``state_cache``: its settings (None or max_mb 0: no cache);
        ``max_calls``: calls of ours in flight at once (``server.max_concurrent_calls``; None: no limit)."""
        self.retired: dict[str, dict[str, int]] = {}  # model name -> fingerprint (hex, 8 bytes) -> last generation
        self.models = models
        self.limits = limits
        self.pool = pool
        self.metrics = metrics
        slots = asyncio.Semaphore(workers)
        max_wait = batching.max_wait_ms / 1000

        def batcher(kind: str, run: Callable) -> Batcher:
            return Batcher(
                kind,
                run,
                engine or pool,
                slots,
                workers,
                batching.max_batch_tokens,
                max_wait,
                merge=batching.enabled,
                metrics=metrics,
            )

        self.sentence_batcher = batcher("sentences", score_sentences)
        self.list_batcher = batcher("lists", score_lists)
        self.step_batcher = batcher("steps", score_steps)
        self.step_budget = Budget(limits.steps_in_flight_mb * 2**20)
        self.state_cache = None
        self.cache_reported: dict[str, int] = {}  # the cache's drop counts as the metrics have them
        if state_cache is not None and state_cache.max_mb > 0:
            self.state_cache = StateCache(int(state_cache.max_mb * 2**20), state_cache.ttl_seconds)
        self.active = 0  # calls being handled; a drain waits for them, not for health watches or reflection
        self.max_calls = max_calls
        self.saturated = False  # max_calls in flight: the next call is refused
        self.on_saturation: Callable[[bool], None] | None = None  # told when ``saturated`` changes (readiness)
        self.stopping = False  # set by the server's shutdown: failures of calls cut short then are no bugs
        self.idle = asyncio.Event()
        self.idle.set()

    @property
    def models(self) -> ModelSet:
        return self._models

    @models.setter
    def models(self, models: ModelSet) -> None:
        """Swap the model set (a reload), remembering the fingerprints of the models it replaces."""
        old = getattr(self, "_models", None)
        if old is not None:
            for name, model in old.models.items():
                self.retired.setdefault(name, {})[model.lm.fingerprint[:8].hex()] = old.generation
        self._models = models

    def generic_handler(self, service=SERVICE, target: object = None) -> grpc.GenericRpcHandler:
        """Every method of ``service`` (implemented by ``target``, by default this servicer), each taking the request
        and giving the response as bytes (see the module docstring)."""
        target = self if target is None else target
        handlers = {}
        for method in service.methods:
            request_class = getattr(pb, method.input_type.name)
            if method.client_streaming and method.server_streaming:
                handlers[method.name] = grpc.stream_stream_rpc_method_handler(
                    self.stream_handler(method.name, request_class, getattr(target, method.name)),
                    request_deserializer=None,
                    response_serializer=None,
                )
                continue
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                self.handler(method.name, request_class, getattr(target, method.name)),
                request_deserializer=None,
                response_serializer=None,
            )
        return grpc.method_handlers_generic_handler(service.full_name, handlers)

    def handler(self, name: str, request_class, behaviour: Callable):
        """``behaviour(request, context, fields)`` answers the call; it may add log fields (``tokens`` scored)."""

        async def call(raw: bytes, context: grpc.aio.ServicerContext):
            start = time.perf_counter()
            fields = {"method": name, "peer": context.peer(), "request_bytes": len(raw)}
            refused = self.enter(fields, start)
            if refused is not None:
                await context.abort(refused.code, refused.message)
            log.debug("call started", extra={"fields": fields})
            try:
                try:
                    request = request_class.FromString(raw)
                except DecodeError as e:
                    raise invalid(
                        f"not a valid {request_class.DESCRIPTOR.full_name} ({e}); text fields must be valid UTF-8"
                    ) from None
                if "model" in request.DESCRIPTOR.fields_by_name:
                    fields["model"] = request.model or self.models.default
                response = await behaviour(request, context, fields)
            except asyncio.CancelledError:
                self.done(fields, "CANCELLED", start)
                raise
            except Exception as e:
                error = self.request_error(e, name, fields)
            else:
                data = response if isinstance(response, bytes) else response.SerializeToString()
                fields["response_bytes"] = len(data)
                error = self.oversized(len(data))
                if error is None:
                    self.done(fields, "OK", start)
                    return data
            self.done(fields, error.code.name, start, error=error.message)
            await context.abort(error.code, error.message)

        return call

    def enter(self, fields: dict, start: float) -> RequestError | None:
        """Count a call in, or refuse it (RESOURCE_EXHAUSTED, logged and counted) when ``max_calls`` are in flight.
        No await between the check and the count: calls that arrive together cannot all pass."""
        if self.max_calls is not None and self.active >= self.max_calls:
            return self.refuse(fields["method"], fields["peer"], start)
        self.active += 1
        self.idle.clear()
        if self.metrics:
            self.metrics.in_flight.inc()
        self.check_saturation()
        return None

    def refuse(self, method: str, peer: str, start: float | None = None) -> RequestError:
        """The refusal of a call beyond ``max_calls``: one ``call refused`` log line (a warning: the server is full)
        and its counts in the metrics. Also the servicer's interceptor's (``server.app``), before the request is
        read."""
        error = RequestError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"calls in flight: {self.active}, at most {self.max_calls} (server.max_concurrent_calls); retry after a "
            "backoff, or call another replica",
        )
        seconds = 0.0 if start is None else time.perf_counter() - start
        fields = {"method": method, "peer": peer, "code": error.code.name, "limit": "server.max_concurrent_calls"}
        fields |= {"in_flight": self.active, "ms": round(seconds * 1000, 3), "error": error.message}
        log.warning("call refused", extra={"fields": fields})
        if self.metrics:
            self.metrics.refused.labels("server.max_concurrent_calls").inc()
            self.metrics.observe(method, error.code.name, seconds, None, 0)
        return error

    def check_saturation(self) -> None:
        saturated = self.max_calls is not None and self.active >= self.max_calls
        if saturated != self.saturated:
            self.saturated = saturated
            log.info("saturated" if saturated else "unsaturated", extra={"fields": {"in_flight": self.active}})
            if self.on_saturation is not None:
                self.on_saturation(saturated)

    def oversized(self, size: int) -> RequestError | None:
        """An answer over ``limits.max_message_bytes``, which gRPC would fail in the transport (after all the work,
        with a message that names no limit), as a refusal the client can act on."""
        limit = self.limits.max_message_bytes
        if size <= limit:
            return None
        return RequestError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"the answer: {size} bytes, more than {limit} (limits.max_message_bytes); ask for less in one call "
            "(fewer sentences, lists, items or candidates; no per-token scores or state tokens)",
        )

    def request_error(self, e: Exception, name: str, fields: dict) -> RequestError:
        """The status code and message a failed call ends with."""
        if isinstance(e, RequestError):
            return e
        if isinstance(e, UnknownModel):
            return RequestError(grpc.StatusCode.NOT_FOUND, str(e.args[0]))
        if isinstance(e, Expired):
            return RequestError(grpc.StatusCode.DEADLINE_EXCEEDED, str(e))
        if isinstance(e, StateError):  # a state token the model cannot continue from: the client's (it names it)
            return invalid(str(e))
        if self.stopping:  # the scoring pool was shut down under a call past the grace period: no bug
            return RequestError(grpc.StatusCode.UNAVAILABLE, f"{name}: the server is stopping ({e})")
        log.exception("internal error", extra={"fields": fields}, exc_info=e)
        return RequestError(grpc.StatusCode.INTERNAL, f"{name}: internal error (the server log has details)")

    async def until_idle(self, requests, fields: dict):
        """A stream's requests, as long as each comes within ``limits.stream_idle_s`` of the last answer: a decoder
        that went away without closing its stream (hung, or its host gone) would otherwise hold one of the
        ``max_concurrent_calls`` slots for good."""
        idle = self.limits.stream_idle_s
        while True:
            try:
                raw = await asyncio.wait_for(anext(requests), idle)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise RequestError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"request {fields['steps']}: none within {idle:g} s of the last answer (limits.stream_idle_s): "
                    "the stream is closed; open a new one",
                ) from None
            yield raw

    def stream_handler(self, name: str, request_class, behaviour: Callable):
        """A bidirectional stream: each request is answered by ``behaviour(request, context, fields)`` in turn, in
        order. One log line (and one count in the metrics) per stream, with its steps and tokens; each step's latency
        and tokens go into the metrics as it is answered. An error ends the stream with its status code, as it would
        end a unary call."""

        async def call(requests, context: grpc.aio.ServicerContext):
            start = time.perf_counter()
            fields = {"method": name, "peer": context.peer(), "request_bytes": 0, "response_bytes": 0, "steps": 0}
            fields["tokens"] = fields["unknown"] = 0
            refused = self.enter(fields, start)
            if refused is not None:  # (before reading a request)
                await context.abort(refused.code, refused.message)
            log.debug("stream started", extra={"fields": fields})
            error = None
            try:
                try:
                    async for raw in self.until_idle(requests, fields):
                        received = time.perf_counter()
                        fields["request_bytes"] += len(raw)
                        try:
                            request = request_class.FromString(raw)
                        except DecodeError as e:
                            raise invalid(
                                f"request {fields['steps']}: not a valid {request_class.DESCRIPTOR.full_name} "
                                f"({e}); text fields must be valid UTF-8"
                            ) from None
                        del raw  # (the parsed request holds what is needed while the step waits its turn)
                        fields["model"] = request.model or self.models.default
                        step = {}
                        response = await behaviour(request, context, step)
                        data = response if isinstance(response, bytes) else response.SerializeToString()
                        oversized = self.oversized(len(data))
                        if oversized is not None:
                            raise RequestError(oversized.code, f"request {fields['steps']}: {oversized.message}")
                        fields["steps"] += 1
                        fields["tokens"] += step.get("tokens", 0)
                        fields["unknown"] += step.get("unknown", 0)
                        fields["response_bytes"] += len(data)
                        if self.metrics:
                            self.metrics.observe_step(
                                name,
                                fields["model"],
                                time.perf_counter() - received,
                                step.get("tokens", 0),
                                step.get("unknown", 0),
                            )
                        yield data
                except Exception as e:
                    error = self.request_error(e, name, fields)
            except BaseException:  # cancelled, or closed (GeneratorExit) when the client went away mid-stream
                self.done(fields, "CANCELLED", start, steps_counted=True)
                raise
            if error is None:
                self.done(fields, "OK", start, steps_counted=True)
                return
            self.done(fields, error.code.name, start, steps_counted=True, error=error.message)
            await context.abort(error.code, error.message)

        return call

    def done(self, fields: dict, code: str, start: float, steps_counted: bool = False, **more) -> None:
        """One log line per call, and its metrics (``steps_counted``: a stream's tokens, counted step by step)."""
        seconds = time.perf_counter() - start
        level = (
            logging.INFO if code in ("OK", "INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED") else logging.WARNING
        )
        log.log(level, "call", extra={"fields": {**fields, "code": code, "ms": round(seconds * 1000, 3), **more}})
        self.active -= 1
        if not self.active:
            self.idle.set()
        self.check_saturation()
        if self.metrics:
            self.metrics.in_flight.dec()
            tokens, unknown = (0, 0) if steps_counted else (fields.get("tokens", 0), fields.get("unknown", 0))
            self.metrics.observe(fields["method"], code, seconds, fields.get("model"), tokens, unknown)

    async def run(self, context: grpc.aio.ServicerContext, fn: Callable, *args):
        """``fn(*args)`` in the scoring pool, unless the deadline has already passed; the event loop stays free."""
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED, "the deadline passed before the work was done")
        return await asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, *args))

    async def batched(
        self, context, batcher: Batcher, model: ServedModel, items: Sequence, tokens: Sequence[int], size: int
    ) -> list:
        """The batcher's results for ``items`` (``tokens`` each), submitted ``size`` at a time, the deadline checked
        before each."""
        out = []
        for start in range(0, len(items), size):
            remaining = context.time_remaining()
            if remaining is not None and remaining <= 0:
                raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED, "the deadline passed before the work was done")
            chunk = slice(start, start + size)
            out.extend(await batcher.submit(model, items[chunk], sum(tokens[chunk]), remaining))
        return out

    # -- checks ------------------------------------------------------------------------------------------------

    def check_words(self, texts: Sequence[str], where: Callable[[int], str]) -> list[int]:
        """Tokens (words and ``</s>``) of each text, as far as the limits and batch sizes are concerned."""
        limit = self.limits.max_words
        tokens = []
        for i, text in enumerate(texts):
            words = len(words_of(text))
            if words > limit:
                raise too_many(f"{where(i)}: words", words, limit, "shorten or split the sentence", "limits.max_words")
            tokens.append(words + 1)
        return tokens

    # -- RPCs --------------------------------------------------------------------------------------------------

    async def ScoreSentences(self, request: pb.ScoreSentencesRequest, context, fields) -> pb.ScoreSentencesResponse:
        model = self.models.get(request.model)
        sentences = list(request.sentences)
        if not sentences:
            raise invalid("sentences: empty; give at least one sentence (an empty string scores </s> alone)")
        if len(sentences) > self.limits.max_sentences:
            raise too_many("sentences", len(sentences), self.limits.max_sentences, key="limits.max_sentences")
        tokens = self.check_words(sentences, lambda i: f"sentences[{i}]")
        scores = await self.batched(context, self.sentence_batcher, model, sentences, tokens, SENTENCES_PER_CHUNK)
        fields["tokens"] = sum(len(s.neural) for s in scores)
        fields["unknown"] = sum(s.oov for s in scores)
        return pb.ScoreSentencesResponse(
            model=model.name,
            normalisation=messages.normalisation(model),
            sentences=[messages.sentence_score(s, request.per_token) for s in scores],
        )

    async def ScoreNextWords(self, request: pb.ScoreNextWordsRequest, context, fields) -> pb.ScoreNextWordsResponse:
        model = self.models.get(request.model)
        modes = sum([bool(request.candidates), request.top_k > 0, request.all_words])
        if modes != 1:
            raise invalid("give exactly one of candidates, top_k or all_words")
        limit = self.limits.max_candidates
        if len(request.candidates) > limit:
            advice = "ask in several calls with the same state"
            raise too_many("candidates", len(request.candidates), limit, advice, "limits.max_candidates")
        if request.top_k > limit:
            raise too_many("top_k", request.top_k, limit, "ask for fewer words", "limits.max_candidates")
        candidates = list(request.candidates) or None
        if candidates is not None:
            with request_checks():
                model.lm.check_candidates(candidates)
        elif model.lm.scorer.pieces is not None:
            raise invalid("candidates: an open-vocabulary (subword) model has no word list; name the candidates")
        try:
            words = await self.run(
                context, model.lm.next_words, request.state, candidates, request.top_k, not request.all_words
            )
        except OtherModelState as e:
            raise self.other_model_state(model, e, e.fingerprint) from None
        fields["tokens"] = len(words)
        fields["unknown"] = sum(word.oov for word in words)
        response = pb.ScoreNextWordsResponse(model=model.name, normalisation=messages.normalisation(model))
        for word in words:
            messages.add_next_word(response.words.add, word)
        return response

    async def ScoreNextWordsBatch(self, request: pb.ScoreNextWordsBatchRequest, context, fields) -> bytes:
        return await self.next_words_step(request, context, fields)

    async def StreamNextWords(self, request: pb.ScoreNextWordsBatchRequest, context, fields) -> bytes:
        """One request of the stream (``stream_handler`` runs the stream)."""
        return await self.next_words_step(request, context, fields)

    async def next_words_step(self, request: pb.ScoreNextWordsBatchRequest, context, fields) -> bytes:
        """One beam step: the items checked, cached states looked up, the work bounded (:meth:`step_work`),
        its memory taken from the steps' budget (``limits.steps_in_flight_mb``: waiting its turn when the steps of
        other calls hold it) until its answer is serialised, all items scored in one engine call (merged with
        concurrent callers' steps by the ``steps`` batcher, which counts a step's words), new states cached when
        asked. Returns the answer's bytes."""
        model = self.models.get(request.model)
        items, cache = list(request.items), self.state_cache  # (each pass over the repeated field wraps every item)
        if not items:
            raise invalid("items: empty; give at least one item (a state and its candidates)")
        if len(items) > self.limits.max_items:
            raise too_many("items", len(items), self.limits.max_items, key="limits.max_items")
        if request.cache_states and request.scores_only:
            raise invalid("cache_states and scores_only: give at most one (scores_only returns no states)")
        named = any(item.state_id for item in items)  # states of the cache
        if (request.cache_states or named) and cache is None:
            raise RequestError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this server has no state cache ([state_cache] max_mb = 0): send and receive state tokens",
            )
        if cache is not None and request.release_state_ids:
            cache.release(request.release_state_ids)
        mode = "none" if request.scores_only else "objects" if request.cache_states else "tokens"
        words, memory = self.step_work(items, model, mode)
        async with self.step_budget.hold(memory):  # (a step waiting here holds its request, not more)
            candidates = [list(item.candidates) for item in items]
            # the usual step (state tokens within the limits): nothing to look up or refuse item by item
            if max(map(len, candidates)) <= self.limits.max_candidates and not named:
                steps = [Step(item.state, words, mode) for item, words in zip(items, candidates, strict=True)]
            else:
                steps = self.cached_steps(items, candidates, model, mode)
            check_candidates(candidates, model)
            return await self.scored_step(model, steps, words, context, fields)

    async def scored_step(self, model: ServedModel, steps: list[Step], words: int, context, fields) -> bytes:
        """The checked step scored (``words`` candidates in all) and answered, new states cached."""
        cache = self.state_cache
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED, "the deadline passed before the work was done")
        try:
            results = await self.step_batcher.submit(model, steps, words, remaining)
        except OtherModelState as e:
            raise self.other_model_state(model, e, e.fingerprint) from None
        response = pb.ScoreNextWordsBatchResponse(model=model.name, normalisation=messages.normalisation(model))
        for scored in results:
            add = response.items.add().words.add
            for word in scored:
                message = messages.add_next_word(add, word)
                if word.after is not None:
                    message.state_id = cache.put(model.name, model.lm.fingerprint, word.after)
        fields["tokens"] = sum(len(words) for words in results)
        fields["unknown"] = sum(word.oov for words in results for word in words)
        fields["items"] = len(steps)
        if cache is not None and self.metrics:
            self.metrics.state_cache_bytes.set(cache.bytes)
            self.metrics.state_cache_states.set(len(cache))
            for reason in ("evicted", "expired"):
                count = getattr(cache, reason)
                self.metrics.state_cache_removed.labels(reason).inc(count - self.cache_reported.get(reason, 0))
                self.cache_reported[reason] = count
        return response.SerializeToString()

    def step_work(self, items: list, model: ServedModel, mode: str) -> tuple[int, int]:
        """A step's words (items x candidates), refused up front when over ``limits.max_step_words``, when its answer
        would be over ``limits.max_message_bytes`` (state tokens are most of it), or when it would keep more states
        than the whole state cache holds. Returns the words and the memory the step will hold until it is answered,
        estimated: the engine's words and their messages, the answer three times (the engine's tokens, the message,
        its bytes), the states it makes to keep. Read off the request's items, keeping nothing."""
        counts = [len(item.candidates) for item in items]
        words, limit = sum(counts), self.limits.max_step_words
        if words > limit:
            advice = "split the step into several requests"
            raise too_many("words to score (all items' candidates)", words, limit, advice, "limits.max_step_words")
        start = model.lm.start_state()
        answer = WORD_BYTES * words + sum(len(word) for item in items for word in item.candidates)
        kept = 0
        if mode == "tokens":  # each word's state: as long as its item's (the context moves on by one word)
            fixed = len(decoder_state.encode(start, model.lm.fingerprint))
            for item, count in zip(items, counts, strict=True):
                size = fixed + CONTEXT_BYTES if item.state_id else len(item.state)
                answer += count * max(size, fixed)
        elif mode == "objects":
            answer += STATE_ID_BYTES * words
            kept = words * StateCache.size_of(start)
            if kept > self.state_cache.max_bytes:
                raise RequestError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"cache_states: {words} new states of about {StateCache.size_of(start)} bytes each, more than "
                    f"the whole state cache ({self.state_cache.max_bytes} bytes: state_cache.max_mb); split the step, "
                    "or send state tokens",
                )
        if answer > self.limits.max_message_bytes:
            what = {"tokens": "with a state token each", "objects": "with a state id each"}.get(mode, "scores only")
            raise RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the answer: about {answer} bytes for {words} words {what}, more than "
                f"{self.limits.max_message_bytes} (limits.max_message_bytes); split the step into several requests, "
                "or keep the states on the server (cache_states) or ask for scores_only",
            )
        return words, WORD_OBJECT_BYTES * words + 3 * answer + kept

    def cached_steps(self, items: list, candidates: list[list[str]], model: ServedModel, mode: str) -> list[Step]:
        """The steps of a request that names cached states or breaks a limit, item by item in turn, so that an error
        names the first bad item."""
        limit, cache, steps = self.limits.max_candidates, self.state_cache, []
        for i, (item, words) in enumerate(zip(items, candidates, strict=True)):
            if len(words) > limit:
                raise too_many(f"items[{i}].candidates", len(words), limit, "split the item", "limits.max_candidates")
            state = item.state  # (each read of a bytes field copies it)
            if state and item.state_id:
                raise invalid(f"items[{i}]: give state or state_id, not both")
            if item.state_id:
                try:
                    entry = cache.get(item.state_id)
                except StateIdError as e:
                    raise RequestError(grpc.StatusCode.NOT_FOUND, f"items[{i}].{e}") from None
                if entry.model != model.name:
                    raise invalid(
                        f"items[{i}].state_id {item.state_id!r}: a state of model {entry.model!r}, this call names "
                        f"{model.name!r}; continue a sentence with the model that started it"
                    )
                if entry.fingerprint != model.lm.fingerprint:
                    raise self.other_model_state(model, None, entry.fingerprint[:8].hex(), f"items[{i}].state_id")
                state = entry.state
            steps.append(Step(state, words, mode))
        return steps

    def other_model_state(
        self, model: ServedModel, error: OtherModelState | None, fingerprint: str, where: str = ""
    ) -> RequestError:
        """A state that ``model`` cannot continue from because another bundle made it: FAILED_PRECONDITION when it
        is a state of this model before a reload changed its bundle, else INVALID_ARGUMENT (another model's)."""
        generation = self.retired.get(model.name, {}).get(fingerprint)
        if generation is not None:
            where = where or (str(error).split(":", 1)[0] if error is not None else "state")
            return RequestError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{where}: a state of model {model.name!r} as served before a reload (generation {generation}, "
                f"fingerprint {fingerprint}); the model's bundle has changed since (fingerprint "
                f"{model.lm.fingerprint[:8].hex()}), so the state cannot continue: restart the sentence",
            )
        if error is not None:
            return invalid(str(error))
        return invalid(f"{where}: made by another model (fingerprint {fingerprint})")

    async def RescoreNBest(self, request: pb.RescoreNBestRequest, context, fields) -> pb.RescoreNBestResponse:
        return pb.RescoreNBestResponse(result=await self.rescore(request, context, fields, "wer"))

    async def RescoreKBest(self, request: pb.RescoreKBestRequest, context, fields) -> pb.RescoreKBestResponse:
        return pb.RescoreKBestResponse(result=await self.rescore(request, context, fields, "bleu"))

    async def ListModels(self, request: pb.ListModelsRequest, context, fields) -> pb.ListModelsResponse:
        models = self.models
        return pb.ListModelsResponse(
            models=[messages.model_info(m, with_manifest=False) for m in models.models.values()],
            default_model=models.default,
            generation=models.generation,
        )

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context, fields) -> pb.GetModelInfoResponse:
        return pb.GetModelInfoResponse(model=messages.model_info(self.models.get(request.model), with_manifest=True))

    # -- rescoring ---------------------------------------------------------------------------------------------

    async def rescore(self, request, context, fields: dict, metric: str) -> pb.Rescored:
        model = self.models.get(request.model)
        if not request.lists:
            raise invalid("lists: empty; give at least one hypothesis list")
        if len(request.lists) > self.limits.max_lists:
            raise too_many("lists", len(request.lists), self.limits.max_lists, key="limits.max_lists")
        hypotheses = sum(len(x.hypotheses) for x in request.lists)
        if hypotheses > self.limits.max_hypotheses:
            raise too_many(
                "hypotheses (all lists)", hypotheses, self.limits.max_hypotheses, key="limits.max_hypotheses"
            )
        samples = request.bootstrap_samples or DEFAULT_BOOTSTRAP_SAMPLES
        if samples > MAX_BOOTSTRAP_SAMPLES:
            raise too_many("bootstrap_samples", samples, MAX_BOOTSTRAP_SAMPLES, "ask for fewer")
        with request_checks():  # as lm-rescore does
            check_ids((message.id, f"lists[{i}]") for i, message in enumerate(request.lists))
        contexts = [tuple(message.context) for message in request.lists]
        if any(contexts) and model.lms.scorer is None:
            first = next(i for i, c in enumerate(contexts) if c)
            raise invalid(f"lists[{first}].context: model {model.name!r} has no neural LM to read a document context")
        context_sentences = sum(map(len, contexts))
        if context_sentences > self.limits.max_sentences:
            limit = self.limits.max_sentences
            advice = "send the last few utterances of each document"
            raise too_many("context sentences (all lists)", context_sentences, limit, advice, "limits.max_sentences")
        entries, tokens = [], []
        for i, message in enumerate(request.lists):
            where = f"lists[{i}] (id {message.id!r})"
            if not message.hypotheses:
                raise invalid(f"{where}: no hypotheses")
            texts = [h.text for h in message.hypotheses]
            tokens.append(sum(self.check_words(texts, lambda k, where=where: f"{where}.hypotheses[{k}]")))
            tokens[-1] += sum(self.check_words(contexts[i], lambda k, where=where: f"{where}.context[{k}]"))
            entries.append(messages.nbest_entry(message, f"lists[{i}]"))
        with_refs = [bool(e.references) for e in entries]
        if any(with_refs) and not all(with_refs):
            missing = with_refs.index(False)
            raise invalid(f"lists[{missing}] has no references but others do: give references for every list or none")
        nbest = NBestList(entries, "lists")
        setup, profile = self.combination(model, request.combination)
        with request_checks():
            check_features(nbest, setup.features, setup.definitions, setup.lam, True)
            if all(with_refs):
                references_of(nbest, metric)  # the evaluation's (WER: one reference a list)

        work = [([h.text for h in e.hypotheses], setup.lam, ctx) for e, ctx in zip(entries, contexts, strict=True)]
        scores = await self.batched(context, self.list_batcher, model, work, tokens, LISTS_PER_CHUNK)
        fields["tokens"] = sum(int(s.tokens.sum()) for s in scores)
        fields["unknown"] = sum(int(s.oov.sum()) for s in scores)

        def finish() -> pb.Rescored:
            ranked, chosen = reranked(nbest, setup, scores)
            result = pb.Rescored(
                model=model.name,
                profile=profile,
                weights=messages.feature_weights(setup),
                interpolation_weight=setup.lam or 0.0,
                lists=[messages.ranked_list(e) for e in ranked],
            )
            if all(with_refs):
                result.evaluation.CopyFrom(messages.evaluation(report(nbest, chosen, metric, samples)))
            return result

        if any(with_refs):  # a bootstrap evaluation takes tens of milliseconds: keep the event loop free
            return await self.run(context, finish)
        return finish()

    def combination(self, model: ServedModel, combination: pb.Combination) -> tuple[Setup, str]:
        """The setup a request asks for: a profile of the model, or inline weights (with definitions and λ)."""
        if combination.profile:
            if combination.weights or combination.definitions or combination.interpolation_weight:
                raise invalid(
                    "combination: a profile carries its own weights, definitions and λ; give a profile or weights"
                )
            return model.profile(combination.profile).setup, combination.profile
        if not combination.weights:
            raise invalid(
                f"combination: give a profile (model {model.name!r} has {sorted(model.profiles) or 'none'}) "
                "or weights by feature name"
            )
        for name, weight in combination.weights.items():
            if not math.isfinite(weight):
                raise invalid(f"combination.weights[{name!r}] = {weight}: expected a finite number")
        with request_checks():
            definitions = dict(parse_definition(d) for d in combination.definitions)
        uses_interp = "interp" in combination.weights or any("interp" in d for d in definitions.values())
        lam = (combination.interpolation_weight or model.lm.lam) if uses_interp else None
        if lam is not None and not 0.0 < lam < 1.0:
            raise invalid(f"combination.interpolation_weight = {lam}: expected a value in (0, 1)")
        # a map has no order on the wire: sorted, so that the same request gets the same answer from any replica
        return Setup(sorted(combination.weights), definitions, lam, dict(combination.weights)), ""


def check_candidates(candidates: list[list[str]], model: ServedModel) -> None:
    """A step's candidates checked as the engine checks them, before the engine has them: so that a ValueError from
    the engine's work is ours, not the client's. The engine's own quick test of a whole batch first; only a batch
    that fails it is checked item by item, for the message that names the bad one."""
    flat = [word for words in candidates for word in words]
    if all(candidates) and " ".join(flat).split() == flat and model.lm.scorer.bundle.tokens[BOS] not in flat:
        return
    with request_checks():
        for i, words in enumerate(candidates):
            model.lm.check_candidates(words, f"items[{i}].candidates")
