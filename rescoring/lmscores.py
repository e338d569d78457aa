"""Per-token scores of every hypothesis of an n-best list under the neural LM and the n-gram, computed once, cached.

Rescoring features (sentence log-probabilities, their per-word interpolation for any λ, OOV counts) are all functions
of these per-token scores, so tuning, λ sweeps and reports read the cache and never run a model again.

Both models see the same tokens: the hypothesis text through the text normaliser, words outside the neural
vocabulary replaced by ``<unk>`` for the n-gram too. Per-word interpolation is then a mixture of two distributions
over the same events (the neural vocabulary plus ``</s>``), so its perplexity is a true perplexity. Token scores are
natural logs, one per word and one for ``</s>``. The log-linear ``ngram`` feature, which mixes nothing, is the
n-gram's own view: when the n-gram knows words the neural LM does not (a 4-gram of a whole corpus beside a 30k-word
LSTM), a hypothesis holding one is also scored with its words as they are (``ngram_own``; lm-serve's sentence scores
carry it too, for ``tune --server``), else an n-gram paired with a bundle would lose every rare word it knows (LibriSpeech dev_other, first pass without its LM, books 4-gram alone
3.72 WER; the same n-gram through the bundle's vocabulary 3.80).

Cache file (JSONL): a header line ``{"format": "lmserve-lmscores", "format_version": 2, "key": {...}}`` where the key
fingerprints the lists' texts, the bundle's files, the n-gram file and the text normaliser (or the lm-serve model the
scores came from); then one line per entry:
``{"id", "hypotheses": [{"neural": [...], "ngram": [...], "oov": n, "oov_ngram": m, "ngram_own": x}]}`` (``oov_ngram``
wherever an n-gram scored; in a line written before it was kept, it is not known; ``ngram_own`` where it differs from
the sum of ``ngram``). A cache whose key differs is recomputed, and
so is one of version 1, which kept 7 significant digits: a run that read it wrote other features than the run that
computed it. Version 2 keeps every score exactly, so a rerun, a sharded run and a run through lm-serve (which sends
exact sums) write the same bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from lmserve.core.atomic import atomic_write_lines
from lmserve.core.textnorm import TextNormalizer
from lmserve.rescoring.context import score_from_states
from lmserve.rescoring.nbest import NBestList
from lmserve.rescoring.ngram import NgramLM
from lmserve.rescoring.scorer import Scorer, SentenceScore

FORMAT = "lmserve-lmscores"
FORMAT_VERSION = 2
OLD_VERSIONS = (1,)  # recomputed when found
UNK_WORD = "<unk>"


@dataclass
class HypothesisScores:
    neural: np.ndarray | None  # natural log per word and </s>; None without a neural LM
    ngram: np.ndarray | None  # the same positions under the n-gram; None without one
    oov: int  # words outside the neural vocabulary (or the n-gram's, without a neural LM): feature ``oov``
    oov_ngram: int | None = None  # words outside the n-gram's vocabulary (None: no n-gram, or not known)
    # Σ log p_ngram of the words as they are, where the n-gram knows some the neural LM does not (None: Σ ngram)
    ngram_own: float | None = None

    @property
    def oov_lm(self) -> int | None:
        """Words outside the neural LM's vocabulary (None without a neural LM): feature ``oov_lm``."""
        return None if self.neural is None else self.oov

    def interpolated(self, lam: float) -> np.ndarray:
        """log(λ·p_neural + (1 − λ)·p_ngram) per token: per-word linear interpolation of true probabilities."""
        return interpolate(self.neural, self.ngram, lam)


def interpolate(neural: np.ndarray | None, ngram: np.ndarray | None, lam: float | None) -> np.ndarray:
    """log(λ·p_neural + (1 − λ)·p_ngram) of token log-probabilities, elementwise (any matching shapes)."""
    return interpolate_at(neural, ngram, check_lambda(lam))


def check_lambda(lam: float | None) -> float:
    if lam is None or not 0.0 < lam < 1.0:
        raise ValueError(f"interpolation weight λ must be in (0, 1), got {lam}")
    return lam


def interpolate_at(neural: np.ndarray | None, ngram: np.ndarray | None, lam) -> np.ndarray:
    """:func:`interpolate` with ``lam`` a number or one λ per token (each checked by the caller)."""
    if neural is None or ngram is None:
        raise ValueError("interpolation needs both a neural LM and an n-gram")
    return np.logaddexp(np.log(lam) + neural, np.log1p(-lam) + ngram)


