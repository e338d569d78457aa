"""pyctcdecode with lmserve's LMs: a language model class of pyctcdecode's interface, and a decoder whose beam steps
each cost one LM call.

    from lmserve.rescoring.decoders.lm import DecoderLM
    from lmserve.rescoring.decoders.pyctcdecode_lm import build_ctcdecoder

    lm = DecoderLM.local("var/bundles/english_lm")          # or DecoderLM.remote("host:50051", model="english")
    decoder = build_ctcdecoder(labels, lm, alpha=0.5, beta=1.0)
    text = decoder.decode(log_probs)                        # [T, len(labels)] CTC log-probabilities, as with KenLM

:class:`LMServeLanguageModel` answers pyctcdecode's questions as its KenLM ``LanguageModel`` does, in natural logs:
a word scores ``alpha * ln p(word | history) + beta`` (plus ``unk_score_offset`` for a word outside the neural
vocabulary, which the LM scores as ``<unk>``, or one it does not spell as written: ``DecoderLM.as_written``), the
last word of an utterance also ``alpha * ln p(</s> | ...)`` (with ``score_boundary``; the neural LM always starts
from ``<s>``), a partial word ``unk_score_offset`` (scaled by length past 6 characters) once no vocabulary word
starts with it as written. The word boundary: ``rescoring.decoders``.

pyctcdecode itself asks for one (state, word) at a time. :class:`BatchedBeamSearchDecoderCTC` (what
:func:`build_ctcdecoder` makes) gathers the words that a frame's beams complete and scores them in one LM call (one
LSTM step locally, one request on lm-serve), leaving out the words of beams that the frame's pruning drops whatever
their LM scores (their score with the highest word score the LM can give is below the ``beam_width``-th best known,
or below the best by more than ``beam_prune_logp``), and skips pyctcdecode's pruning by history, which keeps every
beam when all of the history counts (``order``: infinite); its results are those of the plain decoder with the same
LM. Those hooks are the private part of pyctcdecode used here: it overrides ``_get_lm_beams`` and
``_decode_logits`` (and reads ``_language_model``) of pyctcdecode 0.5.0, the version ``make setup`` installs, since
the public ``AbstractLanguageModel.score`` is asked one beam at a time (docs/decoders.md says why and what it costs);
``tests/test_decoders.py`` compares its beams with the plain decoder's. The plain
``BeamSearchDecoderCTC(alphabet, lm)`` works too, one call per word. One decoder serves several threads (a remote LM
steps on a stream per thread), and ``decode_batch`` takes a fork pool (each worker connects anew after the fork;
pyctcdecode itself decodes in one process when given a spawn pool, since its workers find the LM by inheritance).
"""

from __future__ import annotations

import heapq
import sys
import threading
from collections.abc import Sequence

from pyctcdecode.alphabet import Alphabet
from pyctcdecode.constants import AVG_TOKEN_LEN, DEFAULT_ALPHA, DEFAULT_BETA, DEFAULT_UNK_LOGP_OFFSET
from pyctcdecode.decoder import BeamSearchDecoderCTC
from pyctcdecode.language_model import AbstractLanguageModel

from lmserve.rescoring.decoders.lm import DecoderLM, LMState


def joined(text: str, word: str) -> str:
    """A beam's text with its next word: what pyctcdecode's decoder keys its cached LM scores by (a space between
    them unless one is empty)."""
    return f"{text} {word}" if text and word else text or word


