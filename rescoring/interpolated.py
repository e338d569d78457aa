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

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from lmserve.rescoring import decoder_state
from lmserve.rescoring.decoder_state import DecoderState, StateError
from lmserve.rescoring.lmscores import UNK_WORD, HypothesisScores, in_vocabulary, ngram_own
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
    ngram_own: float | None = None  # the n-gram over its own vocabulary (lmscores.HypothesisScores.ngram_own)


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
            ngram = own = None
            if self.ngram is not None:
                shared = in_vocabulary(s.words, self.scorer.known_words)
                ngram = self.ngram.token_logprobs(shared)
                own = None if shared == s.words else ngram_own(self.ngram, s.words, ngram)
            interpolated = None if self.lam is None else HypothesisScores(neural, ngram, s.oov).interpolated(self.lam)
            out.append(TokenScores(s.words, s.oov, neural, ngram, interpolated, own))
        return out

    # -- decoder steps -------------------------------------------------------------------------------------------

    def start_state(self) -> DecoderState:
        h, c = self.scorer.zero_state(1)
        return DecoderState(self.scorer.start_id, h[:, 0], c[:, 0], self._start_context())

    def _start_context(self) -> tuple[str, ...] | None:
        return (NGRAM_BOS,) if self.ngram is not None else None

    def read_state(self, token: bytes) -> DecoderState:
        """The state in a token from :meth:`next_words`; the empty token is a sentence start. A token made by a model
        with the same bundle but without an n-gram cannot go on with one (it lacks the context): ``StateError``. The
        other way round, the context is ignored."""
        if not token:
            return self.start_state()
        scorer = self.scorer
        state = decoder_state.decode(token, self.fingerprint, scorer.layers, scorer.state_size, len(scorer.index))
        (state.ngram_context,) = self._contexts([state.ngram_context], lambda i: "state")
        return state

    def _decode(self, tokens: Sequence[bytes], where: Callable[[int], str]) -> tuple:
        """``decoder_state.decode_many`` for this model, and the n-gram contexts as :meth:`read_state` says."""
        scorer = self.scorer
        prev, h, c, contexts = decoder_state.decode_many(
            tokens, self.fingerprint, scorer.layers, scorer.state_size, len(scorer.index), where
        )
        return prev, h, c, self._contexts(contexts, where)

    def _contexts(self, contexts: list, where: Callable[[int], str]) -> list:
        """The n-gram contexts of decoded tokens as this model takes them (:meth:`read_state`)."""
        if self.ngram is None:
            return [None] * len(contexts)
        for i, context in enumerate(contexts):
            if context is None:
                raise StateError(f"{where(i)}: made without an n-gram context, but this model has an n-gram")
        return contexts

    def check_candidates(self, candidates: Sequence[str], where: str = "candidates") -> None:
        bos = self.scorer.bundle.tokens[BOS]
        if not candidates:
            raise ValueError(f"{where}: empty; give at least one candidate word")
        for i, word in enumerate(candidates):
            if not word or word != word.strip() or len(word.split()) != 1:
                raise ValueError(f"{where}[{i}] = {word!r}: expected one token, without spaces")
            if word == bos:
                raise ValueError(f"{where}[{i}] is {word!r}: sentences start from the empty state")

    def read_states(
        self, states: Sequence[bytes | DecoderState], where: Callable[[int], str] = lambda i: f"items[{i}].state"
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list]:
        """:meth:`read_state` of a batch's items (tokens, b"" for a sentence start, or objects taken as they are), as
        the step graph takes them: ``prev_ids`` [B], ``h``, ``c`` [L, B, H], and each item's n-gram context. Tokens
        are decoded together (``decoder_state.decode_many``); an error's message starts with ``where(i)``."""
        prev = np.full(len(states), self.scorer.start_id, dtype=np.int64)
        h, c = self.scorer.zero_state(len(states))
        contexts = [self._start_context()] * len(states)
        tokens = [i for i, state in enumerate(states) if not isinstance(state, DecoderState) and state]
        if tokens:
            prev[tokens], h[:, tokens], c[:, tokens], read = self._decode(
                [states[i] for i in tokens], lambda k: where(tokens[k])
            )
            for i, context in zip(tokens, read, strict=True):
                contexts[i] = context
        for i, state in enumerate(states):
            if isinstance(state, DecoderState):
                prev[i], h[:, i], c[:, i], contexts[i] = state.prev_id, state.h, state.c, state.ngram_context
        return prev, h, c, contexts

    def next_words_batch(self, steps: Sequence[Step]) -> list[list[NextWord]]:
        """:meth:`next_words` with candidates for many decoder states at once (the hypotheses of a beam, of several
        decoders): one run of the ``step`` graph for all of them (an open-vocabulary model: one per piece depth),
        candidates padded to the longest list. Each item's words are scored exactly as :meth:`next_words` would
        score them alone (the batched graph agrees to float precision); errors name the item (``items[i]``).
        Around the graph, the work is done over all the batch's candidates at once (states decoded and encoded
        together, one interpolation): per candidate, Python only queries KenLM and makes the answer's objects."""
        scorer = self.scorer
        if not steps:
            return []
        words = [list(step.candidates) for step in steps]
        counts = np.array([len(item) for item in words])
        flat = [w for item in words for w in item]
        modes = [step.states for step in steps]
        # the checks over the whole batch at once: the words split back into themselves when none is empty or holds
        # whitespace; only a batch that fails is checked item by item, for the message that names the bad one
        valid = counts.all() and " ".join(flat).split() == flat and scorer.bundle.tokens[BOS] not in flat
        if not valid or not set(modes) <= set(STEP_STATES):
            for i, step in enumerate(steps):
                if step.states not in STEP_STATES:
                    raise ValueError(f"items[{i}].states = {step.states!r}: expected one of {list(STEP_STATES)}")
                self.check_candidates(step.candidates, f"items[{i}].candidates")
        prev, h, c, contexts = self.read_states([step.state for step in steps])
        if scorer.pieces is not None:
            spelled = [[scorer.pieces.spell(w) for w in item] for item in words]
            results = scorer.score_continuations_batch(prev, h, c, spelled)
            neural, ids = (np.concatenate([r[part] for r in results]) for part in (0, 1))
            h_after, c_after = (np.concatenate([r[part] for r in results], axis=1) for part in (2, 3))
            state_of = np.arange(len(flat))  # each candidate's own state (after its last piece but one)
        else:
            mask = np.arange(counts.max()) < counts[:, None]
            ids = np.full(mask.shape, UNK, dtype=np.int64)
            ids[mask] = [scorer.index.get(w, UNK) for w in flat]
            logprobs, h_out, c_out = scorer.next_word_scores(prev, h, c, ids)
            neural, ids = logprobs[mask].astype(np.float64), ids[mask]
            h_after, c_after = h_out, c_out
            state_of = np.repeat(np.arange(len(steps)), counts)  # every candidate goes on from its item's state
        out = self._words_after(flat, counts, contexts, neural, ids, h_after, c_after, state_of, modes)
        ends = np.cumsum(counts).tolist()
        return [out[end - k : end] for end, k in zip(ends, counts.tolist(), strict=True)]

    def _words_after(self, words, counts, contexts, neural, ids, h, c, state_of, modes) -> list[NextWord]:
        """The NextWords of a batch's candidates (``words``, ``counts[b]`` of item b, in order) from their neural
        scores, last token ids and the states before those tokens (``h``, ``c`` [L, S, H], candidate n's at
        ``state_of[n]``): the n-gram's scores after each item's ``contexts[b]``, the interpolation, and the new
        states as each item's ``modes[b]`` asks."""
        known = self.scorer.known_words
        oov = [word not in known for word in words]
        ngram_words = [UNK_WORD if unknown else word for word, unknown in zip(words, oov, strict=True)]
        ngram = interpolated = None
        after_contexts: list = [None] * len(words)
        if self.ngram is not None:
            starts = np.cumsum(counts) - counts
            per_item = [
                ngram_words[start : start + k] for start, k in zip(starts.tolist(), counts.tolist(), strict=True)
            ]
            ngram = self.ngram.next_word_logprobs_after(contexts, per_item)
            if self.lam is not None:
                interpolated = np.logaddexp(np.log(self.lam) + neural, np.log1p(-self.lam) + ngram)
            after = self.ngram.context_after
            after_contexts = [
                after(context, word) if mode != "none" else None
                for context, item, mode in zip(contexts, per_item, modes, strict=True)
                for word in item
            ]
        tokens, afters = [b""] * len(words), [None] * len(words)
        if len(set(modes)) == 1:  # the usual batch, every item asking alike: no array of strings to make and compare
            every = np.arange(len(words))
            rows_of = {mode: every if mode == modes[0] else every[:0] for mode in ("tokens", "objects")}
        else:
            row_modes = np.repeat(np.array(modes), counts)
            rows_of = {mode: np.flatnonzero(row_modes == mode) for mode in ("tokens", "objects")}
        rows = rows_of["tokens"]
        if len(rows):
            at = state_of[rows]
            made = decoder_state.encode_many(
                ids[rows], h[:, at], c[:, at], [after_contexts[r] for r in rows], self.fingerprint
            )
            for row, token in zip(rows.tolist(), made, strict=True):
                tokens[row] = token
        for row in rows_of["objects"].tolist():
            # a copy per state: a state kept (in a cache) must not hold the whole batch's array alive
            at = state_of[row]
            afters[row] = DecoderState(int(ids[row]), h[:, at].copy(), c[:, at].copy(), after_contexts[row])
        none = [None] * len(words)
        return list(
            map(
                NextWord,
                words,
                neural.tolist(),
                none if ngram is None else ngram.tolist(),
                none if interpolated is None else interpolated.tolist(),
                oov,
                tokens,
                afters,
            )
        )

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
        tokens = [b""] * len(chosen)
        if states:  # encoded together (``decoder_state.encode_many``)
            contexts = [
                None if ngram_state is None else self.ngram.context_after(ngram_state.context, ngram_words[k])
                for k in chosen
            ]
            tokens = decoder_state.encode_many(
                ids[chosen], h_after[:, chosen], c_after[:, chosen], contexts, self.fingerprint
            )
        return [
            NextWord(
                words[k],
                float(neural[k]),
                None if ngram is None else float(ngram[k]),
                None if interpolated is None else float(interpolated[k]),
                words[k] not in scorer.known_words,
                token,
            )
            for k, token in zip(chosen.tolist(), tokens, strict=True)
        ]