def texts_fingerprint(nbest: NBestList) -> str:
    """The sha256 of the lists' ids and hypothesis texts: half of every cache key."""
    texts = hashlib.sha256()
    for entry in nbest:
        texts.update(entry.id.encode() + b"\0")
        for hyp in entry.hypotheses:
            texts.update(hyp.text.encode() + b"\n")
    return texts.hexdigest()


def cache_key(
    nbest: NBestList, scorer: Scorer | None, ngram: NgramLM | None, normalizer: TextNormalizer
) -> dict[str, str | None]:
    key = {"texts": texts_fingerprint(nbest), **models_key(scorer, ngram, normalizer)}
    return key if scorer is None or ngram is None else key | {"ngram_feature": "own words"}


def models_key(scorer: Scorer | None, ngram: NgramLM | None, normalizer: TextNormalizer) -> dict[str, str | None]:
    """What the scores depend on besides the texts: the bundle's files, the n-gram file, the text normaliser."""
    return {
        "neural": None
        if scorer is None
        else json.dumps(scorer.bundle.manifest["files"], sort_keys=True)
        + (" open_vocab" if getattr(scorer, "open_vocab", False) else ""),
        "ngram": None if ngram is None else ngram.fingerprint,
        "normalizer": json.dumps(normalizer.to_dict(), sort_keys=True),
    }


def compute(
    nbest: NBestList,
    scorer: Scorer | None,
    ngram: NgramLM | None,
    normalizer: TextNormalizer,
    progress: bool = False,
    lists_per_call: int = 64,
    seconds: dict[str, float] | None = None,
    start: Callable[[Scorer], tuple[np.ndarray, np.ndarray]] | None = None,
) -> list[list[HypothesisScores]]:
    """Score every hypothesis; the neural LM shares prefixes within each list (``Scorer.score_nbest``), or, with
    ``start`` (the LSTM state each entry starts from, ``h``, ``c`` [L, N, H]: its document's earlier utterances read,
    ``rescoring.context``), reads each list from that state.

    ``scorer`` must use ``normalizer`` (``Scorer(..., normalizer=...)``): its words are what the n-gram scores.
    ``seconds``, when given, accumulates the time spent in each model ("neural", "ngram"), for throughput reports."""
    if scorer is None and ngram is None:
        raise ValueError("nothing to score with: give a neural LM bundle, an n-gram, or both")
    if scorer is not None and scorer.normalizer != normalizer:
        raise ValueError("the scorer normalises text differently from the n-gram: give both the same text normaliser")
    seconds = {} if seconds is None else seconds
    states = None
    if start is not None and scorer is not None:
        with _timed(seconds, "neural"):
            states = start(scorer)
    out: list[list[HypothesisScores]] = []
    entries = nbest.entries
    with tqdm(total=len(entries), desc="LM scores", unit="list", disable=not progress) as bar:
        for start in range(0, len(entries), lists_per_call):
            chunk = entries[start : start + lists_per_call]
            texts = [[h.text for h in e.hypotheses] for e in chunk]
            if scorer is not None:
                with _timed(seconds, "neural"):
                    if states is None:
                        scored = scorer.score_nbest(texts)
                    else:
                        part = slice(start, start + len(chunk))
                        scored = score_from_states(scorer, texts, states[0][:, part], states[1][:, part])
                words = [[_as_neural_vocab(s, scorer) for s in row] for row in scored]
            else:
                scored = [[None] * len(row) for row in texts]
                words = [[normalizer.normalize(t) for t in row] for row in texts]
            with _timed(seconds, "ngram"):
                counts = [[None if ngram is None else ngram.token_logprobs(w) for w in row] for row in words]
            for row_scores, row_words, row_counts in zip(scored, words, counts, strict=True):
                out.append(
                    [
                        HypothesisScores(
                            neural=None if s is None else s.token_logprobs.astype(np.float64),
                            ngram=c,
                            oov=ngram.oov(w) if s is None else s.oov,
                            oov_ngram=None if ngram is None else ngram.oov(w if s is None else s.words),
                            ngram_own=None
                            if s is None or ngram is None or w == s.words
                            else ngram_own(ngram, s.words, c),
                        )
                        for s, w, c in zip(row_scores, row_words, row_counts, strict=True)
                    ]
                )
            bar.update(len(chunk))
    return out


