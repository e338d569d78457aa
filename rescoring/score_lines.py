"""One layout for a sentence's score, whoever computed it: ``lm-rescore score`` (a bundle loaded here) and ``lm-serve
client score`` (a server's model) print the same line for the same score, so that one can replace the other in a
pipeline (their JSONL differed: a flat record here, the server's nested message there).

- ``text``: the total; with the tokens, a tab and each token's ``word=score`` (``</s>`` last);
- ``jsonl``: ``{"text", "logprob", "log10prob", "oov"}`` and, with the tokens, ``"tokens": [[word, score], ...]``.

Scores are natural logs, or log10 with ``log10`` (the totals of a JSONL record are both, whatever ``log10`` says).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

LN10 = math.log(10)
FORMATS = ("text", "jsonl")


def score_line(
    text: str,
    logprob: float,
    oov: int,
    fmt: str = "text",
    log10: bool = False,
    tokens: Sequence[tuple[str, float]] | None = None,
    **extra,
) -> str:
    """The line (with its newline) for the sentence ``text`` of total ``logprob`` (natural log) and ``oov`` words
    outside the vocabulary; ``tokens``: (word, natural-log score) pairs to print as well; ``extra``: more JSONL
    fields (``spelled``)."""
    unit = LN10 if log10 else 1.0
    pairs = None if tokens is None else [(word, float(value) / unit) for word, value in tokens]
    if fmt == "jsonl":
        record = {"text": text, "logprob": float(logprob), "log10prob": float(logprob) / LN10, "oov": int(oov), **extra}
        if pairs is not None:
            record["tokens"] = [[word, value] for word, value in pairs]
        return json.dumps(record, ensure_ascii=False) + "\n"
    total = f"{float(logprob) / unit:.6f}"
    if pairs is None:
        return total + "\n"
    return total + "\t" + " ".join(f"{word}={value:.4f}" for word, value in pairs) + "\n"
