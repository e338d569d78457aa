"""What a decoder asks of a language model, batched: the score of a word after a state, for every (state, word) pair of
a beam step at once, from a local bundle or from lm-serve.

    lm = DecoderLM.local("var/bundles/english_lm", ngram="var/ngrams/english_4gram.bin", lam=0.4)
    lm = DecoderLM.remote("127.0.0.1:50051", model="english")        # one StreamNextWords stream, state tokens
    start = lm.start()
    (score, state), (score2, state2) = lm.score_many([(start, "THE", False), (start, "A", False)])
    final_score, final = lm.score_many([(state, "CAT", True)])[0]    # True: the utterance ends here (adds </s>)
    final.logprob, final.neural                                      # summed along the path, </s> included

:class:`LMState` objects are immutable paths: each knows its parent, the tokens that led to it and the summed scores
(``logprob``: what the decoder fuses, interpolated with the n-gram when the model has one, else neural; ``neural``:
the neural LM alone, which ``lm-rescore score`` reports). A state memoises the words scored after it, so a decoder
that asks twice (flashlight does, pyctcdecode's own cache aside) costs one LM step.

How a step is batched: the pairs not yet memoised are grouped by state; each state becomes one item whose candidates
are the first tokens of its words; one backend call scores all items (one LSTM step locally, one ScoreNextWordsBatch
or stream request remotely). Words that normalise to several tokens take further rounds, one token deeper each.
Locally, a word-level bundle keeps its states in arrays (:class:`LocalState`: views of the LSTM state of the step
that made them, and the KenLM state after the path; no tokens, contexts or copies), and with a vocabulary of at most
``FULL_VOCABULARY`` words each state is stepped once, through the ``step_full`` graph, keeping every next word's
score: a word asked after it later (another beam, another frame, flashlight's next callback) is a lookup.

Faults. A remote backend turns a failed call into :class:`LMServeError` naming the address, the status code and the
server's message; a call or a stream step unanswered within ``timeout`` (30 s; a hung server) is DEADLINE_EXCEEDED.
With ``fallback_ngram`` set, a server that cannot answer (UNAVAILABLE or DEADLINE_EXCEEDED, at construction too)
instead switches this object to that KenLM model alone, with one warning that says so; states made before continue
(the n-gram context is read off their paths), and ``neural`` is NaN. Every ``retry_server`` seconds after that, the
start of an utterance asks the server again: once it answers, utterances started from then on use it (with another
warning), while those under way finish on the n-gram (their states are of an earlier *epoch*).

Threads and forks. One remote object serves several threads: each thread steps on a stream of its own (one stream
answers in order, so threads sharing one would take each other's answers), and the results are those of one thread
alone. A forked child (a ``multiprocessing`` fork pool, pyctcdecode's ``decode_batch``) never touches its parent's
channel or streams, whose gRPC threads did not cross the fork: it connects anew at its first call.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
import weakref
from bisect import bisect_left
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import grpc
import numpy as np

from lmserve.core.textnorm import PRESETS, TextNormalizer

log = logging.getLogger("lmserve.decoders")
# the status codes of a server that cannot answer at all, which fallback_ngram stands in for
SERVER_DOWN = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
EOS = "</s>"
# A request's items, their words and the state tokens its answer may carry: under lm-serve's default limits
# (max_items 1024, max_candidates 1000, max_step_words 16384, 16 MiB messages), with room to spare.
MAX_ITEMS = 1024
MAX_CANDIDATES = 1000
MAX_STEP_WORDS = 16384
MAX_STATE_BYTES = 8 << 20
# LocalBackend keeps whole next-word distributions of states for vocabularies up to this size (128 kB a stepped
# state): the shipped 30k-word models (adaptive softmax) decode with them in 4.6x (flashlight) and 1.13x (pyctcdecode)
# less CPU than with the step graph per candidate (decode_speed on models/english_lm, 10 utterances)
FULL_VOCABULARY = 32768
# With whole distributions, a step of one state asked alone (DecoderLM.score: flashlight's callbacks) also steps up to
# this many of the states made most recently and not stepped yet (LocalBackend.step_fresh): the decoder asks after
# some of them a few frames later, one at a time, and one run's fixed cost is that of about ten rows (the demo model:
# 221 us one row, 497 us 16 rows). Most states made are pruned before they are asked, so wider is not better:
# flashlight, ms per utterance, none / 12 / 16 / 24 / 32: the demo model (30 utterances) 68.1 / 48.2 / 47.2 / 51.3 /
# 50.4; models/english_lm (10 utterances), none / 8 / 16: 292.6 / 240.1 / 226.1.
STEP_AHEAD = 16
# the highest word score of an exactly normalised model (log-probabilities, computed in float32): 0, and a margin
MAX_LOGPROB = 1e-3
LN10 = math.log(10)  # (KenLM's scores are log10)
LOG2 = math.log(2)


def logaddexp(x: float, y: float) -> float:
    """``numpy.logaddexp`` of two floats, its formula and libm's functions (the same result to the bit), without an
    array's cost."""
    if x == y:
        return x + LOG2
    if x > y:
        return x + math.log1p(math.exp(y - x))
    return y + math.log1p(math.exp(x - y))


class LMServeError(RuntimeError):
    """The LM behind a decoder could not answer; the message names the server and what it said. ``code``: the gRPC
    status code; ``unavailable``: the server could not answer at all (``SERVER_DOWN``), which a fallback stands in
    for."""

    code: grpc.StatusCode | None = None
    unavailable: bool = False


def server_error(target: str, error: grpc.RpcError) -> LMServeError:
    code = error.code()
    failure = LMServeError(f"lm-serve at {target}: {code.name}: {error.details()}")
    failure.code, failure.unavailable = code, code in SERVER_DOWN
    return failure


