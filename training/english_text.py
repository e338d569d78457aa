"""The shared ``english-text`` folder (TED talks, task dialogues, British conversation, Reuters) -> LM sentences.

Two forms (``FORMS``):

- ``librispeech``, for the general English LM that rescores ASR lists (HyPoradise: lower case, no punctuation): every
  ASR scorer normalises its input to LibriSpeech form (upper-case A-Z words, in-word apostrophes, ``core.textnorm``
  preset ``librispeech``), so this text is written in that form too, by the same function as the Gutenberg books
  (``training.gutenberg.normalize_librispeech``; sentences with digits are dropped, as there).
- ``written``, for the MT LM (issue 51, item 4): MT output is cased and punctuated, and BLEU and chrF see both, so
  this form keeps the text as written (NFKC, single spaces, digits kept); only CHAT's spaces before punctuation go.
  TED's subtitles have neither case nor punctuation, so this form is made from the other three sources
  (``WRITTEN_SOURCES``).

The four files differ in how they hold text (data README, section 10), so each has its own splitter:

- ``ted``: subtitle lines of a talk; the talk is one paragraph, split into sentences at . ! ? (many talks have no
  punctuation at all: their "sentences" are cut into pieces of at most ``MAX_WORDS`` words before normalisation);
- ``reuters``: wrapped article lines, one paragraph per article, split the same way;
- ``sgd``: one dialogue turn per line, each split into sentences;
- ``cabnc``: one conversational turn per line in CHAT tokenisation ("do n't", "gon na"), joined back to written
  form ("don't", "gonna"); turns that are only a code ("0 .", "xxx") are dropped.

Documents (a paragraph of the file: a talk, a dialogue, an article, a recording) go whole to train, valid or test by
their sha256 (about 0.4% each to valid and test), so no held-out sentence shares a document with training text.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
import sys
import unicodedata
from pathlib import Path

from lmserve.core.atomic import atomic_write_bytes
from lmserve.training.gutenberg import SPLITS, normalize_librispeech, paragraphs, split_sentences

SOURCES = ("ted", "sgd", "cabnc", "reuters")
WRITTEN_SOURCES = ("sgd", "cabnc", "reuters")
MAX_WORDS = 50  # longer unpunctuated runs are cut into pieces of at most this many words
HELD_OUT_PER_MILLE = 4  # documents to valid, and as many to test, per thousand
_CHAT_CLITIC = re.compile(r" (n't|'(?:s|re|ve|m|ll|d))\b", re.IGNORECASE)
_CHAT_SPLIT = re.compile(r"\b(gon|wan|got) (na|ta)\b", re.IGNORECASE)
_CHAT_CODE = re.compile(r"^(?:0|x+|y+|w+)$", re.IGNORECASE)
_SPACED_PUNCTUATION = re.compile(r" +([.,!?;:])(?= |$)")


def documents(text: str) -> list[list[str]]:
    """The file's documents (blank-line separated), each as its non-empty lines."""
    return [
        lines
        for block in re.split(r"\n[ \t]*\n", text)
        if (lines := [x.strip() for x in block.splitlines() if x.strip()])
    ]


def chat_words(turn: str) -> str:
    """CHAT's split words joined back: "do n't" -> "don't", "it 's" -> "it's", "gon na" -> "gonna"."""
    return _CHAT_SPLIT.sub(r"\1\2", _CHAT_CLITIC.sub(r"\1", turn))


def join_stops(turn: str) -> str:
    """CHAT's spaces before punctuation dropped: "lunch ." -> "lunch."."""
    return _SPACED_PUNCTUATION.sub(r"\1", turn)


def normalize_written(sentence: str) -> str:
    """A sentence as written, in one Unicode form (NFKC) with single spaces: the ``written`` form."""
    return " ".join(unicodedata.normalize("NFKC", sentence).split())


FORMS = {"librispeech": normalize_librispeech, "written": normalize_written}


