"""Linear mixtures of KenLM n-grams, with weights tuned on held-out text: a general model and a small in-domain one
together, through a small JSON file that loads wherever one n-gram does (``--ngram MIX.json``, :func:`load_ngram`).

A mixture scores each word as ``log Σ_k w_k p_k(word | its context)``, each component with its own context (the last
``order_k - 1`` words), so it offers what :class:`~lmserve.rescoring.ngram.NgramLM` offers the rescoring code:
per-token scores of sentences and word-by-word stepping, its state being the components' states (each one fully
determined by the last ``order - 1`` words of the longest component, which is what travels to a decoder and back).

The weights maximise the held-out likelihood, by EM on the per-token probabilities of each component (SRILM's
``compute-best-mix``): the posterior share of each component in each token, averaged over the tokens, gives the next
weights. The log-likelihood is concave in the weights and EM never lowers it, so from equal weights it climbs to the
best mixture, which is at least as good as the best single component on that text.

The components must score the same events for the mixture to be a distribution: the same tokens (``--normalize``,
``--like`` as when they were built) and, ideally, the same vocabulary; a word one component lacks is scored by its
``<unk>``. Building every component ``--like`` the same bundle maps the same words to ``<unk>`` in all of them.
``lm-rescore ngram build`` records how its text became tokens beside the model (``MODEL.text.json``: the
normalisation and the vocabulary it kept, :func:`text_record`); ``ngram mix`` refuses models whose records differ,
or differ from how it reads the held-out text, and, record or not, a model that does not know most of the held-out
words (``MAX_UNKNOWN_SHARE``): text in another form (case, punctuation) or another vocabulary, whose probabilities
are of other events, would be mixed without a word.

Mixture file (``lmserve-ngram-mix`` version 1, JSON)::

    {"format": "lmserve-ngram-mix", "format_version": 1,
     "models": [{"path": relative to this file, "bytes", "sha256", "order", "weight", "heldout_ppl", "heldout_oov"}],
     "heldout": {"files", "normalize", "like", "sentences", "tokens" (words and </s>), "ppl" (the mixture's),
                 "iterations", "converged"}}

Loading checks each model's size against the file, a cheap guard against a model rebuilt since the weights were
tuned; the sha256 says which model exactly (``sha256sum`` checks it: hashing gigabytes at every load would not do).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lmserve.core.atomic import atomic_write_text
from lmserve.core.bundle import sha256_file
from lmserve.core.textnorm import TextNormalizer
from lmserve.rescoring.ngram import BOS, NgramError, NgramLM, NgramState

FORMAT = "lmserve-ngram-mix"
FORMAT_VERSION = 1
TOLERANCE = 1e-9  # EM stops when the mean log-likelihood per token gains less than this in an iteration
MAX_ITERATIONS = 10_000
TEXT_FORMAT = "lmserve-ngram-text"  # how a model's text became tokens, beside it as MODEL.text.json
TEXT_SUFFIX = ".text.json"
MAX_UNKNOWN_SHARE = 0.5  # of the held-out words unknown to one of the models to mix: an error


@dataclass(frozen=True)
class MixtureState:
    components: tuple[NgramState, ...]
    context: tuple[str, ...]  # the last (longest order - 1) words, oldest first


class NgramMixture:
    """KenLM models with fixed weights, scored as one model (module docstring)."""

    def __init__(self, models: list[NgramLM], weights: Iterable[float], path: str | Path | None = None):
        self.models = models
        self.weights = np.asarray(list(weights), dtype=np.float64)
        if len(self.weights) != len(models) or not models:
            raise ValueError(f"a mixture needs one weight per model: {len(models)} models, {len(self.weights)} weights")
        self.log_weights = np.log(self.weights)
        self.path = Path(path) if path is not None else None
        self.order = max(m.order for m in models)
        # what scores depend on (caches key on it): each model file as NgramLM tells it, and its weight
        self.fingerprint = "mixture " + "; ".join(
            f"{w!r} x {m.fingerprint}" for w, m in zip(self.weights, models, strict=True)
        )

    @classmethod
    def load(cls, path: str | Path) -> NgramMixture:
        """A mixture file written by :func:`tune_mixture`; errors name the file and field."""
        path = Path(path)
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise NgramError(f"{path}:{e.lineno}:{e.colno}: not valid JSON: {e.msg}") from e
        except UnicodeDecodeError as e:
            raise NgramError(f"{path}: not a mixture file (not UTF-8 text)") from e
        if not isinstance(record, dict) or record.get("format") != FORMAT:
            raise NgramError(f"{path}: field 'format' must be {FORMAT!r} (a file of lm-rescore ngram mix)")
        if record.get("format_version") != FORMAT_VERSION:
            raise NgramError(f"{path}: format_version {record.get('format_version')!r}, this reads {FORMAT_VERSION}")
        entries = record.get("models")
        if not isinstance(entries, list) or not entries:
            raise NgramError(f"{path}: field 'models' must be a non-empty list")
        models, weights = [], []
        for i, entry in enumerate(entries):
            where = f"{path}: models[{i}]"
            if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
                raise NgramError(f"{where}: expected an object with a 'path'")
            weight, size = entry.get("weight"), entry.get("bytes")
            if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight <= 1:
                raise NgramError(f"{where}.weight = {weight!r}: expected a number in (0, 1]")
            model = path.parent / entry["path"]  # (an absolute path stays as it is)
            if not model.is_file():
                raise NgramError(f"{where}: {model}: no such model file")
            if is_mixture_file(model):
                raise NgramError(f"{where}: {model} is a mixture itself; mix the KenLM models it holds instead")
            if model.stat().st_size != size:
                raise NgramError(
                    f"{where}: {model} has {model.stat().st_size} bytes, the weights were tuned with {size!r} "
                    "(rebuilt since? run lm-rescore ngram mix again)"
                )
            models.append(NgramLM(model))
            weights.append(float(weight))
        if abs(sum(weights) - 1.0) > 1e-6:
            raise NgramError(f"{path}: the models' weights sum to {sum(weights)!r}, expected 1")
        return cls(models, weights, path)

    def _mixed(self, per_model: np.ndarray) -> np.ndarray:
        """log Σ_k w_k p_k of per-model natural logs ``[K, N]`` -> ``[N]``."""
        return np.logaddexp.reduce(self.log_weights[:, None] + per_model, axis=0)

    def token_logprobs(self, words: list[str]) -> np.ndarray:
        """Natural log of each word given its history, and of ``</s>`` last, under the mixture."""
        return self._mixed(np.stack([m.token_logprobs(words) for m in self.models]))

    def oov(self, words: list[str]) -> int:
        """How many words no component knows (each component scores a word it lacks as its ``<unk>``)."""
        return sum(all(w not in m.model for m in self.models) for w in words)

    def begin_state(self) -> MixtureState:
        return MixtureState(tuple(m.begin_state() for m in self.models), (BOS,))

    def step(self, state: MixtureState, word: str) -> tuple[float, MixtureState]:
        """ln p_mix(word | state) and the state after it; ``word`` may be ``</s>``."""
        steps = [m.step(s, word) for m, s in zip(self.models, state.components, strict=True)]
        after = MixtureState(tuple(s for _, s in steps), self.context_after(state.context, word))
        return float(self._mixed(np.array([[logprob] for logprob, _ in steps]))[0]), after

    def next_word_logprobs(self, state: MixtureState, words: list[str]) -> np.ndarray:
        per_model = [m.next_word_logprobs(s, words) for m, s in zip(self.models, state.components, strict=True)]
        return self._mixed(np.stack(per_model))

    def next_word_logprobs_after(self, contexts: Sequence[Sequence[str]], words: Sequence[Sequence[str]]) -> np.ndarray:
        per_model = [m.next_word_logprobs_after(contexts, words) for m in self.models]
        return self._mixed(np.stack(per_model))

    def state_from_context(self, words: list[str]) -> MixtureState:
        context = self._context(words)
        return MixtureState(tuple(m.state_from_context(list(context)) for m in self.models), context)

    # NgramLM's own: written in terms of the methods above, the context words and the order
    score = NgramLM.score
    context_words = NgramLM.context_words
    context_after = NgramLM.context_after
    _context = NgramLM._context
    state_bytes = NgramLM.state_bytes
    state_from_bytes = NgramLM.state_from_bytes


def is_mixture_file(path: Path) -> bool:
    """A JSON object, not a model: KenLM binaries start with "mmap lm", ARPA files with "\\data\\", gzip with 1f 8b."""
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(256).lstrip().startswith(b"{")


def load_ngram(path: str | Path) -> NgramLM | NgramMixture:
    """What ``--ngram PATH`` names: a KenLM model (ARPA, gzipped ARPA, binary) or a mixture file. A comma list of
    models is refused: it has no weights, and equal ones are rarely right."""
    if "," in str(path) and not Path(path).exists():
        raise NgramError(
            f"--ngram {path}: a comma list of n-grams has no weights; tune them on held-out text with "
            f"`lm-rescore ngram mix --ngram {path} --heldout TEXT --out MIX.json`, then pass --ngram MIX.json"
        )
    return NgramMixture.load(path) if is_mixture_file(Path(path)) else NgramLM(path)


def text_record(
    normalizer: TextNormalizer, vocab: Collection[str] | None, normalize: str | None, like: str | None
) -> dict:
    """How text becomes a model's tokens (``ngram build``) or the held-out text's (``ngram mix``): the flags, the
    text normaliser they give, and the vocabulary other words become ``<unk>`` outside of (its sha256; None: all
    kept)."""
    vocabulary = None
    if vocab is not None:
        vocabulary = {"size": len(vocab), "sha256": hashlib.sha256("\n".join(sorted(vocab)).encode()).hexdigest()}
    return {
        "format": TEXT_FORMAT,
        "format_version": 1,
        "normalize": normalize,
        "like": like,
        "text": normalizer.to_dict(),
        "vocabulary": vocabulary,
    }


def text_record_path(model: str | Path) -> Path:
    """``MODEL.text.json`` beside ``MODEL.bin``, ``MODEL.arpa`` or ``MODEL.arpa.gz``."""
    model = Path(model)
    name = next((model.name[: -len(s)] for s in (".arpa.gz", ".arpa", ".bin") if model.name.endswith(s)), model.name)
    return model.with_name(name + TEXT_SUFFIX)


def write_text_record(model: str | Path, record: dict) -> Path:
    path = text_record_path(model)
    atomic_write_text(path, json.dumps(record, indent=2) + "\n")
    return path


def read_text_record(model: str | Path) -> dict | None:
    """The record ``ngram build`` left beside ``model``; None for a model built otherwise (or by an older build)."""
    path = text_record_path(model)
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise NgramError(f"{path}: not a record of lm-rescore ngram build ({e})") from None
    if not isinstance(record, dict) or record.get("format") != TEXT_FORMAT:
        raise NgramError(f"{path}: field 'format' must be {TEXT_FORMAT!r} (written by lm-rescore ngram build)")
    return record


def _settings(record: dict) -> str:
    """The flags a record was made with, as a command line gives them."""
    flags = f"--normalize {record.get('normalize') or 'none'}"
    return flags + (f" --like {record['like']}" if record.get("like") else "")


def _same_tokens(a: dict, b: dict) -> str | None:
    """What differs between two text records ("text normalisation", "vocabulary"), None when nothing does."""
    if a.get("text") != b.get("text"):
        return "text normalisation"
    if a.get("vocabulary") != b.get("vocabulary"):
        return "vocabulary"
    return None


def check_same_tokens(paths: Sequence[str | Path], heldout: dict | None = None) -> None:
    """Refuse models to mix whose text records (:func:`text_record`) say their tokens differ, or differ from the
    held-out text's record ``heldout`` (how ``ngram mix`` reads it); models without a record are not compared."""
    records = [(str(p), r) for p in paths if (r := read_text_record(p)) is not None]
    if not records:
        return
    first, first_record = records[0]
    for path, record in records[1:]:
        if differs := _same_tokens(first_record, record):
            raise NgramError(
                f"--ngram {path}: built with {_settings(record)}, {first} with {_settings(first_record)}: another "
                f"{differs}, so their probabilities are of other tokens and do not mix; build every model with the "
                "same --normalize and --like"
            )
    if heldout is not None and (differs := _same_tokens(first_record, heldout)):
        raise NgramError(
            f"--heldout: read with {_settings(heldout)}, but the models were built with {_settings(first_record)} "
            f"(another {differs}): give ngram mix the --normalize and --like the models were built with"
        )


