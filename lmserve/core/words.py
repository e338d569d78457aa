"""What a word is, once for the whole engine: any run of Unicode whitespace separates words (``str.split()``: spaces,
tabs, no-break and ideographic spaces, line and paragraph separators).

The LMs' tokens, the readers' word counts, WER, BLEU's tokeniser input and the oracle all go by this, so that a
hypothesis with the words of its reference scores no errors however the two are spaced. Kaldi ``text`` files and
JSONL lists do carry tabs between words: jiwer splits on the space character only, and once read a tab as part of a
word, so that a hypothesis identical to its reference counted every word wrong, the oracle chose wrong and tuning
returned all-zero weights. Metric signatures carry :data:`WORDS` so that a figure says how its words were counted.
"""

from __future__ import annotations

import re

WORDS = "words:unicode-whitespace"  # the signatures' field (``rescoring.metrics``)


def words(text: str) -> list[str]:
    """The words of ``text``."""
    return text.split()


def spaced(text: str) -> str:
    """``text`` with its words joined by single spaces: what jiwer and sacrebleu are given, since they split on the
    space character (jiwer) or tokenise (sacrebleu's 13a) by their own rules."""
    return " ".join(text.split())


# Han ideographs (with extension A and the compatibility block) and kana: scripts written without spaces
_UNSPACED = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_SOURCE_TOKEN = re.compile(f"[{_UNSPACED}]|[^\\s{_UNSPACED}]+")


def source_length(text: str) -> int:
    """The length of a source sentence in words, each Chinese or Japanese character counting as one, as sacrebleu's
    ``zh`` tokeniser splits them: a WMT22 zh-en source has 1.6 whitespace words on average for 40 characters, so
    counting words alone makes a length ratio to the source the candidate's length."""
    return len(_SOURCE_TOKEN.findall(text))