class LMServeLanguageModel(AbstractLanguageModel):
    def __init__(
        self,
        lm: DecoderLM,
        alpha: float = DEFAULT_ALPHA,
        beta: float = DEFAULT_BETA,
        unk_score_offset: float = DEFAULT_UNK_LOGP_OFFSET,
        score_boundary: bool = True,
    ):
        self.lm = lm
        self.alpha = alpha
        self.beta = beta
        self.unk_score_offset = unk_score_offset
        self.score_boundary = score_boundary

    @property
    def order(self) -> int:
        """The history that can change a score: all of it (pyctcdecode's ``prune_history`` keeps every beam)."""
        return sys.maxsize

    def get_start_state(self) -> LMState:
        return self.lm.start()

    def score_partial_token(self, partial_token: str) -> float:
        if not partial_token or self.lm.is_prefix(partial_token):
            return 0.0
        score = self.unk_score_offset
        if len(partial_token) > AVG_TOKEN_LEN:
            score *= len(partial_token) / AVG_TOKEN_LEN
        return score

    def score(self, prev_state: LMState, word: str, is_last_word: bool = False) -> tuple[float, LMState]:
        _, state = self.lm.score(prev_state, word, is_last_word and self.score_boundary)
        return self.fused(state), state

    def prefetch(self, pairs: Sequence[tuple[LMState, str, bool]]) -> None:
        """Score (state, word, is_last_word) triples in one LM call, for :meth:`score` to find."""
        self.lm.score_many([(state, word, last and self.score_boundary) for state, word, last in pairs])

    def score_many(self, pairs: Sequence[tuple[LMState, str, bool]]) -> list[tuple[float, LMState]]:
        """:meth:`score` of (state, word, is_last_word) triples, in one LM call."""
        scored = self.lm.score_many([(state, word, last and self.score_boundary) for state, word, last in pairs])
        return [(self.fused(state), state) for _, state in scored]

    def max_fused(self) -> float | None:
        """The highest score :meth:`score` can give a word (None: no bound, a model whose scores are not
        log-probabilities, or a negative ``alpha``)."""
        top = self.lm.max_logprob
        if top is None or self.alpha < 0:
            return None
        return self.alpha * top + max(self.beta, 0.0) + max(self.unk_score_offset, 0.0)

    def fused_bound(self, state: LMState, word: str, is_last_word: bool, top: float) -> float:
        """The highest score :meth:`score` can give ``word`` after ``state``, from what the LM knows of it before a
        neural step (``DecoderLM.word_bound``: with an n-gram, its score; the vocabulary, whether the offset
        applies), else ``top`` (:meth:`max_fused`, not None). The arithmetic of :meth:`fused` with the word's score
        at its bound (``alpha`` ≥ 0: :meth:`max_fused` is None otherwise), so that rounding keeps it a bound."""
        known = self.lm.word_bound(state, word)
        if known is None:
            return top
        logprob, oov = known
        if is_last_word and self.score_boundary:
            logprob += self.lm.max_logprob  # (</s>)
        bonus = self.beta
        if oov:
            bonus += self.unk_score_offset
        return self.alpha * logprob + bonus

    def fused(self, state: LMState) -> float:
        """What the decoder adds for the word that led to ``state``: beta for a word the LM read, the offset for one
        out of its vocabulary (punctuation alone included: the LM reads nothing of it, the transcript keeps it)."""
        bonus = self.beta if state.word_tokens else 0.0  # (no word read: </s> alone, or punctuation)
        if state.word_oov:
            bonus += self.unk_score_offset
        return self.alpha * state.word_logprob + bonus

    def reset_params(self, **params) -> None:
        for name in ("alpha", "beta", "unk_score_offset", "score_boundary"):
            value = params.get(name)
            if value is not None:
                setattr(self, name, value)