def check_known(paths: Sequence[str | Path], oov: Sequence[int], words: int, heldout: dict) -> None:
    """Refuse a model that does not know most of the held-out words (``MAX_UNKNOWN_SHARE``): built from text in
    another form or over another vocabulary, it would score them all as ``<unk>`` and get a weight of about 0, or
    the held-out text is in another form than every model's."""
    if not words:
        return
    shares = [count / words for count in oov]
    for path, share in zip(paths, shares, strict=True):
        if share > MAX_UNKNOWN_SHARE:
            others = ", ".join(f"{p} {s:.0%}" for p, s in zip(paths, shares, strict=True) if str(p) != str(path))
            files = " ".join(map(str, heldout.get("files") or []))
            raise NgramError(
                f"--ngram {path}: {share:.0%} of the {words:,} held-out words are unknown to it (--heldout {files} "
                f"read with {_settings(heldout)}; unknown to the others: {others}): a model of text in another form "
                "(case, punctuation) or of another vocabulary scores other tokens; build every model, and read the "
                "held-out text, with the same --normalize and --like"
            )


def best_mix(logprobs: np.ndarray) -> tuple[np.ndarray, int, bool]:
    """EM weights for the per-token natural-log probabilities ``[K models, N tokens]``, from equal weights; returns
    (weights, iterations, whether the gain per iteration fell below :data:`TOLERANCE`)."""
    weights = np.full(len(logprobs), 1.0 / len(logprobs))
    previous = -math.inf
    for iteration in range(1, MAX_ITERATIONS + 1):
        joint = np.log(weights)[:, None] + logprobs
        total = np.logaddexp.reduce(joint, axis=0)
        weights = np.exp(joint - total).mean(axis=1)  # each component's mean posterior share of the tokens
        likelihood = float(total.mean())  # at the weights before this update: EM's next is never lower
        if likelihood - previous < TOLERANCE:
            return weights, iteration, True
        previous = likelihood
    return weights, MAX_ITERATIONS, False