# objects that must forget their parent's connections in a forked child (os.register_at_fork, once)
_FORK_AWARE: weakref.WeakSet = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for thing in list(_FORK_AWARE):
        thing._after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


class Scored(NamedTuple):
    """One token's scores after a state, and the state after it (the backend's handle). A tuple: a decoder makes one
    per word it asks after a state, so it is made as cheaply as Python allows."""

    neural: float
    logprob: float
    oov: bool
    handle: object


@dataclass(eq=False, slots=True, weakref_slot=True)
class LMState:
    handle: object  # the backend's: a DecoderState (local), a token or a cache id (remote), an n-gram state
    parent: LMState | None = None
    token: str | None = None  # the model token read last (None at the start)
    neural: float = 0.0  # summed over the path
    logprob: float = 0.0
    oov: int = 0  # tokens scored as <unk>
    words: int = 0  # decoder words completed
    ended: bool = False  # </s> has been scored (the handle is that of the state before it)
    word_logprob: float = 0.0  # the score of the last word (and </s> when ended): what a decoder adds
    word_oov: bool = False  # a token of the last word was <unk>, or the model does not spell it as written
    word_tokens: int = 0  # the model tokens of the last word (0: punctuation only, or </s> alone)
    epoch: int = 0  # the decoder's epoch when the utterance started (a return to the server after a fallback is new)
    children: dict = field(default_factory=dict, repr=False)  # (word, end) -> LMState

    def forget_children(self) -> None:
        """Empty the memo (``children``) of this state and of every state after it, at the end of a search. A state
        and its parent refer to each other through it, so without this a finished search's tree is garbage that
        only Python's cycle collector frees, and the collector's walks over the trees of earlier utterances cost
        a tenth of a decode. The states a caller keeps keep their paths (``parent``); the branches that nothing
        holds are freed at once."""
        todo = [self]
        while todo:
            state = todo.pop()
            if state.children:
                todo.extend(state.children.values())
                state.children.clear()

    def history(self, limit: int | None = None) -> list[str]:
        """The model tokens of the path (at most the last ``limit``), oldest first."""
        out, state = [], self
        while state is not None and state.token is not None and (limit is None or len(out) < limit):
            if state.token != EOS:
                out.append(state.token)
            state = state.parent
        return out[::-1]


