"""KenLM n-gram models: query with the ``kenlm`` module, build with KenLM's ``lmplz`` and ``build_binary``.

The split is KenLM's own: the Python module only reads models (ARPA, gzipped ARPA or KenLM binary), the two programs
estimate them (``lm-rescore ngram install-tools`` compiles them; :func:`find_program` says where they are looked
for). Scores here are natural logs like the neural scorer's; KenLM's log10 values are converted. Sentences are scored independently as ``<s> w1 .. wn </s>``.

Decoders step word by word with an :class:`NgramState`. The server is stateless, so a state must travel to the client
and back: it is fully determined by the last ``order - 1`` words, which is what :func:`NgramLM.state_bytes` writes.
"""

from __future__ import annotations

import math
import os
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import kenlm
import numpy as np

from lmserve.core.checkout import source_checkout

LN10 = math.log(10)
KENLM_BIN_ENV = "LMSERVE_KENLM_BIN"
BOS, UNK = "<s>", "<unk>"
# lmplz rejects <unk> in its input, yet closed-vocabulary corpora (PTB) use it as a word, 4-5% of tokens. It goes in
# under this stand-in, a token no real text has, and comes out merged with lmplz's own <unk>: see _merge_unk.
UNK_STANDIN = "\x01unk\x01"
# KenLM states kept by their context words for the next decoder step (NgramLM.next_word_logprobs_after): a few MB
STATE_CACHE_SIZE = 1 << 16


class NgramError(Exception):
    """A model that cannot be read, or a build that failed (the message carries lmplz's own words)."""


@dataclass(frozen=True)
class NgramState:
    """KenLM's state plus the words it stands for: KenLM's state cannot be read back, the words can be sent."""

    kenlm: kenlm.State
    context: tuple[str, ...]  # at most order - 1 words, oldest first; starts with <s> near a sentence's start


