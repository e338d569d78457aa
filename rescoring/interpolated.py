"""A neural LM with an optional n-gram on the same tokens and their per-word linear interpolation, sentence by
sentence and word by word: the engine behind ``lm-serve``'s ``ScoreSentences`` and ``ScoreNextWords``.

Both ways score the same events: the words as the neural LM sees them, its unknown words as ``<unk>`` for both models
(``rescoring.lmscores``), and ``</s>`` last. Interpolation is log(λ·p_neural + (1 − λ)·p_ngram) per token, the
``interp`` feature of rescoring. So summing :meth:`InterpolatedLM.next_words` scores over a sentence's words and
``</s>`` gives :meth:`InterpolatedLM.score` of that sentence (the ``step`` and ``sentences`` graphs agree to float
precision).

Decoders step with opaque state tokens (``rescoring.decoder_state``): the caller keeps them, this object keeps nothing
between calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lmserve.rescoring import decoder_state
from lmserve.rescoring.decoder_state import DecoderState, StateError
from lmserve.rescoring.lmscores import HypothesisScores, in_vocabulary
from lmserve.rescoring.ngram import BOS as NGRAM_BOS
from lmserve.rescoring.ngram import NgramLM
from lmserve.rescoring.scorer import BOS, UNK, Scorer


@dataclass
class TokenScores:
    """One sentence: the tokens scored and, per token (the words, then ``</s>``), each model's natural log score."""

    words: list[str]  # as the neural LM saw them, without <s> and </s>
    oov: int  # words outside the neural vocabulary
    neural: np.ndarray
    ngram: np.ndarray | None  # None without an n-gram
    interpolated: np.ndarray | None  # None without an n-gram and λ


@dataclass
class NextWord:
    word: str
    neural: float
    ngram: float | None
    interpolated: float | None
    oov: bool  # not in the neural vocabulary: scored as <unk>
    state: bytes  # the state after this word; b"" when states were not asked for
    after: DecoderState | None = None  # the same state as an object (next_words_batch with tokens=False)

    @property
    def logprob(self) -> float:
        """The model's score of the word: interpolated when there is an n-gram and a λ, else neural."""
        return self.interpolated if self.interpolated is not None else self.neural


@dataclass
class Step:
    """One item of :meth:`InterpolatedLM.next_words_batch`: a decoder state (a token, b"" for a sentence start, or
    a :class:`DecoderState` object) and the candidate words after it. ``states``: "tokens" (each word's new state as
    a token), "objects" (as a ``DecoderState``: no encoding, for callers in this process or a state cache) or "none"
    (scores only, e.g. a lexicon's unigram scores from the start state)."""

    state: bytes | DecoderState
    candidates: Sequence[str]
    states: str = "tokens"


STEP_STATES = ("tokens", "objects", "none")