class DecoderLM:
    """See the module docstring; build with :meth:`local` or :meth:`remote`."""

    def __init__(
        self,
        backend,
        normalizer: TextNormalizer,
        fallback_ngram: str | Path | None = None,
        connect=None,
        retry_server: float | None = None,
    ):
        """``connect``: () -> (backend, normalizer), the server again (a remote object's way back after a fallback,
        tried every ``retry_server`` seconds)."""
        self.backend = backend
        self.normalizer = normalizer
        self.fallback_ngram = fallback_ngram
        self.connect = connect
        self.retry_server = retry_server
        self.fell_back = False  # on the fallback n-gram now
        self.epoch = 0  # one more at each return to the server: earlier utterances' states stay on the n-gram
        self.calls = 0  # backend calls (one per beam step and token depth): the benchmarks report LM calls/s
        self.pairs = 0  # (state, word) pairs scored through them
        self._tokens: dict[str, tuple[str, ...]] = {}
        self._written: dict[str, bool] = {}  # as_written's answers
        self._vocabulary: list[str] | None = None
        self._prefixes: dict[str, bool] = {}  # is_prefix's answers
        self._ngram: NgramBackend | None = None
        self._retry_at = math.inf
        self._lock = threading.Lock()  # the backend, epoch and counts; held for no call
        _FORK_AWARE.add(self)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()  # (another thread of the parent may have held it at the fork)

    @classmethod
    def local(
        cls,
        bundle: str | Path,
        ngram: str | Path | None = None,
        lam: float | None = None,
        normalize: str | None = None,
        threads: int = 1,
    ) -> DecoderLM:
        """A bundle loaded here; with ``ngram`` (a KenLM model on the bundle's tokens) and ``lam`` the scores are
        their per-word interpolation, as lm-serve's with the same settings; ``normalize``: a ``textnorm`` preset
        instead of the bundle's own text settings."""
        from lmserve.rescoring.interpolated import InterpolatedLM
        from lmserve.rescoring.ngram import NgramLM
        from lmserve.rescoring.scorer import Scorer

        scorer = Scorer(bundle, threads=threads, normalizer=PRESETS[normalize] if normalize else None)
        scorer.check_forward("score a decoder's next words")
        lm = InterpolatedLM(scorer, NgramLM(ngram) if ngram else None, lam)
        return cls(LocalBackend(lm), scorer.normalizer)

    @classmethod
    def remote(
        cls,
        target: str,
        model: str = "",
        *,
        stream: bool = True,
        cache_states: bool = False,
        tls: bool = False,
        ca: str | Path | None = None,
        cert: str | Path | None = None,
        key: str | Path | None = None,
        timeout: float | None = 30.0,
        fallback_ngram: str | Path | None = None,
        retry_server: float | None = 60.0,
        normalize: str | None = None,
        max_step_words: int = MAX_STEP_WORDS,
    ) -> DecoderLM:
        """lm-serve at ``target`` (``HOST:PORT``), its ``model`` (empty: the default). ``stream``: a StreamNextWords
        stream for all steps, one per thread (else a ScoreNextWordsBatch call each); ``cache_states``: states stay
        in the server's state cache (ids travel, released when the decoder drops them; the server's cache must hold
        a beam's states); ``tls``/``ca``/``cert``/``key``: as ``LMServeClient``; ``timeout``: the deadline of each
        call and of each stream step, in seconds (None: none; a server that stops answering then blocks the decoder
        for good). ``fallback_ngram``, ``retry_server``: see the module docstring (None: never ask again);
        ``normalize``: the ``textnorm`` preset of the model's words while the server has not said (a fallback from
        construction on; else words are read as written): the server's own settings win once it answers.
        ``max_step_words``: the most words (all items' candidates) a request carries, the server's
        ``limits.max_step_words``: a beam step with more goes in several requests."""
        from lmserve.rescoring.client import LMServeClient, text_settings_json

        def connect() -> tuple[RemoteBackend, TextNormalizer]:
            client = LMServeClient(target, timeout=timeout, tls=tls, ca=ca, cert=cert, key=key)
            try:
                info = client.model_info(model)
            except grpc.RpcError as error:
                client.close()
                raise server_error(target, error) from None
            normalizer = TextNormalizer.from_dict(json.loads(text_settings_json(info)))
            backend = RemoteBackend(client, info, stream, cache_states, timeout, max_step_words)
            return backend, normalizer

        try:
            backend, normalizer = connect()
        except LMServeError as error:
            if fallback_ngram is None or not error.unavailable:
                raise
            lm = cls(None, PRESETS[normalize or "none"], fallback_ngram, connect, retry_server)  # (the n-gram, below)
            what = "this decoder's LM is the n-gram %s alone"
            if not normalize:
                what += ", its words read as written (no normalize= preset)"
            lm._switch_to_ngram(error, None, what)
            return lm
        return cls(backend, normalizer, fallback_ngram, connect, retry_server)

    def close(self) -> None:
        self.backend.close()

    def __enter__(self) -> DecoderLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- words -> model tokens ---------------------------------------------------------------------------------

    def tokens_of(self, word: str) -> tuple[str, ...]:
        """A decoder's word as the model's tokens (usually one; none for a word of punctuation only)."""
        tokens = self._tokens.get(word)
        if tokens is None:
            tokens = self._tokens[word] = tuple(self.normalizer.normalize(word)) if word.strip() else ()
        return tokens

    def as_written(self, word: str) -> bool:
        """Whether the model spells ``word`` as the decoder wrote it, case aside: its tokens joined by spaces are the
        word in the model's case. A stray apostrophe, a hyphen or punctuation that text normalisation drops would stay
        in the transcript though the LM never saw it: such a word is out of the vocabulary (``LMState.word_oov``), as
        a word outside a KenLM decoder's unigrams is, while its LM score stays that of its tokens."""
        written = self._written.get(word)
        if written is None:
            written = self._written[word] = " ".join(self.tokens_of(word)) == self.normalizer.cased(word)
        return written

    def is_prefix(self, partial: str) -> bool:
        """Whether some vocabulary word starts with ``partial`` as written (in the model's case: not normalised
        further, see :meth:`as_written`); an open vocabulary has every word."""
        if self._vocabulary is None:
            backend = self.backend
            if backend.open_vocabulary:
                return True
            try:
                self._vocabulary = sorted(backend.vocabulary())
            except LMServeError as error:
                self._fall_back(error, backend)
                return True  # (the n-gram's: an open vocabulary)
        known = self._prefixes.get(partial)
        if known is None:  # (a decoder asks after the same partial words in every utterance)
            prefix = self.normalizer.cased(partial)
            at = bisect_left(self._vocabulary, prefix)
            known = self._prefixes[partial] = at < len(self._vocabulary) and self._vocabulary[at].startswith(prefix)
        return known

    # -- scoring -----------------------------------------------------------------------------------------------

    @property
    def max_logprob(self) -> float | None:
        """The highest score a word can get (a bound for a decoder's pruning: a little above 0 for log-probabilities,
        for float rounding), or None for a model whose scores are not log-probabilities (self-normalised or
        unnormalised: any bound)."""
        return self.backend.max_logprob

    def word_bound(self, state: LMState, word: str) -> tuple[float, bool] | None:
        """What is known of ``word`` after ``state`` before any neural step: an upper bound of its LM score (above
        ``max_logprob`` never) and whether it is out of the vocabulary (``LMState.word_oov``). None where nothing
        is known beyond ``max_logprob``: a remote or subword model, a word of several tokens or none.

        A local word-level bundle knows both: its vocabulary says whether the word is out of it, and with an n-gram
        interpolated at λ a word's score is at most ln(λ · e^max_logprob + (1 − λ) · p_ngram), one KenLM query; a
        decoder prunes with it before it steps the LSTM (``pyctcdecode_lm``)."""
        backend = self.backend
        if type(backend) is not LocalBackend or not backend.words or backend.max_logprob is None:
            return None
        tokens = self.tokens_of(word)
        if len(tokens) != 1:
            return None
        top, oov = backend.bound(state.handle, tokens[0])
        return top, oov or not self.as_written(word)

    def start(self) -> LMState:
        """A new utterance's state; after a fallback, once ``retry_server`` seconds have passed, the server is asked
        again first."""
        if self.fell_back and time.monotonic() >= self._retry_at:
            self._try_server()
        with self._lock:
            backend, epoch = self.backend, self.epoch
        return LMState(backend.start(), epoch=epoch)

    def score(self, state: LMState, word: str, end: bool = False) -> tuple[float, LMState]:
        """:meth:`score_many` of one pair (flashlight asks one at a time). With a local backend that keeps whole
        distributions, a state stepped for it takes the states made last along (``STEP_AHEAD``): a caller that asks
        one pair at a time cannot batch them itself."""
        child = state.children.get((word, end)) or self._score([(state, word, end)], True, ahead=True)[0]
        return child.word_logprob, child

    def score_many(self, pairs: Sequence[tuple[LMState, str, bool]], keep: bool = True) -> list[tuple[float, LMState]]:
        """For each (state, word, end): the word's LM score after the state (plus ``</s>`` when ``end``) and the
        state after it (when ``end``, its ``logprob`` includes ``</s>`` but its handle continues after the word).
        All pairs not memoised yet are scored together. ``keep=False``: scores only, nothing memoised and no
        states made (e.g. a lexicon's unigram scores from the start state)."""
        out: list = [None] * len(pairs)
        todo: dict[tuple[int, str, bool], list[int]] = {}  # a pair not memoised -> its places in pairs
        for i, (state, word, end) in enumerate(pairs):
            child = state.children.get((word, end))
            if child is None:
                todo.setdefault((id(state), word, end), []).append(i)
            else:
                out[i] = (child.word_logprob, child)
        if todo:
            places = list(todo.values())
            for at, child in zip(places, self._score([pairs[p[0]] for p in places], keep), strict=True):
                for i in at:
                    out[i] = (child.word_logprob, child)
        return out

    def _score(self, pairs: list[tuple[LMState, str, bool]], keep: bool, ahead: bool = False) -> list[LMState]:
        """The child state of each (state, word, end), all pairs new; ``ahead``: ``LocalBackend.step_fresh``'s."""
        # each pair walks its tokens (and </s>) one round at a time; a round is one backend call for all pairs
        tokens = [self.tokens_of(word) for _, word, _ in pairs]
        if all(len(t) == 1 and not end for t, (_, _, end) in zip(tokens, pairs, strict=True)):
            return self._score_words(pairs, tokens, keep, ahead)
        paths = [[*t, *((EOS,) if end else ())] for t, (_, _, end) in zip(tokens, pairs, strict=True)]
        at = [state for state, _, _ in pairs]  # where each pair's walk is
        sums = [[0.0, 0.0, 0, False] for _ in pairs]  # neural, logprob, <unk> tokens, a word token was <unk>
        for depth in range(max(map(len, paths), default=0)):
            groups: dict[int, tuple[LMState, list[int]]] = {}
            for i, path in enumerate(paths):
                if depth < len(path):
                    groups.setdefault(id(at[i]), (at[i], []))[1].append(i)
            items = [
                (state, list(dict.fromkeys(paths[i][depth] for i in members))) for state, members in groups.values()
            ]
            states_needed = keep or any(depth < len(paths[i]) - 1 for _, members in groups.values() for i in members)
            scored = self._call(items, states_needed)
            for (state, words), results in zip(items, scored, strict=True):
                by_word = dict(zip(words, results, strict=True))
                for i in groups[id(state)][1]:
                    token = paths[i][depth]
                    s = by_word[token]
                    total = sums[i]
                    total[0] += s.neural
                    total[1] += s.logprob
                    total[2] += s.oov
                    total[3] = total[3] or (s.oov and token != EOS)
                    if token != EOS:  # the state after </s> is never continued: the child keeps the one before it
                        node = LMState(s.handle, at[i], token, at[i].neural + s.neural, at[i].logprob + s.logprob)
                        node.epoch = at[i].epoch
                        self.backend.track(node)
                        at[i] = node
        done = []
        for i, (state, word, end) in enumerate(pairs):
            neural, logprob, oov, word_oov = sums[i]
            child = at[i]
            if child is state:  # no token read (a word of punctuation, or </s> alone): the LM goes on from here
                child = LMState(state.handle, state.parent, state.token, epoch=state.epoch)
                self.backend.track(child)
            child.neural, child.logprob, child.oov = state.neural + neural, state.logprob + logprob, state.oov + oov
            child.words = state.words + (1 if tokens[i] else 0)
            child.ended, child.word_logprob = end, logprob
            child.word_oov = word_oov or (bool(word.strip()) and not self.as_written(word))
            child.word_tokens = len(tokens[i])
            if keep:
                state.children[(word, end)] = child
            done.append(child)
        with self._lock:
            self.pairs += len(pairs)
        return done

    def _score_words(
        self, pairs: list[tuple[LMState, str, bool]], tokens: list, keep: bool, ahead: bool = False
    ) -> list[LMState]:
        """:meth:`_score` of the usual beam step, words of one token each and no </s>: one round, the same states
        and sums (0 + x is x), without the bookkeeping of several rounds."""
        backend = self.backend
        if type(backend) is LocalBackend and backend.full:
            return self._look_up_words(backend, pairs, tokens, keep, ahead)
        groups: dict[int, tuple[LMState, dict[str, int]]] = {}  # id(state) -> (state, {token: its place})
        for (state, _, _), (token,) in zip(pairs, tokens, strict=True):
            group = groups.get(id(state))
            if group is None:
                groups[id(state)] = (state, {token: 0})
            else:
                group[1].setdefault(token, len(group[1]))
        results = self._call([(state, list(words)) for state, words in groups.values()], keep)
        answers = {key: scored for key, scored in zip(groups, results, strict=True)}
        done, track, as_written = [], self.backend.track, self.as_written
        for (state, word, end), (token,) in zip(pairs, tokens, strict=True):
            key = id(state)
            s = answers[key][groups[key][1][token]]
            child = LMState(s.handle, state, token, state.neural + s.neural, state.logprob + s.logprob,
                            state.oov + s.oov, state.words + 1, False, s.logprob, bool(s.oov) or not as_written(word),
                            1, state.epoch)  # fmt: skip
            track(child)
            if keep:
                state.children[(word, end)] = child
            done.append(child)
        with self._lock:
            self.pairs += len(pairs)
        return done

    def _look_up_words(
        self, backend: LocalBackend, pairs: list, tokens: list, keep: bool, ahead: bool = False
    ) -> list[LMState]:
        """:meth:`_score_words` with a local backend that keeps whole distributions: the states not stepped yet are
        stepped in one run, and then every word is a lookup, so the pairs need no grouping by state and no items.
        flashlight asks one pair at a time, so this path's cost per pair is most of its LM's Python time (a local
        backend has no fallback and no epochs: nothing of :meth:`_call` applies)."""
        backend.step_fresh([state.handle for state, _, _ in pairs], ahead)
        lookup, as_written, done = backend.lookup, self.as_written, []
        for (state, word, end), (token,) in zip(pairs, tokens, strict=True):
            s = lookup(state.handle, token, keep)
            child = LMState(s.handle, state, token, state.neural + s.neural, state.logprob + s.logprob,
                            state.oov + s.oov, state.words + 1, False, s.logprob, bool(s.oov) or not as_written(word),
                            1, state.epoch)  # fmt: skip
            if keep:
                state.children[(word, end)] = child
            done.append(child)
        with self._lock:
            self.calls += 1
            self.pairs += len(pairs)
        return done

    def _call(self, items: list[tuple[LMState, list[str]]], keep: bool) -> list[list[Scored]]:
        with self._lock:
            self.calls += 1
            backend, epoch = self.backend, self.epoch
        # the backend's items: all of them, but states of utterances started before the last return to the server
        ours = [] if backend is self._ngram else [k for k, (state, _) in enumerate(items) if state.epoch == epoch]
        out: list = [None] * len(items)
        if ours:
            try:
                answers = backend.step([items[k] for k in ours], keep)
            except LMServeError as error:
                self._fall_back(error, backend)
                answers, ours = [], []
            for k, scored in zip(ours, answers, strict=True):
                out[k] = scored
        rest = [k for k in range(len(items)) if out[k] is None]
        if rest:
            for k, scored in zip(rest, self._ngram_backend().step([items[k] for k in rest], keep), strict=True):
                out[k] = scored
        return out

    # -- the fallback n-gram and the way back ------------------------------------------------------------------

    def _ngram_backend(self) -> NgramBackend:
        with self._lock:
            if self._ngram is None:
                self._ngram = NgramBackend(self.fallback_ngram)
            return self._ngram

    def _fall_back(self, error: LMServeError, backend) -> None:
        """After ``backend`` failed with ``error``: switch to the n-gram, or raise ``error`` when there is none or
        the server answered (its error stands). A backend that another thread replaced already: the n-gram goes on."""
        if self.fallback_ngram is None or (self.backend is backend and not error.unavailable):
            raise error
        self._switch_to_ngram(error, backend, "from now on this decoder's LM is the n-gram %s alone")

    def _switch_to_ngram(self, error: LMServeError, backend, what: str) -> None:
        ngram = self._ngram_backend()
        with self._lock:
            if self.backend is not backend and backend is not None:
                return  # another thread switched
            self.backend, self.fell_back = ngram, True
            retry = self.retry_server if self.connect is not None else None
            self._retry_at = math.inf if retry is None else time.monotonic() + retry
        again = "" if retry is None else f"; the server is asked again in {retry:g} s"
        log.warning(f"%s; {what} (fallback_ngram){again}", error, self.fallback_ngram)
        if backend is not None:
            backend.close(wait=False)

    def _try_server(self) -> None:
        with self._lock:
            if not self.fell_back or time.monotonic() < self._retry_at:
                return
            self._retry_at = time.monotonic() + self.retry_server  # other threads go on with the n-gram meanwhile
        try:
            backend, normalizer = self.connect()
        except LMServeError as error:
            log.info("%s; still on the n-gram %s, asked again in %g s", error, self.fallback_ngram, self.retry_server)
            return
        with self._lock:
            self.backend, self.normalizer, self.fell_back = backend, normalizer, False
            self._tokens, self._written, self._vocabulary, self._prefixes = {}, {}, None, {}
            self.epoch += 1
        log.warning("%s answers again: utterances started from now on use it (fallback_ngram)", backend.describe)