def tune_mixture(
    paths: list[str | Path],
    sentences: Iterable[list[str]],
    out: str | Path,
    heldout: dict,
    text: dict | None = None,
) -> dict:
    """Tune the weights of the KenLM models at ``paths`` on the tokenised held-out ``sentences`` and write the
    mixture file ``out``; ``heldout`` (files, text normaliser) goes into it as it is. ``text``: how the held-out text
    was read (:func:`text_record`), compared with the models' records. Returns what was written."""
    out = Path(out)
    if len(paths) < 2:
        raise ValueError(f"a mixture needs at least two n-grams, got {len(paths)}")
    for path in paths:
        if is_mixture_file(Path(path)):
            raise NgramError(f"{path}: a mixture itself; mix the KenLM models it holds instead")
    check_same_tokens(paths, text)
    models = [NgramLM(p) for p in paths]
    rows, oov, sentence_count = [], np.zeros(len(models), dtype=np.int64), 0
    for words in sentences:
        rows.append(np.stack([m.token_logprobs(words) for m in models]))
        oov += [m.oov(words) for m in models]
        sentence_count += 1
    if not rows:
        raise ValueError(f"held-out text {heldout.get('files')}: no sentences to tune the weights on")
    logprobs = np.concatenate(rows, axis=1)
    check_known(paths, oov.tolist(), int(logprobs.shape[1]) - sentence_count, heldout)
    weights, iterations, converged = best_mix(logprobs)
    mixed = NgramMixture(models, weights)._mixed(logprobs)
    record = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "models": [
            {
                "path": _relative(model.path, out),
                "bytes": model.path.stat().st_size,
                "sha256": sha256_file(model.path),
                "order": model.order,
                "weight": float(weight),
                "heldout_ppl": math.exp(-float(row.mean())),
                "heldout_oov": int(count),
            }
            for model, weight, row, count in zip(models, weights, logprobs, oov, strict=True)
        ],
        "heldout": {
            **heldout,
            "sentences": sentence_count,
            "tokens": int(logprobs.shape[1]),
            "ppl": math.exp(-float(mixed.mean())),
            "iterations": iterations,
            "converged": converged,
        },
    }
    atomic_write_text(out, json.dumps(record, indent=2) + "\n")
    return record


def _relative(model: Path, out: Path) -> str:
    """The model's path from the mixture file's folder, so that the two move together (absolute where there is no
    such path, e.g. on another drive)."""
    try:
        return os.path.relpath(model.absolute(), out.absolute().parent)
    except ValueError:
        return str(model.absolute())
