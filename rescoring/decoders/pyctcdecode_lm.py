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
:func:`build_ctcdecoder` makes) first gathers every word that a frame's beams complete and scores them in one LM call
(one LSTM step locally, one request on lm-serve), then lets pyctcdecode's own code run on the filled cache; its
results are those of the plain decoder with the same LM. That hook is the one private part of pyctcdecode used here:
it overrides ``_get_lm_beams`` (and reads ``_language_model``) of pyctcdecode 0.5.0, the version ``make setup``
installs; ``tests/test_decoders.py`` compares its beams with the plain decoder's. The plain
``BeamSearchDecoderCTC(alphabet, lm)`` works too, one call per word. One decoder serves several threads (a remote LM
steps on a stream per thread), and ``decode_batch`` takes a fork pool (each worker connects anew after the fork;
pyctcdecode itself decodes in one process when given a spawn pool, since its workers find the LM by inheritance).
"""

from __future__ import annotations

import sys
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
    """pyctcdecode's decoder, the words of each beam step scored in one LM call (module docstring)."""

    def _get_lm_beams(self, beams, hotword_scorer, cached_lm_scores, cached_partial_token_scores, is_eos=False):
        language_model = self._language_model
        if isinstance(language_model, LMServeLanguageModel):
            wanted = {}
            for text, next_word, *_ in beams:
                key = (joined(text, next_word), is_eos)
                if key not in cached_lm_scores and key not in wanted:
                    wanted[key] = (cached_lm_scores[(text, False)][-1], next_word, is_eos)
            if wanted:
                language_model.prefetch(list(wanted.values()))
        return super()._get_lm_beams(beams, hotword_scorer, cached_lm_scores, cached_partial_token_scores, is_eos)


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