# -- backends ------------------------------------------------------------------------------------------------------


@dataclass(eq=False, slots=True)
class LocalState:
    """A local state of a word-level bundle: the word the next step reads, the LSTM state before it (views into the
    output of the step that made it, shared by the states that step made: never copied) and the n-gram's KenLM
    state after the path (None without interpolation)."""

    prev_id: int
    h: np.ndarray  # [L, H]
    c: np.ndarray
    ngram: object = None
    # with full distributions (LocalBackend.full): once stepped, the scores of every next word [V] and the LSTM state
    # after prev_id [L, H], which every state after this one starts from
    scores: np.ndarray | None = None
    h_out: np.ndarray | None = None
    c_out: np.ndarray | None = None


class LocalBackend:
    """A bundle (and n-gram) in this process. A word-level bundle steps its own way (:meth:`_step_words`): states are
    :class:`LocalState` objects, and a step is one ``step`` graph run, one KenLM query per word and one interpolation
    over the step's words, with no state tokens, contexts or copies (the scores are those of
    ``InterpolatedLM.next_words_batch``). A subword bundle goes through ``next_words_batch`` (``DecoderState``
    objects)."""

    def __init__(self, lm):
        self.lm = lm
        scorer = lm.scorer
        self.open_vocabulary = scorer.pieces is not None
        self.describe = f"local bundle {scorer.bundle.path}"
        self.max_logprob = MAX_LOGPROB if scorer.normalised else None
        self.words = scorer.pieces is None
        # a vocabulary of at most FULL_VOCABULARY words: each state is stepped once, through the step_full graph, and
        # keeps every next word's score (V floats), so that the words asked after it later cost a lookup (a beam asks
        # after the same state in several frames; flashlight asks one word at a time). Larger vocabularies take the
        # step graph, scoring only the words asked: a stepped state's V floats grow with the vocabulary.
        self.full = self.words and len(scorer.bundle.tokens) <= FULL_VOCABULARY
        self.unstepped: deque[LocalState] = deque(maxlen=STEP_AHEAD)  # (full) the states made last, for step_fresh
        self.interpolate = lm.ngram is not None and lm.lam is not None
        if self.interpolate:
            import kenlm

            from lmserve.rescoring.lmscores import UNK_WORD

            self.log_lam, self.log_rest = math.log(lm.lam), math.log1p(-lm.lam)
            self.kenlm_state, self.ngram_model, self.unk_word = kenlm.State, lm.ngram.model, UNK_WORD
            self.known = scorer.known_words
        if self.words:
            from lmserve.rescoring.scorer import UNK

            self.index, self.unk_id, self.unk_token = scorer.index, UNK, scorer.bundle.tokens[UNK]

    def start(self):
        if not self.words:
            return self.lm.start_state()
        h, c = self.lm.scorer.zero_state(1)
        kenlm_state = None
        if self.interpolate:
            import kenlm

            kenlm_state = kenlm.State()
            self.lm.ngram.model.BeginSentenceWrite(kenlm_state)
        return LocalState(self.lm.scorer.start_id, h[:, 0], c[:, 0], kenlm_state)

    def vocabulary(self) -> list[str]:
        return [t for t in self.lm.scorer.bundle.tokens if not (t.startswith("<") and t.endswith(">"))]

    def step(self, items: list[tuple[LMState, list[str]]], keep: bool) -> list[list[Scored]]:
        if self.words:
            return self._step_words(items, keep)
        from lmserve.rescoring.interpolated import Step

        steps = [Step(state.handle, words, "objects" if keep else "none") for state, words in items]
        return [
            [Scored(w.neural, w.logprob, w.oov, w.after) for w in words] for words in self.lm.next_words_batch(steps)
        ]

    def _step_words(self, items: list[tuple[LMState, list[str]]], keep: bool) -> list[list[Scored]]:
        handles = [state.handle for state, _ in items]
        if self.full:
            self.step_fresh(handles)
            lookup = self.lookup
            return [
                [lookup(handle, word, keep) for word in words]
                for (_, words), handle in zip(items, handles, strict=True)
            ]
        return self._step_candidates(handles, [words for _, words in items], keep)

    def step_fresh(self, handles: list[LocalState], ahead: bool = False) -> None:
        """(``full``) Step the states of ``handles`` not stepped yet, in one run of ``step_full``, each once (several
        may share a handle, after a word of punctuation reading nothing), keeping their distributions. ``ahead``: the
        run takes along the ``STEP_AHEAD`` states made last that are not stepped yet (``unstepped``), for a caller
        that asks one state at a time; rows are independent, so this changes no score, only when a state is stepped.
        A beam step that asks all its states at once gains nothing by it (pyctcdecode on the demo: 30.8 to 32.2 ms
        an utterance without, 32.2 to 35.0 with)."""
        fresh = [handle for handle in handles if handle.scores is None]
        if not fresh:
            return
        if ahead:
            unstepped = self.unstepped
            fresh += [handle for handle in unstepped if handle.scores is None]
            unstepped.clear()  # (another thread's states, or a state two threads step at once: the same scores)
        if len(fresh) > 1:
            fresh = list({id(handle): handle for handle in fresh}.values())
        scores, h_out, c_out = self._run(fresh, None)
        for i, handle in enumerate(fresh):
            handle.scores, handle.h_out, handle.c_out = scores[i], h_out[:, i], c_out[:, i]

    def lookup(self, handle: LocalState, word: str, keep: bool) -> Scored:
        """A word after a stepped state (``handle.scores`` set): its score read off the state's distribution, the
        n-gram asked and the two mixed in Python floats, which costs less than numpy's arrays for the few words a
        beam step asks (the same arithmetic as :meth:`_step_candidates`, so the same scores to the bit)."""
        word_id = self.index.get(word, self.unk_id)
        neural = float(handle.scores[word_id])
        logprob, after = neural, None
        if self.interpolate:
            after = self.kenlm_state()
            ngram = self.ngram_model.BaseScore(handle.ngram, word if word in self.known else self.unk_word, after)
            logprob = logaddexp(self.log_lam + neural, self.log_rest + ngram * LN10)
        oov = word_id == self.unk_id and word != self.unk_token
        if not keep:
            return Scored(neural, logprob, oov, None)
        child = LocalState(word_id, handle.h_out, handle.c_out, after)
        self.unstepped.append(child)
        return Scored(neural, logprob, oov, child)

    def bound(self, handle: LocalState, word: str) -> tuple[float, bool]:
        """(word-level, normalised) ``DecoderLM.word_bound`` of one token: the bound of its score after ``handle``
        and whether it is out of the vocabulary. The arithmetic of :meth:`lookup`'s with the neural score at its
        highest: logaddexp grows with its arguments, so the bound is never below the score."""
        word_id = self.index.get(word, self.unk_id)
        oov = word_id == self.unk_id and word != self.unk_token
        if not self.interpolate:
            return self.max_logprob, oov
        ngram = self.ngram_model.BaseScore(handle.ngram, word if word in self.known else self.unk_word,
                                           self.kenlm_state())  # fmt: skip
        return logaddexp(self.log_lam + self.max_logprob, self.log_rest + ngram * LN10), oov

    def _step_candidates(self, handles: list[LocalState], words: list[list[str]], keep: bool) -> list[list[Scored]]:
        """One run of the ``step`` graph scoring each state's words (a vocabulary too large for whole
        distributions)."""
        count, index, unk_id = len(handles), self.index, self.unk_id
        counts = [len(w) for w in words]
        flat_words = [word for ws in words for word in ws]
        flat_ids = [index.get(word, unk_id) for word in flat_words]
        width = max(counts)
        ids = np.full((count, width), unk_id, np.int64)
        at = 0
        for i, k in enumerate(counts):
            ids[i, :k] = flat_ids[at : at + k]
            at += k
        logprobs, h_out, c_out = self._run(handles, ids)
        if width * count == len(flat_ids):
            neural = logprobs.astype(np.float64).ravel()
        else:
            neural = np.concatenate([logprobs[i, :k] for i, k in enumerate(counts)]).astype(np.float64)
        logprob, afters = neural, [None] * len(flat_ids)
        if self.interpolate:
            log10, at = [], 0
            for handle, ws in zip(handles, words, strict=True):
                for word in ws:
                    after = afters[at] = self.kenlm_state()
                    log10.append(self.ngram_model.BaseScore(handle.ngram, word if word in self.known else self.unk_word,
                                                            after))  # fmt: skip
                    at += 1
            logprob = np.logaddexp(self.log_lam + neural, self.log_rest + np.array(log10, dtype=np.float64) * LN10)
        out, at = [], 0
        neural_list, logprob_list = neural.tolist(), logprob.tolist()
        for i, k in enumerate(counts):
            h_i, c_i = h_out[:, i], c_out[:, i]
            scored = []
            for n in range(at, at + k):
                word_id = flat_ids[n]
                handle = LocalState(word_id, h_i, c_i, afters[n]) if keep else None
                oov = word_id == unk_id and flat_words[n] != self.unk_token
                scored.append(Scored(neural_list[n], logprob_list[n], oov, handle))
            out.append(scored)
            at += k
        return out

    def _run(self, handles: list[LocalState], ids: np.ndarray | None) -> tuple:
        """One run of the step graph (``ids`` [B, K]) or of step_full (None) from the states of ``handles``."""
        scorer, count = self.lm.scorer, len(handles)
        h = np.empty((scorer.layers, count, scorer.state_size), np.float32)
        c = np.empty_like(h)
        for i, handle in enumerate(handles):
            h[:, i] = handle.h
            c[:, i] = handle.c
        prev = np.fromiter((handle.prev_id for handle in handles), np.int64, count)
        return scorer.next_word_scores(prev, h, c, ids)

    def track(self, state: LMState) -> None:
        pass

    def close(self, wait: bool = True) -> None:
        pass