@dataclass
class LMSums:
    """One list's LM features per hypothesis, each a sum over the hypothesis' tokens: all that reranking reads of
    the LM scores once λ is fixed, as in a server call. A scoring process sums them for its whole batch of lists at
    once (:func:`summed`) and sends back these few short arrays instead of every token's score; per-token scores stay
    the form of the cache and of tuning, where λ varies. Measured at concurrency 32 (BENCHMARKS.md, "Serving"):
    building the feature matrix of a 30-best list from token scores cost the server process 0.14 ms."""

    neural: np.ndarray | None  # Σ log p_neural per hypothesis; None without a neural LM
    ngram: np.ndarray | None  # Σ log p_ngram; None without an n-gram
    interp: np.ndarray | None  # Σ log(λ·p_neural + (1 − λ)·p_ngram) at ``lam``; None when no λ was asked for
    lam: float | None
    oov: np.ndarray  # words outside the vocabulary, per hypothesis (``HypothesisScores.oov``)
    tokens: np.ndarray  # tokens scored (words and </s>) per hypothesis
    oov_lm: np.ndarray | None = None  # words outside the neural LM's vocabulary; None without one
    oov_ngram: np.ndarray | None = None  # words outside the n-gram's; None without one (or not known)

    def column(self, name: str, lam: float | None) -> np.ndarray:
        """Feature ``name`` (neural, ngram, interp at ``lam``, oov, oov_lm, oov_ngram) over the hypotheses, as
        float64."""
        if name == "oov":
            return self.oov.astype(np.float64)
        if name in ("oov_lm", "oov_ngram"):
            value = getattr(self, name)
            if value is None:
                raise ValueError(f"feature {name!r}: that LM was not given (or its OOV counts are not known here)")
            return value.astype(np.float64)
        if name == "interp" and (self.interp is None or lam != self.lam):
            raise ValueError(f"feature 'interp' at λ={lam}: these sums have it at λ={self.lam}")
        value = getattr(self, name)
        if value is None:
            raise ValueError(f"feature {name!r}: that LM was not given")
        return value


def summed(rows: list[list[HypothesisScores]], lams: list[float | None]) -> list[LMSums]:
    """:class:`LMSums` of each list of ``rows``, interp at the list's entry of ``lams`` (None: no interp): one
    concatenation and one segment sum per LM over every hypothesis of every list, because per list the numpy calls
    cost more than the sums."""
    hyps = [h for row in rows for h in row]
    lengths = np.array([len(h.neural if h.neural is not None else h.ngram) for h in hyps], dtype=np.int64)
    neural, ngram = concatenated([h.neural for h in hyps]), concatenated([h.ngram for h in hyps])
    for lam in lams:
        if lam is not None:
            check_lambda(lam)
    wanted = [lam is not None for lam in lams]
    interp = None
    if any(wanted):  # every token at its list's λ (0.5 for the lists that want none: their sums are not kept)
        hyp_lams = np.repeat([0.5 if lam is None else lam for lam in lams], [len(row) for row in rows])
        interp = token_sums(interpolate_at(neural, ngram, np.repeat(hyp_lams, lengths)), lengths)
    neural_sums = None if neural is None else token_sums(neural, lengths)
    ngram_sums = None if ngram is None else ngram_feature(token_sums(ngram, lengths), hyps)
    oov = np.array([h.oov for h in hyps], dtype=np.int64)
    oov_lm = oov if neural is not None else None
    oov_ngram = None if any(h.oov_ngram is None for h in hyps) else np.array([h.oov_ngram for h in hyps], np.int64)
    out, start = [], 0
    for row, lam, want in zip(rows, lams, wanted, strict=True):
        at = slice(start, start + len(row))
        start = at.stop
        out.append(
            LMSums(
                None if neural_sums is None else neural_sums[at],
                None if ngram_sums is None else ngram_sums[at],
                interp[at] if want else None,
                lam,
                oov[at],
                lengths[at],
                None if oov_lm is None else oov_lm[at],
                None if oov_ngram is None else oov_ngram[at],
            )
        )
    return out


def concatenated(arrays: list[np.ndarray | None]) -> np.ndarray | None:
    """Token scores end to end (None when any is None: that LM was not given)."""
    return None if any(a is None for a in arrays) else np.concatenate([*arrays, np.zeros(0)])


