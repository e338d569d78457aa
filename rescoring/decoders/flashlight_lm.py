"""flashlight-text's CTC decoders with lmserve's LMs: an LM of flashlight's Python interface (``start``, ``score``,
``finish``) and a lexicon decoder built on flashlight-text directly.

    lm = LMServeFlashlightLM(DecoderLM.local("var/bundles/english_lm"), words)   # words: the LM index -> word
    decoder = lexicon_decoder(tokens, lexicon, lm, beam_size=32, lm_weight=0.5)
    best = decoder.decode(log_probs)[0]                                           # .words, .score, .lm_score

The class derives from flashlight-text's ``LM``, never from torchaudio's ``CTCDecoderLM``: this package stays
torch-free (docs/design.md), and torchaudio's class is a thin subclass of the same ``LM`` whose ``ctc_decoder`` hands the
LM to flashlight unchanged, so ``ctc_decoder(..., lm=LMServeFlashlightLM(...))`` takes it where torchaudio still
ships its decoder.

Scores are natural logs (flashlight's KenLM gives log10: an ``lm_weight`` tuned for KenLM is ln 10 times too big
here). flashlight calls the LM once per (hypothesis, word) from its C++ search, with no hook to batch a step (a
frame's callbacks come one by one, each needing its score before the search goes on, so they cannot be gathered
without changing what the search does): the adapter memoises every (state, word), and a local word-level
``DecoderLM`` with a vocabulary of at most ``FULL_VOCABULARY`` words steps each state once and keeps its whole
next-word distribution (``rescoring.decoders.lm``), so that a state costs one LSTM step and every word asked after it
a lookup. That is the fastest correct way we found; the trie's lookahead scores (each lexicon word from the sentence
start) come in one batched call (:meth:`LMServeFlashlightLM.unigram_scores`). With lm-serve
each new (state, word) is one streamed request: the pyctcdecode adapter, which batches a beam step into one request,
is the one to use against a remote LM when speed matters. An adapter keeps the states of the utterance it decodes:
one per thread (a :class:`DecoderLM` can be shared by them).

The word boundary is the lexicon's: flashlight scores a word when the trie reaches its end, whatever the tokens
(characters or subword pieces) that spell it (``rescoring.decoders``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from flashlight.lib.text.decoder import LM as _LM
from flashlight.lib.text.decoder import (
    CriterionType,
    LexiconDecoder,
    LexiconDecoderOptions,
    SmearingMode,
    Trie,
)
from flashlight.lib.text.decoder import LMState as _LMState

from lmserve.rescoring.decoders.lm import DecoderLM, LMState

END = -1  # the child index of the state after </s>


class LMServeFlashlightLM(_LM):
    """``words[i]``: the word of LM index i (flashlight's ``usr_token_idx``: the lexicon's word numbering)."""

    def __init__(self, lm: DecoderLM, words: Sequence[str]):
        _LM.__init__(self)
        self.lm = lm
        self.words = list(words)
        self.states: dict[_LMState, LMState] = {}
        # (flashlight's state, word index) -> (its child, the word's score): flashlight asks the same pair again and
        # again (about three times each), and a repeat then costs one lookup
        self.answers: dict[tuple[_LMState, int], tuple[_LMState, float]] = {}
        self.root: _LMState | None = None

    def start(self, start_with_nothing: bool = False) -> _LMState:
        """A new utterance: the states of the last one are dropped (and their memo emptied:
        ``LMState.forget_children``)."""
        if self.root is not None:
            self.states[self.root].forget_children()
        state = self.root = _LMState()
        self.states = {state: self.lm.start()}
        self.answers = {}
        return state

    def score(self, state: _LMState, usr_token_idx: int) -> tuple[_LMState, float]:
        answer = self.answers.get((state, usr_token_idx))
        return answer if answer is not None else self._child(state, usr_token_idx, self.words[usr_token_idx], False)

    def finish(self, state: _LMState) -> tuple[_LMState, float]:
        answer = self.answers.get((state, END))
        return answer if answer is not None else self._child(state, END, "", True)

    def _child(self, state: _LMState, index: int, word: str, end: bool) -> tuple[_LMState, float]:
        child = state.child(index)
        ours = self.states[child] = self.lm.score(self.states[state], word, end)[1]
        answer = self.answers[(state, index)] = (child, ours.word_logprob)
        return answer

    def unigram_scores(self, indices: Sequence[int]) -> list[float]:
        """ln p(word | <s>) of the words of ``indices``, in one LM call: the lexicon trie's lookahead."""
        start = self.lm.start()
        return [score for score, _ in self.lm.score_many([(start, self.words[i], False) for i in indices], keep=False)]

    def path(self, word_ids: Sequence[int], end: bool = True) -> LMState | None:
        """Our state at the end of a path of the last utterance's search (its summed ``logprob`` and ``neural``:
        the adapter's LM score of the words, and of </s> with ``end``); None if the search never scored it."""
        state = self.root
        for index in [*word_ids, *([END] if end else [])]:
            if state is None or state not in self.states:
                return None
            state = state.child(index)
        return self.states.get(state)