class RemoteBackend:
    """lm-serve: a stream per thread (or a unary call per step); requests split under the server's limits.

    Threads share the channel; each steps on its own stream (made at its first step; the streams of threads that have
    ended are closed when another is made, all of them by :meth:`close`). In a forked child, the parent's channel and
    streams are left alone (:meth:`_after_fork`) and the first call connects anew (``client.clone()``)."""

    def __init__(
        self,
        client,
        info,
        stream: bool = True,
        cache_states: bool = False,
        step_timeout=None,
        max_step_words: int = MAX_STEP_WORDS,
    ):
        from lmserve.rescoring.client import normalisation_name

        self.client = client
        self.new_client = client.clone
        self.target = client.target
        self.info = info
        self.model = info.name
        self.use_stream = stream
        self.cache_states = cache_states
        self.step_timeout = step_timeout
        self.max_step_words = max_step_words
        self.describe = f"lm-serve at {client.target} (model {info.name!r})"
        self.open_vocabulary = json.loads(info.manifest_json or "{}").get("vocab", {}).get("type") == "subword"
        self.max_logprob = MAX_LOGPROB if normalisation_name(info.normalisation) == "exact" else None
        self.state_bytes = 0  # the size of a state token, once seen
        self.closed = False
        self._fresh_state()
        _FORK_AWARE.add(self)

    def _fresh_state(self) -> None:
        self.lock = threading.Lock()  # what follows; held for no call
        self.streams: dict[threading.Thread, object] = {}  # thread -> its NextWordsStream
        self.holders: dict[str, int] = {}  # cache id -> live states holding it
        self.dropped: deque = deque()  # (cache id, thread) of states the decoder dropped, from their finalizers
        self.pending: dict[threading.Thread | None, list[str]] = {}  # ids to release, by the thread that made them

    def _after_fork(self) -> None:
        """In a forked child: forget the parent's channel and streams without a call on them (they are the parent's,
        and gRPC's threads behind them did not cross the fork); the next call connects anew."""
        self.client = None
        self._fresh_state()

    def _client(self):
        client = self.client
        if client is None:
            with self.lock:
                if self.closed:
                    raise LMServeError(f"{self.describe}: this decoder's LM was closed")
                if self.client is None:
                    self.client = self.new_client()
                client = self.client
        return client

    def start(self):
        return "" if self.cache_states else b""

    def vocabulary(self) -> list[str]:
        client = self._client()
        words = self._rpc(lambda: client.score_next_words(model=self.model, all_words=True)).words
        return [w.word for w in words if not (w.word.startswith("<") and w.word.endswith(">"))]

    def step(self, items: list[tuple[LMState, list[str]]], keep: bool) -> list[list[Scored]]:
        # items of more than MAX_CANDIDATES candidates are split into several items of the same state, and a step
        # into requests of at most MAX_ITEMS items, max_step_words words (the server refuses more: its
        # limits.max_step_words) and MAX_STATE_BYTES of state tokens in the answer
        per_item = max(1, min(MAX_CANDIDATES, self.max_step_words))
        flat = []
        for index, (state, words) in enumerate(items):
            for start in range(0, len(words), per_item):
                flat.append((index, state.handle, words[start : start + per_item]))
        out: list[list[Scored]] = [[] for _ in items]
        begin = 0
        while begin < len(flat):
            end, states, words = begin, 0, 0
            while end < len(flat) and end - begin < MAX_ITEMS:
                words += len(flat[end][2])
                states += len(flat[end][2]) if keep else 0
                if end > begin and (words > self.max_step_words or states * max(self.state_bytes, 1) > MAX_STATE_BYTES):
                    break
                end += 1
            response = self._request([(handle, words) for _, handle, words in flat[begin:end]], keep)
            for (index, _, _), answer in zip(flat[begin:end], response.items, strict=True):
                out[index].extend(self._scored(word) for word in answer.words)
            begin = end
        return out

    def _scored(self, word) -> Scored:
        handle = None
        if word.state_id:
            handle = word.state_id
        elif word.state:
            handle = word.state
            self.state_bytes = len(word.state)
        return Scored(word.neural, word.logprob, word.oov, handle)

    def _request(self, items, keep: bool):
        cache = keep and self.cache_states
        kwargs = dict(model=self.model, cache_states=cache, scores_only=not keep)
        if not self.use_stream:
            client, release = self._client(), self._take_released(None)
            return self._rpc(lambda: client.score_next_words_batch(items, release=release, **kwargs))
        thread = threading.current_thread()
        stream = self.streams.get(thread) or self._open_stream(thread)
        release = self._take_released(thread)
        try:
            return self._rpc(lambda: stream.step(items, release=release, **kwargs))
        except LMServeError:
            with self.lock:  # an error ends a stream: the thread's next step opens another
                if self.streams.get(thread) is stream:
                    del self.streams[thread]
            raise

    def _open_stream(self, thread: threading.Thread):
        stream = self._client().stream_next_words(step_timeout=self.step_timeout)
        with self.lock:
            ended = [t for t in self.streams if not t.is_alive()]
            closing = [self.streams.pop(t) for t in ended]
            for t in ended:  # their ids go with the next request of any thread
                self.pending.setdefault(None, []).extend(self.pending.pop(t, []))
            self.streams[thread] = stream
        for old in closing:
            old.close()
        return stream

    def _rpc(self, call):
        try:
            return call()
        except grpc.RpcError as error:
            raise server_error(self.target, error) from None

    def track(self, state: LMState) -> None:
        """Release ``state``'s cache id once no state holding it is left (the decoder dropped them), on the stream of
        the thread that made it (the server that holds it when the target has replicas)."""
        if isinstance(state.handle, str) and state.handle:
            owner = threading.current_thread() if self.use_stream else None
            with self.lock:
                self.holders[state.handle] = self.holders.get(state.handle, 0) + 1
            # a finalizer runs in whatever thread the collector does, maybe one holding the lock: it only appends
            weakref.finalize(state, self.dropped.append, (state.handle, owner))

    def _count_drops(self) -> None:
        # (with the lock held)
        while self.dropped:
            state_id, owner = self.dropped.popleft()
            left = self.holders.get(state_id, 1) - 1
            if left > 0:
                self.holders[state_id] = left
            else:
                self.holders.pop(state_id, None)
                self.pending.setdefault(owner, []).append(state_id)

    def _take_released(self, owner: threading.Thread | None) -> list[str]:
        with self.lock:
            self._count_drops()
            release = self.pending.pop(owner, [])
            if owner is not None:
                release += self.pending.pop(None, [])
            return release

    @property
    def released(self) -> list[str]:
        """The cache ids that the next requests will release."""
        with self.lock:
            self._count_drops()
            return [state_id for ids in self.pending.values() for state_id in ids]

    def close(self, wait: bool = True) -> None:
        """Close the streams and the channel; ``wait=False``: cancel them at once (a server that failed)."""
        with self.lock:
            streams, self.streams = list(self.streams.values()), {}
            client, self.client, self.closed = self.client, None, True
        if wait:
            for stream in streams:
                stream.end()
            deadline = None if self.step_timeout is None else time.monotonic() + self.step_timeout
            for stream in streams:  # (all at once: a hung server costs one deadline, not one per stream)
                stream.close(None if deadline is None else max(0.0, deadline - time.monotonic()))
        else:
            for stream in streams:
                stream.cancel()
        if client is not None:
            client.close()


class NgramBackend:
    """A KenLM model alone, standing in for an unreachable server (``fallback_ngram``): the context of a state made
    before is read off its path."""

    def __init__(self, path: str | Path):
        from lmserve.rescoring.ngram import NgramLM

        self.ngram = NgramLM(path)
        self.open_vocabulary = True  # (partial words: the vocabulary of the server, when it was read before)
        self.max_logprob = MAX_LOGPROB
        self.describe = f"n-gram {path} (fallback)"

    def start(self):
        return self.ngram.begin_state()

    def vocabulary(self) -> list[str]:
        return []

    def step(self, items: list[tuple[LMState, list[str]]], keep: bool) -> list[list[Scored]]:
        from lmserve.rescoring.ngram import NgramState

        out = []
        for state, words in items:
            context = state.handle
            if not isinstance(context, NgramState):
                context = self.ngram.state_from_context(["<s>", *state.history()][-(self.ngram.order - 1) :])
            scored = []
            for word in words:
                logprob, after = self.ngram.step(context, word)
                scored.append(Scored(math.nan, logprob, word not in self.ngram.model, after))
            out.append(scored)
        return out

    def track(self, state: LMState) -> None:
        pass

    def close(self, wait: bool = True) -> None:
        pass
