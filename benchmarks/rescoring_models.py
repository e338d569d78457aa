"""Shared by the benchmarks (not one itself): the LibriSpeech rescoring pair the serving benchmarks load, the 2x256
adaptive-softmax model of ``configs/gutenberg_rescore.toml`` as a bundle and a 4-gram on the prepared Gutenberg
training books built like it (``lm-rescore ngram build --like``), both built on first use; and per-word
interpolation perplexities (λ: the one with the lowest perplexity on a tuning text, ``best_lambda``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.common import ROOT, ensure_bundle
from lmserve.core.bundle import Bundle
from lmserve.core.textnorm import TextNormalizer
from lmserve.rescoring.lmscores import ngram_view
from lmserve.rescoring.ngram import NgramLM, build_ngram
from lmserve.rescoring.rescore import LanguageModels
from lmserve.rescoring.scorer import Scorer
from lmserve.training.corpus import read_sentences

LAMBDAS = tuple(round(x, 2) for x in np.arange(0.05, 1.0, 0.05))


@dataclass(frozen=True)
class Pair:
    name: str
    run: Path  # training run of the neural LM
    bundle: Path
    ngram_text: Path
    valid: Path
    order: int = 4

    @property
    def ngram(self) -> Path:
        return ROOT / "var" / "ngrams" / f"{self.name}_{self.order}gram.bin"

    def ensure(self) -> None:
        ensure_bundle(self.run, self.bundle)
        if not self.ngram.exists():
            bundle = Bundle.load(self.bundle)
            view = ngram_view(TextNormalizer.from_dict(bundle.manifest["text"]), set(bundle.tokens))
            sentences = (view(" ".join(words)) for words in read_sentences(self.ngram_text))
            build_ngram(sentences, self.order, self.ngram.with_suffix(""))


GUTENBERG = Pair(
    "gutenberg",
    ROOT / "var" / "runs" / "gutenberg_rescore",
    ROOT / "var" / "bundles" / "gutenberg_rescore",
    ROOT / "var" / "gutenberg" / "train.txt.gz",
    ROOT / "var" / "gutenberg" / "valid.txt.gz",
)


def sentence_token_scores(sentences: list[str], models: LanguageModels) -> tuple[np.ndarray, np.ndarray, int]:
    """Per-token natural-log scores of sentences under both models, on the same tokens; and the OOV count. The
    n-gram sees the words the neural LM knows (for a subword LM: every word) and ``<unk>`` for the others."""
    scorer: Scorer = models.scorer
    ngram: NgramLM = models.ngram
    neural, counts, oov = [], [], 0
    for s in scorer.score(sentences):
        neural.append(s.token_logprobs.astype(np.float64))
        counts.append(ngram.token_logprobs([w if w in scorer.known_words else "<unk>" for w in s.words]))
        oov += s.oov
    return np.concatenate(neural), np.concatenate(counts), oov


def perplexities(neural: np.ndarray, ngram: np.ndarray, lam: float) -> dict[str, float]:
    mixed = np.logaddexp(math.log(lam) + neural, math.log1p(-lam) + ngram)
    return {
        "neural": math.exp(-neural.mean()),
        "ngram": math.exp(-ngram.mean()),
        "interpolated": math.exp(-mixed.mean()),
    }


def best_lambda(neural: np.ndarray, ngram: np.ndarray) -> float:
    return min(LAMBDAS, key=lambda lam: perplexities(neural, ngram, lam)["interpolated"])
