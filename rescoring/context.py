"""Document context: the neural LM reads a document's earlier utterances before it scores the next one.

Consecutive utterances of a talk, a book chapter or an article share topic and names; an n-gram cannot use that, an
LSTM trained as a stream (``data.mode = "stream"``: sentences in document order, state carried across them) can.
Rescoring in context scores each utterance's hypotheses from the LSTM state after the document's earlier utterances,
instead of from a fresh state.

What the LM reads for an earlier utterance is a *hypothesis*, never its reference: the first pass's 1-best
(:func:`first_pass_history`), or the hypotheses a rescoring pass chose (``lm-rescore nbest --context`` rescores twice:
with the 1-best history, then with its own choices). Tuning uses the 1-best history, so that the LM scores of a list
are computed once and its weights apply unchanged to the second pass.

Where documents come from (``--context``):

- ``order``: the list is one document, in list order (a talk's utterances in talk order: TED-LIUM 3, WSJ);
- ``id``: utterances whose ids share the part before their last ``-`` are one document, in list order
  (LibriSpeech's ``SPEAKER-CHAPTER-UTTERANCE``: a book chapter);
- ``document``: each entry's ``document`` field (JSON Lines lists: any grouping the ids do not show).

A user orders their lists accordingly: the utterances of a document in the order they were spoken, documents
contiguous or not (``id`` gathers them).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from lmserve.rescoring.nbest import NBestList
from lmserve.rescoring.scorer import EOS, Scorer, SentenceScore

CONTEXTS = ("order", "id", "document")


def document_keys(nbest: NBestList, how: str) -> list[str]:
    """The document of each entry, by ``how`` (module docstring)."""
    if how == "order":
        return [""] * len(nbest.entries)
    if how == "id":
        keys = []
        for entry in nbest.entries:
            if "-" not in entry.id:
                raise ValueError(
                    f"{entry.origin or nbest.name}: id {entry.id[:80]!r} has no '-': --context id takes the document "
                    "from ids of the form DOCUMENT-UTTERANCE (LibriSpeech: SPEAKER-CHAPTER-UTTERANCE)"
                )
            keys.append(entry.id.rsplit("-", 1)[0])
        return keys
    if how == "document":
        for entry in nbest.entries:
            if entry.document is None:
                raise ValueError(
                    f"{entry.origin or nbest.name}: no field 'document': --context document takes each utterance's "
                    'document from it (JSON Lines: "document": "talk-12"); or use --context order or id'
                )
        return [entry.document for entry in nbest.entries]
    raise ValueError(f"unknown document context {how!r}; expected one of {', '.join(CONTEXTS)}")


def first_pass_history(nbest: NBestList) -> list[str]:
    """What each utterance contributes to the context of the ones after it: its first-pass 1-best ('' if none)."""
    return [e.hypotheses[0].text if e.hypotheses else "" for e in nbest.entries]


def fingerprint(documents: Sequence[str], history: Sequence[str]) -> str:
    """What scores in context depend on besides the hypotheses and the models (part of the LM-score cache key)."""
    digest = hashlib.sha256()
    for doc, text in zip(documents, history, strict=True):
        digest.update(doc.encode("utf-8") + b"\0" + text.encode("utf-8") + b"\n")
    return digest.hexdigest()


def states_before(scorer: Scorer, documents: Sequence[str], history: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """The LSTM state (``h``, ``c`` [L, N, H]) before each of N utterances: a fresh state at a document's first
    utterance, else the state after reading the earlier utterances' ``history`` texts, each as the stream had them
    (the start token, its words; the next start token is the </s> that ends it). The documents advance together, one
    utterance and one token at a time, so a step costs one ``step`` run whatever the number of documents."""
    order: dict[str, list[int]] = {}
    for i, doc in enumerate(documents):
        order.setdefault(doc, []).append(i)
    docs = list(order.values())
    h_all, c_all = scorer.zero_state(len(documents))
    h, c = scorer.zero_state(len(docs))
    for j in range(max((len(d) for d in docs), default=0)):
        rows = np.array([k for k, d in enumerate(docs) if len(d) > j], dtype=np.int64)
        entries = [docs[k][j] for k in rows]
        h_all[:, entries], c_all[:, entries] = h[:, rows], c[:, rows]
        if j + 1 == max(len(d) for d in docs):
            break
        tokens = [[scorer.start_id, *scorer.encode(history[i])[1]] for i in entries]
        for t in range(max(map(len, tokens))):
            active = np.array([r for r, seq in enumerate(tokens) if len(seq) > t], dtype=np.int64)
            prev = np.array([tokens[r][t] for r in active], dtype=np.int64)
            sel = rows[active]
            _, h_out, c_out = scorer.next_word_scores(prev, h[:, sel], c[:, sel], np.full((len(sel), 1), EOS))
            h[:, sel], c[:, sel] = h_out, c_out
    return h_all, c_all


def states_after(scorer: Scorer, contexts: Sequence[Sequence[str]]) -> tuple[np.ndarray, np.ndarray]:
    """The LSTM state after reading each of N lists' ``contexts`` (the texts of its document's earlier utterances,
    oldest first), from a fresh state: :func:`states_before` of one document per list whose earlier utterances are
    those texts (``lm-serve``'s ``RescoreNBest`` gets them in the request)."""
    documents, history, last = [], [], []
    for i, texts in enumerate(contexts):
        documents += [str(i)] * (len(texts) + 1)
        history += [*texts, ""]
        last.append(len(documents) - 1)
    h, c = states_before(scorer, documents, history)
    return h[:, last], c[:, last]


def score_from_states(
    scorer: Scorer, lists: Sequence[Sequence[str]], h: np.ndarray, c: np.ndarray, max_batch_rows: int = 256
) -> list[list[SentenceScore]]:
    """Each list's hypotheses scored from that list's state (``h``, ``c`` [L, N, H]) through the ``sentences``
    graph, in batches of similar length."""
    if not scorer.continues_from_state:
        raise ValueError(f"{scorer.bundle.path}: a format 1 bundle cannot score from a carried state; export it again")
    memo: dict = {}
    encoded = [[scorer.encode(text, memo) for text in hyps] for hyps in lists]
    flat = [(i, j) for i, hyps in enumerate(encoded) for j in range(len(hyps))]
    flat.sort(key=lambda ij: len(encoded[ij[0]][ij[1]][1]))
    token_scores: dict[tuple[int, int], np.ndarray] = {}
    for start in range(0, len(flat), max_batch_rows):
        part = flat[start : start + max_batch_rows]
        owners = np.array([i for i, _ in part], dtype=np.int64)
        scores = scorer.score_ids([encoded[i][j][1] for i, j in part], h[:, owners].copy(), c[:, owners].copy())
        for row, (i, j) in enumerate(part):
            token_scores[i, j] = scores[row, : len(encoded[i][j][1]) + 1]
    return [
        [
            SentenceScore(words, scorer.word_scores(words, token_scores[i, j]), oov)
            for j, (words, _, oov) in enumerate(hyps)
        ]
        for i, hyps in enumerate(encoded)
    ]