@dataclass
class Hypothesis:
    words: list[str]
    tokens: list[int]
    score: float  # flashlight's total: acoustic + lm_weight * LM + word scores
    lm_score: float  # flashlight's LM part (unweighted)
    lm_logprob: float  # our summed LM score of the words and </s> (what lm-rescore score reports, with no n-gram)


class FlashlightLexiconDecoder:
    """flashlight-text's ``LexiconDecoder`` over CTC log-probabilities with one of our LMs (torchaudio's
    ``ctc_decoder`` does the same with its own options)."""

    def __init__(
        self,
        tokens: Sequence[str],
        lexicon: Mapping[str, Sequence[Sequence[str]]],
        lm: LMServeFlashlightLM,
        beam_size: int = 32,
        beam_size_token: int | None = None,
        beam_threshold: float = 50.0,
        lm_weight: float = 0.5,
        word_score: float = 0.0,
        unk_score: float = float("-inf"),
        sil_score: float = 0.0,
        blank_token: str = "-",
        sil_token: str = "|",
        unk_word: str = "<unk>",
        nbest: int = 1,
    ):
        self.tokens = list(tokens)
        index = {t: i for i, t in enumerate(self.tokens)}
        self.lm = lm
        self.nbest = nbest
        word_index = {w: i for i, w in enumerate(lm.words)}
        missing = [w for w in lexicon if w not in word_index]
        if missing:
            raise ValueError(f"lexicon: {len(missing)} words are not in the LM's word list, e.g. {missing[:3]}")
        self.blank, self.sil = index[blank_token], index[sil_token]
        unk = word_index.get(unk_word, -1)
        entries = []
        for word, spellings in lexicon.items():
            for spelling in spellings:
                unknown = [t for t in spelling if t not in index]
                if unknown:
                    raise ValueError(f"lexicon: {word!r} is spelled {list(spelling)}; {unknown[0]!r} is not a token")
                entries.append((word_index[word], [index[t] for t in spelling]))
        word_ids = list(dict.fromkeys(w for w, _ in entries))
        scores = dict(zip(word_ids, lm.unigram_scores(word_ids), strict=True))
        trie = Trie(len(self.tokens), self.sil)
        for word, spelling in entries:
            trie.insert(spelling, word, scores[word])
        trie.smear(SmearingMode.MAX)
        options = LexiconDecoderOptions(
            beam_size=beam_size,
            beam_size_token=beam_size_token or len(self.tokens),
            beam_threshold=beam_threshold,
            lm_weight=lm_weight,
            word_score=word_score,
            unk_score=unk_score,
            sil_score=sil_score,
            log_add=False,
            criterion_type=CriterionType.CTC,
        )
        self.trie = trie  # the decoder keeps a reference to it in C++ only
        self.decoder = LexiconDecoder(options, trie, lm, self.sil, self.blank, unk, [], False)

    def decode(self, log_probs: np.ndarray) -> list[Hypothesis]:
        """The ``nbest`` best of one utterance's ``[T, len(tokens)]`` log-probabilities."""
        emissions = np.ascontiguousarray(log_probs, dtype=np.float32)
        frames, labels = emissions.shape
        if labels != len(self.tokens):
            raise ValueError(f"log_probs: {labels} labels per frame, the decoder has {len(self.tokens)} tokens")
        results = self.decoder.decode(emissions.ctypes.data, frames, labels)[: self.nbest]
        out = []
        for result in results:
            ids = [w for w in result.words if w >= 0]
            path = self.lm.path(ids)
            lm_logprob = path.logprob if path is not None else float("nan")
            out.append(Hypothesis([self.lm.words[w] for w in ids], list(result.tokens), result.score,
                                  result.lmScore, lm_logprob))  # fmt: skip
        return out


def lexicon_decoder(
    tokens: Sequence[str], lexicon: Mapping[str, Sequence[Sequence[str]]], lm: LMServeFlashlightLM, **options
) -> FlashlightLexiconDecoder:
    return FlashlightLexiconDecoder(tokens, lexicon, lm, **options)