class NgramLM:
    """A KenLM model loaded once: sentence and per-token scores, OOV counts, and word-by-word stepping."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(
                f"{self.path}: no n-gram model here (expected an ARPA, gzipped ARPA or KenLM binary)"
            )
        config = kenlm.Config()
        config.show_progress = False
        try:
            self.model = kenlm.Model(str(self.path), config)
        except OSError as e:
            raise NgramError(f"{self.path}: not a readable ARPA or KenLM binary model ({e})") from e
        self._states: dict[tuple[str, ...], kenlm.State] = {}  # next_word_logprobs_after's, by context words
        stat = self.path.stat()
        # Cheap to compute for multi-GB models and changes whenever the file is rewritten: caches key on it.
        self.fingerprint = f"{self.path.resolve()} size={stat.st_size} mtime_ns={stat.st_mtime_ns}"

    @property
    def order(self) -> int:
        return self.model.order

    def token_logprobs(self, words: list[str]) -> np.ndarray:
        """Natural log of each word given its history, and of ``</s>`` last; unknown words get ``<unk>``'s score."""
        log10 = [prob for prob, _, _ in self.model.full_scores(" ".join(words), bos=True, eos=True)]
        return np.array(log10, dtype=np.float64) * LN10

    def score(self, words: list[str]) -> float:
        """ln p(w1 .. wn </s> | <s>): the sum of :meth:`token_logprobs`."""
        return float(self.token_logprobs(words).sum())

    def oov(self, words: list[str]) -> int:
        """How many words the model does not know (each scored as ``<unk>``)."""
        return sum(w not in self.model for w in words)

    def begin_state(self) -> NgramState:
        state = kenlm.State()
        self.model.BeginSentenceWrite(state)
        return NgramState(state, (BOS,))

    def step(self, state: NgramState, word: str) -> tuple[float, NgramState]:
        """ln p(word | state) and the state after it; ``word`` may be ``</s>``."""
        out = kenlm.State()
        log10 = self.model.BaseScore(state.kenlm, word, out)
        return log10 * LN10, NgramState(out, self.context_after(state.context, word))

    def next_word_logprobs(self, state: NgramState, words: list[str]) -> np.ndarray:
        """ln p(word | state) for each of ``words`` (a decoder's candidates, or a whole vocabulary), without building
        the states after them."""
        scratch = kenlm.State()
        log10 = [self.model.BaseScore(state.kenlm, word, scratch) for word in words]
        return np.array(log10, dtype=np.float64) * LN10

    def next_word_logprobs_after(self, contexts: Sequence[Sequence[str]], words: Sequence[Sequence[str]]) -> np.ndarray:
        """:meth:`next_word_logprobs` of ``words[b]`` after each of ``contexts`` (as :meth:`context_words` gives
        them), flat: a beam step's n-gram scores in one call, one array at the end instead of one per hypothesis.

        A decoder's next step starts from the contexts this step reaches, so the KenLM state after each word is kept
        under its context words (:meth:`context_after`) and looked up there first: building a state from its words
        (:meth:`state_from_context`) costs a KenLM query per word, and was most of this method's time. The cache is
        emptied when it holds ``STATE_CACHE_SIZE`` states (decoders that walked away leave theirs behind); a state
        depends on its context words only, so a kept one scores exactly as a rebuilt one."""
        model, states, log10, after_context = self.model, self._states, [], self.context_after
        if len(states) > STATE_CACHE_SIZE:
            states.clear()
        for context, item in zip(contexts, words, strict=True):
            context = tuple(context)
            state = states.get(context)
            if state is None:
                state = self.state_from_context(list(context)).kenlm
            for word in item:
                after = kenlm.State()
                log10.append(model.BaseScore(state, word, after))
                states[after_context(context, word)] = after
        return np.array(log10, dtype=np.float64) * LN10

    def context_words(self, state: NgramState) -> list[str]:
        return list(state.context)

    def context_after(self, context: Sequence[str], word: str) -> tuple[str, ...]:
        """The context words of the state after ``word`` (those of :meth:`step`), without asking KenLM: what a decoder
        state token carries."""
        return self._context((*context, word))

    def state_from_context(self, words: list[str]) -> NgramState:
        """The state after ``words`` (as :meth:`context_words` gives them): KenLM's state depends on nothing older."""
        context = self._context(words)
        state = kenlm.State()
        at_start = context[:1] == (BOS,)
        (self.model.BeginSentenceWrite if at_start else self.model.NullContextWrite)(state)
        for word in context[1:] if at_start else context:
            state, previous = kenlm.State(), state
            self.model.BaseScore(previous, word, state)
        return NgramState(state, context)

    def _context(self, words) -> tuple[str, ...]:
        """The last ``order - 1`` of ``words`` (all of them when there are fewer: a negative start would cut a short
        history, such as ``<s>`` and one word at order 4, to its last words)."""
        return tuple(words)[max(0, len(words) - self.order + 1) :] if self.order > 1 else ()

    def state_bytes(self, state: NgramState) -> bytes:
        """The context words, UTF-8, space-separated: words are whitespace-split tokens, so this is unambiguous."""
        return " ".join(state.context).encode("utf-8")

    def state_from_bytes(self, data: bytes) -> NgramState:
        try:
            return self.state_from_context(data.decode("utf-8").split())
        except UnicodeDecodeError as e:
            raise ValueError(f"n-gram state: not valid UTF-8 ({e.reason} at byte {e.start})") from e


def find_program(name: str) -> Path:
    """KenLM's ``lmplz`` or ``build_binary``: in ``$LMSERVE_KENLM_BIN``, then on PATH, then (in a source checkout
    only) in its ``.cache/kenlm/bin`` (``make kenlm``)."""
    env = os.environ.get(KENLM_BIN_ENV)
    if env:
        program = Path(env) / name
        if program.is_file() and os.access(program, os.X_OK):
            return program
        raise FileNotFoundError(
            f"${KENLM_BIN_ENV} = {env}: no executable {name} there (`lm-rescore ngram install-tools --dest {env}` "
            "builds lmplz and build_binary into it)"
        )
    found = shutil.which(name)
    if found:
        return Path(found)
    checkout = source_checkout()
    if checkout and (checkout / ".cache" / "kenlm" / "bin" / name).is_file():
        return checkout / ".cache" / "kenlm" / "bin" / name
    raise FileNotFoundError(
        f"KenLM's {name} is not on PATH and ${KENLM_BIN_ENV} is not set: build lmplz and build_binary with "
        f"`lm-rescore ngram install-tools --dest DIR` (needs cmake, a C++ compiler and the boost, zlib, bz2 and lzma "
        f"headers), then set {KENLM_BIN_ENV}=DIR or put DIR on PATH"
    )


