"""Project Gutenberg books -> LibriSpeech-normalised LM corpus.

The LMs trained on this corpus rescore LibriSpeech n-best lists, so the text
must look like LibriSpeech transcripts (upper-case A-Z words, in-word
apostrophes, no punctuation, no digits, one sentence per line) and must not
contain Project Gutenberg's license boilerplate.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import json
import re
import sys
import unicodedata
from pathlib import Path

from lmserve.core.atomic import atomic_write_bytes

MANIFEST = "MANIFEST.tsv"
SPLITS = ("train", "valid", "test")

# Modern files: the book lies between "*** START OF ..." and "*** END OF ..."
# lines; a long title can wrap the marker over several lines up to its
# closing "***".
_START_MARKER = re.compile(
    r"^\*{3} ?START OF (?:THE|THIS) PROJECT GUTENBERG E-?BOOK[^*]*\*{3}[ \t]*$",
    re.MULTILINE | re.IGNORECASE,
)
_END_MARKER = re.compile(r"^\*{3} ?END OF (?:THE|THIS) PROJECT GUTENBERG E-?BOOK", re.MULTILINE | re.IGNORECASE)
# Some files repeat the footer title ("End of Project Gutenberg's Emma, ...")
# just before the END marker.
_END_CREDIT = re.compile(r"^End of (?:the )?Project Gutenberg", re.MULTILINE | re.IGNORECASE)
# Producer credits, PG notes and transcriber notes are not book text, nor
# are illustration captions; transcribers' "[...]" insertions can span lines.
_EDITORIAL_PARAGRAPH = re.compile(
    r"(?:produced by|e-?text prepared by|transcribed from|(?:text|html) file produced by"
    r"|note: project gutenberg|transcriber(?:['’]s)? notes?\b|extensive research did not uncover)",
    re.IGNORECASE,
)
_EDITORIAL_BRACKETS = re.compile(r"\[(?:illustration|picture|transcriber(?:['’]s)? note)[^\]]*\]", re.IGNORECASE)

# Early files (pg1778): the header ends with the "Small Print" version tag,
# the book ends at "End of this Etext ...", and <<THIS ELECTRONIC VERSION ...>>
# copyright notices are interleaved with the text.
_OLD_START = re.compile(r'^\["Small Print" V\.[\d.]+\][ \t]*$', re.MULTILINE)
_OLD_END = re.compile(r"^End of (?:this|the) Etext", re.MULTILINE | re.IGNORECASE)
_OLD_NOTICE = re.compile(r"<<.*?>>", re.DOTALL)

_BLANK_LINES = re.compile(r"\n[ \t]*\n")

# Sentence boundary candidates: terminal punctuation, closing quotes or
# brackets, whitespace. Whether it is a boundary depends on what follows.
_BOUNDARY = re.compile(r"[.!?][\"'”’)\]]*\s+")
_OPENERS = frozenset("\"'“‘([_")
# "Mr. Smith", "St. Paul", "J. M. Barrie", "U.S.A. Today": no boundary.
# "No." and the single letter "I." are left out on purpose: they end
# sentences far more often than they abbreviate "number" or an initial.
_ABBREVIATION = re.compile(
    r"(?:^|[\s(\[\"“‘]|(?<![A-Za-z])')"
    r"(?:Mr|Mrs|Ms|Messrs|Mme|Mlle|Dr|St|Prof|Rev|Hon|Capt|Col|Gen|Lt|Sgt|Maj|Gov"
    r"|Jr|Sr|Mt|Ft|Vol|Ch|Fig|vs|viz|cf|(?:[A-Za-z]\.)+[A-Za-z]|[A-HJ-Za-z])$"
)

_QUOTES = str.maketrans(
    {"‘": "'", "’": "'", "‛": "'", "′": "'", "`": "'", "“": '"', "”": '"', "„": '"', "‟": '"', "″": '"'}
)
# Ligatures NFKD does not decompose.
_LIGATURES = str.maketrans({"Æ": "AE", "Œ": "OE", "Ø": "O"})
_DIGIT = re.compile(r"\d")
_NOT_WORD_CHAR = re.compile(r"[^A-Z']+")
_STRAY_APOSTROPHE = re.compile(r"(?<![A-Z])'|'(?![A-Z])")


def strip_boilerplate(text: str) -> str:
    """Return only the book text, so no license or producer credit is trained on.

    Raises ValueError when neither the modern START/END markers nor the early
    "Small Print" style are found: guessing would leak license text.
    """
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    start = _START_MARKER.search(text)
    if start:
        end = _END_MARKER.search(text, start.end())
        if not end:
            raise ValueError("START marker without a matching END marker")
        body = text[start.end() : end.start()]
        credit = _END_CREDIT.search(body)
        if credit:
            body = body[: credit.start()]
        paragraphs = _BLANK_LINES.split(_EDITORIAL_BRACKETS.sub("", body))
        return "\n\n".join(p for p in paragraphs if not _EDITORIAL_PARAGRAPH.match(p.strip()))
    start = _OLD_START.search(text)
    end = _OLD_END.search(text, start.end()) if start else None
    if not end:
        raise ValueError("no recognisable Project Gutenberg header/footer markers")
    return _OLD_NOTICE.sub("", text[start.end() : end.start()])


def paragraphs(text: str) -> list[str]:
    """Undo hard wrapping: blank lines separate paragraphs, line breaks inside are spaces."""
    out = []
    for block in _BLANK_LINES.split(text.replace("\r\n", "\n")):
        joined = " ".join(block.split())
        if joined:
            out.append(joined)
    return out


def split_sentences(paragraph: str) -> list[str]:
    """Split at ., ! or ? followed by an upper-case letter or opening quote, except after abbreviations."""
    sentences, start = [], 0
    for m in _BOUNDARY.finditer(paragraph):
        following = paragraph[m.end() : m.end() + 1]
        if not (following.isupper() or following in _OPENERS):
            continue
        if paragraph[m.start()] == "." and _ABBREVIATION.search(paragraph[start : m.start()]):
            continue
        sentences.append(paragraph[start : m.end()].strip())
        start = m.end()
    tail = paragraph[start:].strip()
    if tail:
        sentences.append(tail)
    return sentences


def normalize_librispeech(sentence: str) -> str | None:
    """Map a sentence to LibriSpeech transcript form (A-Z, in-word apostrophes, single spaces).

    Returns None when the sentence contains a digit: LibriSpeech spells
    numbers out, and dropping such sentences is safer than guessing how.
    Accents are folded (CAFÉ -> CAFE) because LibriSpeech's alphabet is A-Z;
    letters of other scripts become spaces like punctuation.
    """
    text = unicodedata.normalize("NFKC", sentence)
    if _DIGIT.search(text):
        return None
    text = text.translate(_QUOTES).upper().translate(_LIGATURES)
    if not text.isascii():
        text = "".join(c for c in unicodedata.normalize("NFKD", text) if not unicodedata.combining(c))
    text = _NOT_WORD_CHAR.sub(" ", text)
    text = _STRAY_APOSTROPHE.sub(" ", text)
    return " ".join(text.split())


def book_sentences(text: str) -> tuple[list[str], int]:
    """Normalised sentences of one book's text (boilerplate already stripped), plus how many had digits."""
    kept, digit_sentences = [], 0
    for paragraph in paragraphs(text):
        for sentence in split_sentences(paragraph):
            normalised = normalize_librispeech(sentence)
            if normalised is None:
                digit_sentences += 1
            elif normalised:
                kept.append(normalised)
    return kept, digit_sentences