class BatchedBeamSearchDecoderCTC(BeamSearchDecoderCTC):
    """pyctcdecode's decoder, the words of each beam step scored in one LM call, and only those of beams that can
    survive the step (module docstring)."""

    _search = threading.local()  # the running search's (beam_width, beam_prune_logp), for _get_lm_beams

    def _decode_logits(self, logits, beam_width, beam_prune_logp, token_min_logp, prune_history, hotword_scorer,
                       lm_start_state=None):  # fmt: skip
        root = None
        if isinstance(self._language_model, LMServeLanguageModel):
            # pruning by history keeps one beam per (last order - 1 words, partial word, last character): with all of
            # the history counting (order: infinite) every beam is already alone after pyctcdecode's merge, so the
            # pruning drops nothing and only costs a split of every beam's text per frame
            prune_history = False
            self._search.limits = (beam_width, beam_prune_logp)
            if lm_start_state is None:
                lm_start_state = root = self._language_model.get_start_state()
        try:
            return super()._decode_logits(logits, beam_width, beam_prune_logp, token_min_logp, prune_history,
                                          hotword_scorer, lm_start_state)  # fmt: skip
        finally:
            self._search.limits = None
            if root is not None:
                root.forget_children()

    def _get_lm_beams(self, beams, hotword_scorer, cached_lm_scores, cached_partial_token_scores, is_eos=False):
        """pyctcdecode's ``_get_lm_beams`` (the same beams, scores and cache entries) with the words of the step
        scored in one LM call, and none of a beam that the step's pruning would drop whatever its word scores.

        The caller keeps the ``beam_width`` best beams within ``beam_prune_logp`` of the best. A beam whose word is
        not scored yet has a bound: its score with the highest fused score any word can have (``alpha`` · the
        LM's highest log-probability + ``beta`` + a positive ``unk_score_offset``; ``max_fused``), or a tighter one
        where the LM knows more of the word before its neural step (``fused_bound``). A beam whose
        bound is below the ``beam_width``-th best score known, or below the best known + ``beam_prune_logp``, is
        dropped unscored: the caller would drop it anyway (strictly below, so ties cannot change its choice), and
        the beams returned keep their order, so its ``nlargest`` picks the same beams in the same order."""
        language_model = self._language_model
        if not isinstance(language_model, LMServeLanguageModel):
            return super()._get_lm_beams(beams, hotword_scorer, cached_lm_scores, cached_partial_token_scores, is_eos)
        # without hotwords (pyctcdecode's HotwordScorer holds "" only when its trie has some) every hotword score is
        # 0.0, which adds nothing to a float: the trie and the regular expression are not asked
        hotwords = "" in hotword_scorer
        # one pass for the beams whose words are scored (most: a beam completes a word in few frames), the others
        # kept as (place, beam, new text, partial word's score) for one LM call after it
        new_beams, pending = [], []
        for beam in beams:
            text, next_word, word_part, last_char, frame_list, frames, logit_score = beam
            new_text = f"{text} {next_word}" if text and next_word else text or next_word
            partial = 0.0
            if word_part:
                partial = cached_partial_token_scores.get(word_part)
                if partial is None:
                    if hotwords and word_part in hotword_scorer:
                        partial = hotword_scorer.score_partial_token(word_part)
                    else:
                        partial = language_model.score_partial_token(word_part)
                    cached_partial_token_scores[word_part] = partial
            cached = cached_lm_scores.get((new_text, is_eos))
            if cached is None:
                pending.append((len(new_beams), beam, new_text, partial))
                new_beams.append(None)
            else:
                lm_score = cached[0] + partial if word_part else cached[0]
                new_beams.append((new_text, "", word_part, last_char, frame_list, frames, logit_score,
                                  logit_score + lm_score))  # fmt: skip
        if not pending:
            return new_beams
        hotword = hotword_scorer.score if hotwords else lambda text: 0.0
        limits = getattr(self._search, "limits", None)
        top = language_model.max_fused()
        if limits is not None and top is not None and len(pending) < len(new_beams):
            known = [b[7] for b in new_beams if b is not None]
            beam_width, prune_logp = limits
            cut = max(known) + prune_logp
            if len(known) >= beam_width:
                cut = max(cut, heapq.nlargest(beam_width, known)[-1])
            kept = []
            for place, beam, new_text, partial in pending:
                # the arithmetic of the exact score below, with the highest word score: never below it
                _, raw, state = cached_lm_scores[(beam[0], False)]
                bound = (raw + language_model.fused_bound(state, beam[1], is_eos, top)) + hotword(new_text)
                if beam[2]:
                    bound += partial
                if beam[6] + bound >= cut:
                    kept.append((place, beam, new_text, partial))
            pending = kept
        wanted = {}
        for _, beam, new_text, _ in pending:
            key = (new_text, is_eos)
            if key not in wanted:
                wanted[key] = (beam[0], cached_lm_scores[(beam[0], False)][-1], beam[1])
        if wanted:
            scored = language_model.score_many([(state, word, is_eos) for _, state, word in wanted.values()])
            for (key, (text, _, _)), (score, end_state) in zip(wanted.items(), scored, strict=True):
                raw_lm_score = cached_lm_scores[(text, False)][1] + score
                cached_lm_scores[key] = (raw_lm_score + hotword(key[0]), raw_lm_score, end_state)
        for place, beam, new_text, partial in pending:
            _, _, word_part, last_char, frame_list, frames, logit_score = beam
            lm_score = cached_lm_scores[(new_text, is_eos)][0]
            if word_part:
                lm_score += partial
            new_beams[place] = (new_text, "", word_part, last_char, frame_list, frames, logit_score,
                                logit_score + lm_score)  # fmt: skip
        return [b for b in new_beams if b is not None]


def build_ctcdecoder(
    labels: list[str],
    lm: DecoderLM | None = None,
    alpha: float = DEFAULT_ALPHA,
    beta: float = DEFAULT_BETA,
    unk_score_offset: float = DEFAULT_UNK_LOGP_OFFSET,
    lm_score_boundary: bool = True,
) -> BatchedBeamSearchDecoderCTC:
    """pyctcdecode's ``build_ctcdecoder`` with one of our LMs in KenLM's place (None: no LM)."""
    language_model = None
    if lm is not None:
        language_model = LMServeLanguageModel(lm, alpha, beta, unk_score_offset, lm_score_boundary)
    return BatchedBeamSearchDecoderCTC(Alphabet.build_alphabet(labels), language_model)