def raw_sentences(source: str, document: list[str]) -> list[str]:
    """A document's sentences before normalisation, by the source's layout (module docstring)."""
    if source in ("ted", "reuters"):
        return [s for paragraph in paragraphs(" ".join(document)) for s in split_sentences(paragraph)]
    if source == "cabnc":
        # a turn of codes and punctuation only is dropped, judged on its CHAT tokens ("yeah ." keeps its word)
        turns = [chat_words(t) for t in document]
        kept = [t for t in turns if not all(_CHAT_CODE.match(w) or not w.isalnum() for w in t.split())]
        return [join_stops(t) for t in kept]
    return [s for turn in document for s in split_sentences(turn)]


def pieces(sentence: str) -> list[str]:
    """A sentence cut into runs of at most ``MAX_WORDS`` words (unpunctuated talks), before normalisation, so that a
    digit drops only its piece, not a whole talk."""
    words = sentence.split()
    return [" ".join(words[i : i + MAX_WORDS]) for i in range(0, len(words), MAX_WORDS)]


def split_of(document: list[str]) -> str:
    digest = int(hashlib.sha256("\n".join(document).encode("utf-8")).hexdigest()[:8], 16) % 1000
    return "valid" if digest < HELD_OUT_PER_MILLE else "test" if digest < 2 * HELD_OUT_PER_MILLE else "train"


def prepare_english_text(
    data_dir: Path, out_dir: Path, sources: tuple[str, ...] | None = None, form: str = "librispeech"
) -> dict:
    """Write ``out_dir/{train,valid,test}.txt.gz`` (sentences in ``form``, one a line, the sources in the order given;
    by default every source the form can use) and ``prepare.json`` (per source and split: documents, sentences,
    words; dropped digit sentences)."""
    data_dir, out_dir = Path(data_dir), Path(out_dir)
    if form not in FORMS:
        raise ValueError(f"unknown english-text form {form!r}; expected one of {', '.join(FORMS)}")
    sources = sources or (WRITTEN_SOURCES if form == "written" else SOURCES)
    unknown = [s for s in sources if s not in SOURCES]
    if unknown:
        raise ValueError(f"unknown english-text source {unknown[0]!r}; expected some of {', '.join(SOURCES)}")
    normalize = FORMS[form]
    lines: dict[str, list[str]] = {split: [] for split in SPLITS}
    counts: dict[str, dict] = {}
    for source in sources:
        path = data_dir / f"{source}.txt.gz"
        if not path.is_file():
            raise ValueError(f"{path}: not found; expected the english-text folder of the shared data (README §10)")
        try:
            text = gzip.decompress(path.read_bytes()).decode("utf-8")
        except (OSError, EOFError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: cannot read gzipped UTF-8 text: {e}") from e
        stats = {split: {"documents": 0, "sentences": 0, "words": 0} for split in SPLITS}
        digits = 0
        for document in documents(text):
            split = split_of(document)
            stats[split]["documents"] += 1
            for raw in (piece for sentence in raw_sentences(source, document) for piece in pieces(sentence)):
                normalised = normalize(raw)
                if normalised is None:
                    digits += 1
                elif normalised:
                    lines[split].append(normalised)
                    stats[split]["sentences"] += 1
                    stats[split]["words"] += len(normalised.split())
        counts[source] = {**stats, "dropped_digit_sentences": digits}
        print(f"{path}: {stats['train']['words']:,} training words", file=sys.stderr)
    info = {
        "data_dir": str(data_dir.resolve()),
        "sources": list(sources),
        "form": form,
        "holdout": f"documents by sha256: {HELD_OUT_PER_MILLE}/1000 to valid, {HELD_OUT_PER_MILLE}/1000 to test",
        "counts": counts,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    for split in SPLITS:
        payload = "".join(line + "\n" for line in lines[split]).encode("utf-8")
        atomic_write_bytes(out_dir / f"{split}.txt.gz", gzip.compress(payload, compresslevel=6, mtime=0))
    atomic_write_bytes(out_dir / "prepare.json", (json.dumps(info, indent=2) + "\n").encode("utf-8"))
    return info