def build_ngram(
    sentences: Iterable[list[str]],
    order: int,
    out: str | Path,
    prune: list[int] | None = None,
    binary: bool = True,
    lmplz: str | Path | None = None,
    build_binary: str | Path | None = None,
    discount_fallback: bool = False,
    memory: str = "1G",
) -> dict:
    """Estimate a modified Kneser-Ney ``order``-gram with lmplz from tokenised sentences; write ``OUT.arpa`` and, with
    ``binary``, ``OUT.bin`` (``out`` may end in .arpa or .bin). Files appear complete or not at all.

    ``prune`` is lmplz's: a count threshold per order, 0 first, non-decreasing (``[0, 1, 1]`` drops singleton bigrams
    and trigrams). ``memory`` is lmplz's sort memory (``-S``): its own default, 80% of RAM, starves other jobs.

    ``discount_fallback`` is off unless asked for: lmplz estimates the discounts from counts of counts, and on small or
    artificial text some are zero; the fixed fallback discounts then give a usable but worse model, which a user
    should choose knowingly. The error says how.
    """
    if order < 1:
        raise ValueError(f"n-gram order must be at least 1, got {order}")
    if prune and (len(prune) > order or prune[0] != 0 or any(b < a for a, b in zip(prune, prune[1:], strict=False))):
        raise ValueError(f"prune {prune}: expected at most {order} counts, starting at 0 and never decreasing")
    arpa, model_bin = model_files(out)
    lmplz = Path(lmplz) if lmplz else find_program("lmplz")
    build_binary = Path(build_binary) if build_binary else (find_program("build_binary") if binary else None)
    arpa.parent.mkdir(parents=True, exist_ok=True)

    command = [str(lmplz), "-o", str(order), "-S", memory]
    if prune:
        command += ["--prune", *map(str, prune)]
    if discount_fallback:
        command.append("--discount_fallback")
    # lmplz's sort files go beside the model, where the space is, in a folder of their own: lmplz leaves them
    # behind when it aborts
    with tempfile.TemporaryDirectory(prefix=".lmplz-", dir=arpa.parent) as scratch:
        counts = _run_lmplz([*command, "-T", scratch + os.sep], sentences, arpa)
    info = {"arpa": str(arpa), "binary": None, "order": order, "prune": prune, "discount_fallback": discount_fallback}
    info.update(counts)
    if binary:
        with _temporary(model_bin) as tmp:
            _run([str(build_binary), str(arpa), str(tmp)])
        info["binary"] = str(model_bin)
    return info


def model_files(out: str | Path) -> tuple[Path, Path]:
    """The ARPA and binary files :func:`build_ngram` writes for ``out`` (a name with or without .arpa or .bin)."""
    out = Path(out)
    base = out.with_suffix("") if out.suffix in (".arpa", ".bin") else out
    return base.with_name(base.name + ".arpa"), base.with_name(base.name + ".bin")


