"""What a word is, once for the whole engine: any run of Unicode whitespace separates words (``str.split()``: spaces,
tabs, no-break and ideographic spaces, line and paragraph separators).

The LMs' tokens, the readers' word counts, WER, BLEU's tokeniser input and the oracle all go by this, so that a
hypothesis with the words of its reference scores no errors however the two are spaced. Kaldi ``text`` files and
JSONL lists do carry tabs between words: jiwer splits on the space character only, and once read a tab as part of a
word, so that a hypothesis identical to its reference counted every word wrong, the oracle chose wrong and tuning
returned all-zero weights. Metric signatures carry :data:`WORDS` so that a figure says how its words were counted.
"""

from __future__ import annotations

WORDS = "words:unicode-whitespace"  # the signatures' field (``rescoring.metrics``)


def words(text: str) -> list[str]:
    """The words of ``text``."""
    return text.split()


def spaced(text: str) -> str:
    """``text`` with its words joined by single spaces: what jiwer and sacrebleu are given, since they split on the
    space character (jiwer) or tokenise (sacrebleu's 13a) by their own rules."""
    return " ".join(text.split())