def holdout_split(files: list[str], valid_books: int, test_books: int) -> dict[str, list[str]]:
    """Assign whole books to splits by ranking file names by sha256.

    Hashing the name (rather than taking, say, the first books of a listing)
    makes the choice reproducible while spreading held-out books over authors
    and e-book numbers: the first `valid_books` names in sha256 order are
    validation, the next `test_books` are test, the rest train. Each split is
    returned in file-name order.
    """
    if valid_books < 0 or test_books < 0:
        raise ValueError(f"valid_books and test_books must be >= 0, got {valid_books}, {test_books}")
    if valid_books + test_books >= len(files):
        raise ValueError(f"holding out {valid_books}+{test_books} of {len(files)} books leaves none for training")
    ranked = sorted(files, key=lambda name: hashlib.sha256(name.encode("utf-8")).hexdigest())
    held = {"valid": ranked[:valid_books], "test": ranked[valid_books : valid_books + test_books]}
    held_out = set(held["valid"]) | set(held["test"])
    return {
        "train": sorted(f for f in files if f not in held_out),
        "valid": sorted(held["valid"]),
        "test": sorted(held["test"]),
    }


def read_manifest(path: Path) -> dict[str, dict[str, str]]:
    """Book metadata by file name; the manifest, not a directory listing, defines the corpus."""
    if not path.is_file():
        raise ValueError(f"manifest not found: {path}")
    with path.open(encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        missing = {"file", "pg_ebook_no", "title", "gz_sha256"} - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{path}: missing columns {sorted(missing)}")
        return {row["file"]: row for row in reader}


def _read_book(path: Path, expected_sha256: str) -> tuple[str, str]:
    """Decoded text and sha256 of one .txt.gz, refusing a file that differs from the manifest."""
    try:
        data = path.read_bytes()
    except OSError as e:  # (lm-train reports ValueErrors in one line)
        raise ValueError(f"{path}: cannot read this book of {MANIFEST} ({e.strerror})") from e
    digest = hashlib.sha256(data).hexdigest()
    if digest != expected_sha256:
        raise ValueError(f"{path}: sha256 {digest} does not match manifest {expected_sha256}")
    try:
        text = gzip.decompress(data).decode("utf-8")
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read gzipped UTF-8 text: {e}") from e
    return text, digest


def prepare_gutenberg(data_dir: Path, out_dir: Path, valid_books: int = 3, test_books: int = 3) -> dict:
    """Build train/valid/test.txt.gz and prepare.json from the books listed in data_dir's manifest.

    Outputs are byte-identical across runs (gzip mtime=0, no timestamps in
    prepare.json), so a changed file means changed data or code. A run over an
    output made from the same books and split settings does nothing (like
    ``lm-train prepare``): remove the output to make it again after a change
    to this code.
    """
    data_dir, out_dir = Path(data_dir), Path(out_dir)
    if not data_dir.is_dir():
        raise ValueError(f"Gutenberg data directory not found: {data_dir}")
    manifest_path = data_dir / MANIFEST
    manifest = read_manifest(manifest_path)
    assignment = holdout_split(sorted(manifest), valid_books, test_books)

    input_sha256 = {MANIFEST: hashlib.sha256(manifest_path.read_bytes()).hexdigest()}
    settings = {"data_dir": str(data_dir.resolve()), "valid_books": valid_books, "test_books": test_books}
    existing = _made_from(out_dir, data_dir, settings, input_sha256[MANIFEST])
    if existing is not None:
        print(f"{out_dir}: up to date (same books and settings); nothing to do", file=sys.stderr)
        return existing
    lines: dict[str, list[str]] = {}
    splits: dict[str, dict] = {}
    dropped_digits = 0
    for split in SPLITS:
        lines[split], books = [], []
        for name in assignment[split]:
            path = data_dir / name
            text, input_sha256[name] = _read_book(path, manifest[name]["gz_sha256"])
            try:
                body = strip_boilerplate(text)
            except ValueError as e:
                raise ValueError(f"{path}: {e}") from e
            sentences, digits = book_sentences(body)
            if not sentences:
                raise ValueError(f"{path}: no sentences left after normalisation")
            dropped_digits += digits
            lines[split].extend(sentences)
            books.append(
                {
                    "file": name,
                    "ebook": int(manifest[name]["pg_ebook_no"]),
                    "title": manifest[name]["title"],
                    "sentences": len(sentences),
                    "tokens": sum(len(s.split()) for s in sentences),
                }
            )
        splits[split] = {
            "books": books,
            "sentences": len(lines[split]),
            "tokens": sum(b["tokens"] for b in books),
        }

    info = {
        **settings,
        "holdout": "file names ranked by sha256(name); first valid_books -> valid, next test_books -> test",
        "splits": splits,
        "dropped_digit_sentences": dropped_digits,
        "input_sha256": dict(sorted(input_sha256.items())),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    for split in SPLITS:
        payload = "".join(line + "\n" for line in lines[split]).encode("utf-8")
        atomic_write_bytes(out_dir / f"{split}.txt.gz", gzip.compress(payload, compresslevel=9, mtime=0))
    atomic_write_bytes(
        out_dir / "prepare.json", (json.dumps(info, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
    )
    return info


def _made_from(out_dir: Path, data_dir: Path, settings: dict, manifest_sha256: str) -> dict | None:
    """The prepare.json of ``out_dir`` when its outputs are all there and were made with ``settings`` from the books
    that are in ``data_dir`` now (the manifest and every book hash as recorded), else None."""
    try:
        existing = json.loads((out_dir / "prepare.json").read_text(encoding="utf-8"))
        recorded = existing["input_sha256"]
        if (
            any(existing.get(key) != value for key, value in settings.items())
            or recorded.get(MANIFEST) != manifest_sha256
            or not all((out_dir / f"{split}.txt.gz").is_file() for split in SPLITS)
        ):
            return None
        for name, digest in recorded.items():
            if name != MANIFEST and hashlib.sha256((data_dir / name).read_bytes()).hexdigest() != digest:
                return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # no earlier output, or not one of ours: make it
    return existing