def _run_lmplz(command: list[str], sentences: Iterable[list[str]], arpa: Path) -> dict:
    """Pipe the sentences, one line each, into lmplz; its ARPA goes to a temporary file renamed at the end."""
    n_sentences = n_tokens = n_unk = 0
    with _temporary(arpa) as tmp:
        with open(tmp, "wb") as stdout, tempfile.TemporaryFile() as stderr:
            proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=stdout, stderr=stderr)
            try:
                for words in sentences:
                    line = " ".join(words)
                    if "\x01" in line:
                        raise ValueError(
                            f"sentence {n_sentences + 1}: a word contains \\x01, which marks <unk> for lmplz"
                        )
                    if UNK in words:
                        n_unk += words.count(UNK)
                        line = " ".join(UNK_STANDIN if w == UNK else w for w in words)
                    proc.stdin.write((line + "\n").encode("utf-8"))
                    n_sentences += 1
                    n_tokens += len(words)
                proc.stdin.close()
            except BrokenPipeError:
                pass  # lmplz stopped reading: its exit status and stderr below say why
            except BaseException:  # the sentences failed (a bad file, Ctrl-C): leave no lmplz waiting for input
                proc.kill()
                proc.wait()
                raise
            if proc.wait() != 0:
                stderr.seek(0)
                _raise_failure(command, proc.returncode, stderr.read().decode("utf-8", "replace"))
        if n_unk:
            with _temporary(tmp) as merged:
                _merge_unk(tmp, merged)
    return {"sentences": n_sentences, "tokens": n_tokens, "unk_tokens": n_unk, "ngrams": _arpa_counts(arpa)}


def _merge_unk(src: Path, dst: Path) -> None:
    """Rename the stand-in to ``<unk>``, which then stands for it and for lmplz's ``<unk>`` (the mass lmplz keeps for
    unseen words) together: each n-gram ``h <stand-in>`` gets lmplz's p(<unk> | h) added, as the raw model computes it
    (backed off down to the unigram), and lmplz's ``<unk>`` unigram goes. Every context's distribution then still
    sums to one, which per-word interpolation with the neural LM needs."""
    raw = NgramLM(src)
    ends_in_standin = (f"{UNK_STANDIN}\t", f"{UNK_STANDIN}\n")
    with open(src, encoding="utf-8") as f, open(dst, "w", encoding="utf-8") as out:
        for line in f:
            if line.startswith("ngram 1="):
                line = f"ngram 1={int(line.split('=')[1]) - 1}\n"
            elif f"\t{UNK}\t" in line or line.endswith(f"\t{UNK}\n"):
                continue  # lmplz's <unk>: a unigram only, it never occurs in the text
            elif any(end in line for end in ends_in_standin):
                fields = line.rstrip("\n").split("\t")
                words = fields[1].split(" ")
                if words[-1] == UNK_STANDIN:
                    unseen = raw.model.BaseScore(raw.state_from_context(words[:-1]).kenlm, UNK, kenlm.State())
                    fields[0] = f"{math.log10(10 ** float(fields[0]) + 10**unseen):.8g}"
                    line = "\t".join(fields) + "\n"
            out.write(line.replace(UNK_STANDIN, UNK))


def _raise_failure(command: list[str], code: int, stderr: str):
    hint = ""
    if "BadDiscountException" in stderr:
        hint = (
            "\nThe text is too small or too artificial to estimate Kneser-Ney discounts; rerun with "
            "discount_fallback=True (lm-rescore ngram build --discount-fallback) to use fixed ones."
        )
    tail = "\n".join(stderr.strip().splitlines()[-8:])
    status = f"signal {-code}" if code < 0 else f"exit status {code}"
    raise NgramError(f"{' '.join(command)} failed ({status}):\n{tail}{hint}")


def _run(command: list[str]) -> None:
    proc = subprocess.run(command, capture_output=True, text=True, errors="replace")
    if proc.returncode != 0:
        _raise_failure(command, proc.returncode, proc.stderr)


def _arpa_counts(arpa: Path) -> list[int]:
    """The ``ngram N=count`` lines of the ARPA header."""
    counts = []
    with open(arpa, encoding="utf-8") as f:
        for line in f:
            if line.startswith("ngram "):
                counts.append(int(line.split("=")[1]))
            elif line.startswith("\\1-grams:"):
                break
    return counts


@contextmanager
def _temporary(path: Path) -> Iterator[Path]:
    """A fresh name beside ``path``, renamed onto it on success and removed on failure: readers never see half a
    model. The programs create the file, so it gets the usual permissions."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