def token_sums(flat: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Per hypothesis the sum of its ``lengths`` token scores in ``flat`` (0 for a hypothesis with none)."""
    out = np.zeros(len(lengths), dtype=np.float64)
    full = lengths > 0
    if full.any():
        starts = (np.cumsum(lengths) - lengths)[full]
        out[full] = np.add.reduceat(flat.astype(np.float64, copy=False), starts)
    return out


@contextlib.contextmanager
def _timed(seconds: dict[str, float], name: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start


def ngram_feature(sums: np.ndarray, hyps: Sequence[HypothesisScores]) -> np.ndarray:
    """The log-linear ``ngram`` feature: each hypothesis' sum of its shared-view tokens (``sums``), replaced by its
    ``ngram_own`` where it has one (module docstring)."""
    for i, h in enumerate(hyps):
        if h.ngram_own is not None:
            sums[i] = h.ngram_own
    return sums


def ngram_own(ngram: NgramLM, words: list[str], shared: np.ndarray) -> float | None:
    """The n-gram's log-probability of ``words`` as they are; None when it is the sum of the ``shared`` view's tokens
    (the n-gram does not know the words the neural LM does not either)."""
    own = float(ngram.token_logprobs(words).sum())
    return None if own == float(shared.sum()) else own


def _as_neural_vocab(score: SentenceScore, scorer: Scorer) -> list[str]:
    """The words the neural LM saw, its unknown words as ``<unk>``: the n-gram's view of the same events."""
    return in_vocabulary(score.words, scorer.known_words)


def in_vocabulary(words: list[str], vocab: Collection[str]) -> list[str]:
    return [w if w in vocab else UNK_WORD for w in words]


def ngram_view(normalizer: TextNormalizer, vocab: Collection[str] | None = None) -> Callable[[str], list[str]]:
    """Text -> the tokens an n-gram paired with a neural LM is trained on and queried with: the same text normaliser,
    and with ``vocab`` (the bundle's) every other word as ``<unk>``."""

    def view(text: str) -> list[str]:
        words = normalizer.normalize(text)
        return words if vocab is None else in_vocabulary(words, vocab)

    return view


def load_or_compute(
    cache: Path | None,
    key: dict,
    nbest: NBestList,
    compute_scores: Callable[[], list[list[HypothesisScores]]],
) -> list[list[HypothesisScores]]:
    """The cached scores when ``cache`` holds them under ``key`` (the lists' texts and where the scores come
    from); else ``compute_scores()``, written to ``cache`` when given."""
    if cache is not None and cache.exists():
        cached = read_cache(cache, key)
        if cached is not None:
            return cached
    scores = compute_scores()
    if cache is not None:
        write_cache(cache, key, nbest, scores)
    return scores


def write_cache(
    path: Path, key: dict, nbest: NBestList, scores: list[list[HypothesisScores]], shard: dict | None = None
) -> None:
    """``shard``: where these lists lie in a whole list and the whole list's key (``tune --shard``), for
    ``lm-rescore merge --caches`` to write the whole list's cache (``rescoring.commands.shards``)."""

    def array(x: np.ndarray | None) -> list[float] | None:
        return None if x is None else x.tolist()  # every digit: a cached run writes what a fresh one does

    def lines() -> Iterable[str]:
        yield json.dumps({"format": FORMAT, "format_version": FORMAT_VERSION, "key": key, **header_extra})
        for entry, row in zip(nbest, scores, strict=True):
            hyps = [
                {"neural": array(h.neural), "ngram": array(h.ngram), "oov": h.oov}
                | ({} if h.oov_ngram is None else {"oov_ngram": h.oov_ngram})
                | ({} if h.ngram_own is None else {"ngram_own": h.ngram_own})
                for h in row
            ]
            yield json.dumps({"id": entry.id, "hypotheses": hyps})

    header_extra = {} if shard is None else {"shard": shard}
    atomic_write_lines(path, lines())


def read_cache(path: Path, key: dict) -> list[list[HypothesisScores]] | None:
    """The cached scores, or None when the cache was made for other lists, models or settings."""
    with path.open(encoding="utf-8") as f:
        try:
            header = json.loads(f.readline())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:1: not a JSON header line ({err})") from err
        if header.get("format") == FORMAT and header.get("format_version") in OLD_VERSIONS:
            return None
        if header.get("format") != FORMAT or header.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{path}:1: expected a {FORMAT} v{FORMAT_VERSION} header, got {header}")
        if header.get("key") != key:
            return None
        out = []
        for number, line in enumerate(f, start=2):
            try:
                record = json.loads(line)
                out.append(
                    [
                        HypothesisScores(
                            neural=None if h["neural"] is None else np.array(h["neural"]),
                            ngram=None if h["ngram"] is None else np.array(h["ngram"]),
                            oov=int(h["oov"]),
                            oov_ngram=_cached_oov_ngram(h),
                            ngram_own=h.get("ngram_own"),
                        )
                        for h in record["hypotheses"]
                    ]
                )
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise ValueError(f"{path}:{number}: malformed cache line ({err!r})") from err
    return out


def _cached_oov_ngram(h: dict) -> int | None:
    """A cached hypothesis' n-gram OOV count: kept since features ``oov_lm``/``oov_ngram`` were told apart; in an
    older line, ``oov`` where only an n-gram scored (it was the n-gram's), else not known."""
    if h.get("oov_ngram") is not None:
        return int(h["oov_ngram"])
    return int(h["oov"]) if h["neural"] is None and h["ngram"] is not None else None