class InterpolatedLM:
    def __init__(self, scorer: Scorer, ngram: NgramLM | None = None, lam: float | None = None):
        if lam is not None and (ngram is None or not 0.0 < lam < 1.0):
            raise ValueError(f"interpolation weight λ = {lam}: needs an n-gram and a value in (0, 1)")
        self.scorer = scorer
        self.ngram = ngram
        self.lam = lam
        self.fingerprint = bytes.fromhex(scorer.fingerprint)

    # -- sentences -----------------------------------------------------------------------------------------------

    def score(self, sentences: Sequence[str]) -> list[TokenScores]:
        out = []
        for s in self.scorer.score(sentences):
            neural = s.token_logprobs.astype(np.float64)
            ngram = None
            if self.ngram is not None:
                ngram = self.ngram.token_logprobs(in_vocabulary(s.words, self.scorer.known_words))
            interpolated = None if self.lam is None else HypothesisScores(neural, ngram, s.oov).interpolated(self.lam)
            out.append(TokenScores(s.words, s.oov, neural, ngram, interpolated))
        return out

    # -- decoder steps -------------------------------------------------------------------------------------------

    def start_state(self) -> DecoderState:
        h, c = self.scorer.zero_state(1)
        return DecoderState(BOS, h[:, 0], c[:, 0], (NGRAM_BOS,) if self.ngram is not None else None)

    def read_state(self, token: bytes) -> DecoderState:
        """The state in a token from :meth:`next_words`; the empty token is a sentence start. A token made by a model
        with the same bundle but without an n-gram cannot go on with one (it lacks the context): ``StateError``. The
        other way round, the context is ignored."""
        if not token:
            return self.start_state()
        scorer = self.scorer
        state = decoder_state.decode(token, self.fingerprint, scorer.layers, scorer.state_size, len(scorer.index))
        if self.ngram is not None and state.ngram_context is None:
            raise StateError("state: made without an n-gram context, but this model has an n-gram")
        if self.ngram is None:
            state.ngram_context = None
        return state

    def check_candidates(self, candidates: Sequence[str], where: str = "candidates") -> None:
        bos = self.scorer.bundle.tokens[BOS]
        if not candidates:
            raise ValueError(f"{where}: empty; give at least one candidate word")
        for i, word in enumerate(candidates):
            if not word or word != word.strip() or len(word.split()) != 1:
                raise ValueError(f"{where}[{i}] = {word!r}: expected one token, without spaces")
            if word == bos:
                raise ValueError(f"{where}[{i}] is {word!r}: sentences start from the empty state")

    def next_words_batch(self, steps: Sequence[Step]) -> list[list[NextWord]]:
        """:meth:`next_words` with candidates for many decoder states at once (the hypotheses of a beam, of several
        decoders): one run of the ``step`` graph for all of them (an open-vocabulary model: one per piece depth),
        candidates padded to the longest list. Each item's words are scored exactly as :meth:`next_words` would
        score them alone (the batched graph agrees to float precision); errors name the item (``items[i]``)."""
        scorer = self.scorer
        states = []
        for i, step in enumerate(steps):
            if step.states not in STEP_STATES:
                raise ValueError(f"items[{i}].states = {step.states!r}: expected one of {list(STEP_STATES)}")
            self.check_candidates(step.candidates, f"items[{i}].candidates")
            try:
                states.append(step.state if isinstance(step.state, DecoderState) else self.read_state(step.state))
            except StateError as e:
                raise type(e)(f"items[{i}].{e.args[0]}", *e.args[1:]) from None
        if not steps:
            return []
        prev = np.array([s.prev_id for s in states], dtype=np.int64)
        h = np.stack([s.h for s in states], axis=1)
        c = np.stack([s.c for s in states], axis=1)
        words = [list(step.candidates) for step in steps]
        if scorer.pieces is not None:
            spelled = [[scorer.pieces.spell(w) for w in item] for item in words]
            results = scorer.score_continuations_batch(prev, h, c, spelled)
        else:
            widest = max(len(item) for item in words)
            ids = np.full((len(steps), widest), UNK, dtype=np.int64)
            for b, item in enumerate(words):
                ids[b, : len(item)] = [scorer.index.get(w, UNK) for w in item]
            logprobs, h_out, c_out = scorer.next_word_scores(prev, h, c, ids)
            results = []
            for b, item in enumerate(words):
                # a copy per state: a state kept (in a cache) must not hold the whole batch's array alive
                h_b, c_b = h_out[:, b].copy(), c_out[:, b].copy()
                k = len(item)
                results.append(
                    (
                        logprobs[b, :k].astype(np.float64),
                        ids[b, :k],
                        np.broadcast_to(h_b[:, None], (h_b.shape[0], k, h_b.shape[1])),
                        np.broadcast_to(c_b[:, None], (c_b.shape[0], k, c_b.shape[1])),
                    )
                )
        return [
            self._words_after(state, item, *result, step.states)
            for state, item, result, step in zip(states, words, results, steps, strict=True)
        ]

    def _words_after(self, state: DecoderState, words, neural, ids, h_after, c_after, states: str) -> list[NextWord]:
        """The NextWords of one state's candidates from their neural scores, last token ids and the states before
        those tokens (``[L, K, H]``): the n-gram's scores and contexts added, the interpolation, the new states."""
        ngram_words = in_vocabulary(words, self.scorer.known_words)
        ngram_state = ngram = interpolated = None
        if self.ngram is not None:
            ngram_state = self.ngram.state_from_context(list(state.ngram_context))
            ngram = self.ngram.next_word_logprobs(ngram_state, ngram_words)
            if self.lam is not None:
                interpolated = np.logaddexp(np.log(self.lam) + neural, np.log1p(-self.lam) + ngram)
        out = []
        for k, word in enumerate(words):
            token_out, after = b"", None
            if states != "none":
                context = None
                if ngram_state is not None:
                    context = tuple(self.ngram.context_words(self.ngram.step(ngram_state, ngram_words[k])[1]))
                after = DecoderState(int(ids[k]), h_after[:, k], c_after[:, k], context)
                if states == "tokens":
                    token_out, after = decoder_state.encode(after, self.fingerprint), None
            out.append(
                NextWord(
                    word,
                    float(neural[k]),
                    None if ngram is None else float(ngram[k]),
                    None if interpolated is None else float(interpolated[k]),
                    word not in self.scorer.known_words,
                    token_out,
                    after,
                )
            )
        return out

    def next_words(
        self, token: bytes, candidates: Sequence[str] | None = None, top_k: int = 0, states: bool = True
    ) -> list[NextWord]:
        """Scores of the words that may follow the state in ``token``: ``candidates`` (vocabulary tokens, taken as
        they are; unknown ones are scored as ``<unk>``), or the whole vocabulary but ``<s>`` in id order, or its
        ``top_k`` best by :attr:`NextWord.logprob`. One LSTM step whatever the number of words; ``states`` adds each
        word's new state token. An open-vocabulary (subword) model scores any candidate word, each as the sum of its
        pieces (one step per piece depth, shared by candidates with common first pieces), and needs ``candidates``:
        it has no list of words to score."""
        state = self.read_state(token)
        scorer = self.scorer
        if candidates is not None:
            for i, word in enumerate(candidates):
                if not word or word != word.strip() or len(word.split()) != 1:
                    raise ValueError(f"candidates[{i}] = {word!r}: expected one token, without spaces")
                if word == scorer.bundle.tokens[BOS]:
                    raise ValueError(f"candidates[{i}] is {word!r}: sentences start from the empty state")
            words = list(candidates)
            ids = np.array([scorer.index.get(w, UNK) for w in words], dtype=np.int64)
        elif scorer.pieces is not None:
            raise ValueError("candidates: an open-vocabulary (subword) model has no word list; name the candidates")
        else:
            ids = np.array([i for i in range(len(scorer.bundle.tokens)) if i != BOS], dtype=np.int64)
            words = [scorer.bundle.tokens[i] for i in ids]
        if scorer.pieces is not None:
            spelled = [scorer.pieces.spell(w) for w in words]
            neural, ids, h_after, c_after = scorer.score_continuations(state.prev_id, state.h, state.c, spelled)
        else:
            logprobs, h_out, c_out = scorer.next_word_scores(
                np.array([state.prev_id]),
                state.h[:, None],
                state.c[:, None],
                ids[None] if candidates is not None else None,
            )
            neural = logprobs[0].astype(np.float64) if candidates is not None else logprobs[0, ids].astype(np.float64)
            h_after = np.broadcast_to(h_out, (h_out.shape[0], len(ids), h_out.shape[2]))  # one state for all
            c_after = np.broadcast_to(c_out, h_after.shape)
        ngram_words = in_vocabulary(words, scorer.known_words)
        ngram_state = ngram = interpolated = None
        if self.ngram is not None:
            ngram_state = self.ngram.state_from_context(list(state.ngram_context))
            ngram = self.ngram.next_word_logprobs(ngram_state, ngram_words)
            if self.lam is not None:
                interpolated = np.logaddexp(np.log(self.lam) + neural, np.log1p(-self.lam) + ngram)
        chosen = np.arange(len(words))
        if top_k:
            best = interpolated if interpolated is not None else neural
            chosen = np.argsort(-best, kind="stable")[:top_k]
        out = []
        for k in chosen:
            token_out = b""
            if states:
                context = None
                if ngram_state is not None:
                    context = tuple(self.ngram.context_words(self.ngram.step(ngram_state, ngram_words[k])[1]))
                after = DecoderState(int(ids[k]), h_after[:, k], c_after[:, k], context)
                token_out = decoder_state.encode(after, self.fingerprint)
            out.append(
                NextWord(
                    words[k],
                    float(neural[k]),
                    None if ngram is None else float(ngram[k]),
                    None if interpolated is None else float(interpolated[k]),
                    words[k] not in scorer.known_words,
                    token_out,
                )
            )
        return out
