"""Prepared datasets: a corpus tokenised once (``lm-train prepare``) and read by every run with ``np.memmap``.

Layout of a prepared dataset directory (format ``lmserve-prepared v1``):

- ``vocab.tsv``: the vocabulary with training counts (``training.vocab``'s format);
- ``SPLIT.ids.bin``: every token id of the split, sentence after sentence, no <s>/</s>; little-endian uint16 when the
  vocabulary has at most 65,536 entries, else uint32;
- ``SPLIT.offsets.bin``: little-endian int64, sentence i is ``ids[offsets[i]:offsets[i+1]]`` (num_sentences + 1);
- ``manifest.json``: the format, the vocabulary settings, each split's input files (path, size, mtime, sha256),
  sentences, words and OOV rate, and the size and sha256 of every file above.

A subword dataset (``VocabSettings.type = "subword"``, ``training.subword``) also holds ``subword.model``, the
sentencepiece model learnt from the training words (``vocab.subword`` in the manifest: file, sha256, model type,
pieces), its ``vocab.tsv`` lists the pieces, the ids are piece ids, sentence offsets count pieces, and each split
records ``pieces`` beside its (whitespace) ``words``.

Preparing streams the text in blocks through worker processes: each block comes back as ids into its own small key
list; the main process gives every new key a provisional id, writes the provisional ids to a spill file and adds up
counts. When all text is read, the vocabulary is cut from the training counts and the spill files are mapped to final
ids, chunk by chunk. Memory holds the distinct words and a few blocks, whatever the corpus size. The directory is
written beside its final place and renamed, and a second run on unchanged inputs (same paths, sizes and mtimes, same
settings) does nothing.
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from lmserve.core.atomic import replacing_folder
from lmserve.training.corpus import (
    BLOCK_BYTES,
    BlockIds,
    CorpusError,
    EncodedCorpus,
    TextBlock,
    encode_file,
    text_blocks,
    tokenise_block,
)
from lmserve.training.vocab import VocabError, Vocabulary

FORMAT = "lmserve-prepared v1"
MANIFEST = "manifest.json"
VOCAB = "vocab.tsv"
SPLITS = ("train", "valid", "test")
_CHUNK = 1 << 24  # ids mapped from provisional to final at a time (64 MB of uint32)


class PreparedDataError(CorpusError):
    """A prepared dataset is incomplete, corrupt or does not fit the run; the message names the file."""


@dataclass(frozen=True)
class VocabSettings:
    """How the vocabulary is made: cut from the training counts, or ``file`` (an existing vocabulary) as given."""

    min_count: int = 1
    max_size: int = 0
    unk: str = "<unk>"
    file: str = ""
    lowercase: bool = False
    type: str = "word"  # word | subword (``training.subword``: sentencepiece pieces; min_count/max_size unused)
    pieces: int = 8000  # subword: the sentencepiece model's size, specials and byte pieces included
    subword_model: str = "unigram"  # subword: unigram | bpe

    def to_dict(self) -> dict:
        settings = {
            "min_count": self.min_count,
            "max_size": self.max_size,
            "unk": self.unk,
            "file": self.file and str(Path(self.file).resolve()),
            "lowercase": self.lowercase,
        }
        if self.type != "word":  # word datasets keep the manifest they had before subwords existed
            settings |= {"type": self.type, "pieces": self.pieces, "subword_model": self.subword_model}
        return settings


def id_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def _input_fingerprint(path: Path) -> dict:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    stat = path.stat()
    return {
        "path": str(path.resolve()),
        "bytes": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "sha256": digest.hexdigest(),
    }


def _same_inputs(recorded: list[dict], paths: list[Path]) -> bool:
    if len(recorded) != len(paths):
        return False
    for fp, path in zip(recorded, paths, strict=True):
        stat = path.stat()
        if (fp["path"], fp["bytes"], fp["mtime_ns"]) != (str(path.resolve()), stat.st_size, stat.st_mtime_ns):
            return False
    return True


class _ProvisionalVocab:
    """Every distinct token met so far, numbered in first-seen order, with its count in the training split."""

    def __init__(self):
        self.index: dict[bytes, int] = {}
        self.train_counts = np.zeros(1 << 16, dtype=np.int64)

    def add(self, part: BlockIds, training: bool) -> np.ndarray:
        """The block's ids as provisional ids (uint32)."""
        index = self.index
        ids = np.fromiter((index.setdefault(k, len(index)) for k in part.keys), np.int64, len(part.keys))
        if training:
            if len(index) > len(self.train_counts):
                grown = np.zeros(max(len(index), 2 * len(self.train_counts)), dtype=np.int64)
                grown[: len(self.train_counts)] = self.train_counts
                self.train_counts = grown
            self.train_counts[ids] += part.counts
        return ids.astype(np.uint32)[part.ids]

    def counts(self) -> dict[str, int]:
        counts, seen = self.train_counts, len(self.train_counts)
        return {k.decode("utf-8"): int(counts[i]) for k, i in self.index.items() if i < seen and counts[i]}

    def final_ids(self, vocab: Vocabulary) -> np.ndarray:
        """Provisional id -> vocabulary id (<unk> for tokens the vocabulary lacks)."""
        lookup, unk = vocab.index, vocab.unk_id
        return np.fromiter((lookup.get(k.decode("utf-8"), unk) for k in self.index), np.int64, len(self.index))


def _tokenised(blocks: Iterator[TextBlock], workers: int) -> Iterator[BlockIds]:
    """``tokenise_block`` over ``blocks`` in order, by ``workers`` processes (0: in this one), at most two blocks per
    worker in flight so that memory stays bounded however fast the text is read."""
    if workers == 0:
        yield from map(tokenise_block, blocks)
        return
    with ProcessPoolExecutor(workers, mp_context=get_context("fork")) as pool:
        pending: deque = deque()
        try:
            for block in blocks:
                pending.append(pool.submit(tokenise_block, block))
                if len(pending) >= 2 * workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()


class _Sha256Writer:
    """A binary file written in pieces, with its sha256 and size kept as it grows."""

    def __init__(self, path: Path):
        self.path = path
        self.file = path.open("wb")
        self.digest = hashlib.sha256()
        self.bytes = 0

    def write(self, array: np.ndarray) -> None:
        data = array.tobytes()
        self.file.write(data)
        self.digest.update(data)
        self.bytes += len(data)

    def close(self) -> dict:
        self.file.close()
        return {"file": self.path.name, "bytes": self.bytes, "sha256": self.digest.hexdigest()}


def prepare(
    inputs: dict[str, list[str | Path]],
    out: str | Path,
    settings: VocabSettings = VocabSettings(),
    workers: int = 2,
    log=None,
    block_bytes: int = BLOCK_BYTES,
) -> dict:
    """Text files by split (``train`` required) -> a prepared dataset at ``out``; returns its manifest."""
    out, log = Path(out), log or sys.stderr
    unknown = set(inputs) - set(SPLITS)
    if unknown:
        raise ValueError(f"unknown split(s) {sorted(unknown)}: expected {', '.join(SPLITS)}")
    if not inputs.get("train"):
        raise ValueError("prepare needs the training text (--train FILE...)")
    if settings.type not in ("word", "subword"):
        raise ValueError(f"vocabulary type {settings.type!r}: expected word or subword")
    if settings.type == "subword" and settings.file:
        raise ValueError("a subword vocabulary is learnt by prepare from the training text: no vocabulary file with it")
    paths = {split: [Path(p) for p in inputs[split]] for split in SPLITS if inputs.get(split)}
    for split_paths in paths.values():
        for path in split_paths:
            if not path.is_file():
                raise CorpusError(f"{path}: file not found" if not path.exists() else f"{path}: not a regular file")
    existing = _read_manifest(out) if (out / MANIFEST).is_file() else None
    if (
        existing is not None
        and existing.get("vocab", {}).get("settings") == settings.to_dict()
        and set(existing.get("splits", {})) == set(paths)
        and all(_same_inputs(existing["splits"][s]["inputs"], p) for s, p in paths.items())
    ):
        print(f"{out}: up to date (same inputs and settings); nothing to do", file=log)
        return existing

    start = time.perf_counter()
    given = Vocabulary.load(settings.file) if settings.file else None
    provisional = _ProvisionalVocab()
    splits: dict[str, dict] = {}
    with replacing_folder(out) as tmp:
        for split, split_paths in paths.items():
            ids_spill = tmp / f".{split}.provisional"
            spill = ids_spill.open("wb")
            offsets = _Sha256Writer(tmp / f"{split}.offsets.bin")
            offsets.write(np.zeros(1, dtype="<i8"))
            words = sentences = 0
            for path in split_paths:
                blocks = text_blocks(path, settings.lowercase, block_bytes)
                for part in _tokenised(blocks, workers):
                    spill.write(provisional.add(part, training=split == "train").tobytes())
                    offsets.write((words + np.cumsum(part.lengths)).astype("<i8"))
                    words += len(part.ids)
                    sentences += len(part.lengths)
            spill.close()
            splits[split] = {
                "inputs": [_input_fingerprint(p) for p in split_paths],
                "sentences": sentences,
                "words": words,
                "offsets": offsets.close(),
            }
            print(f"{split}: {sentences:,} sentences, {words:,} words ({time.perf_counter() - start:.0f} s)", file=log)

        subword = {}
        if settings.type == "subword":
            vocab, spelling, subword = _subword_spelling(provisional, splits["train"]["sentences"], settings, tmp)
        else:
            vocab = given or Vocabulary.from_counts(
                provisional.counts(), splits["train"]["sentences"], settings.min_count, settings.max_size, settings.unk
            )
            spelling = _Spelling(provisional.final_ids(vocab))
        vocab.save(tmp / VOCAB)
        dtype = id_dtype(len(vocab))
        for split, info in splits.items():
            ids_spill = tmp / f".{split}.provisional"
            writer = _Sha256Writer(tmp / f"{split}.ids.bin")
            oov = 0
            piece_ends = []  # subword: pieces up to the end of each chunk's words, to move offsets from words to pieces
            with ids_spill.open("rb") as spill:
                while chunk := spill.read(4 * (_CHUNK // spelling.longest)):
                    ids, ends = spelling.ids(np.frombuffer(chunk, dtype=np.uint32))
                    oov += int(np.count_nonzero(ids == vocab.unk_id))
                    writer.write(ids.astype(dtype))
                    if ends is not None:
                        piece_ends.append(ends + (piece_ends[-1][-1] if piece_ends else 0))
            ids_spill.unlink()
            info.update(ids=writer.close(), oov=oov, oov_rate=oov / max(1, info["words"]))
            if settings.type == "subword":
                info["pieces"] = int(piece_ends[-1][-1]) if piece_ends else 0
                info["offsets"] = _piece_offsets(tmp / info["offsets"]["file"], piece_ends)
        manifest = {
            "format": FORMAT,
            "vocab": {
                "file": VOCAB,
                "size": len(vocab),
                "sha256": hashlib.sha256((tmp / VOCAB).read_bytes()).hexdigest(),
                "settings": settings.to_dict(),
                **subword,
            },
            "dtype": dtype.str,
            "splits": splits,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    seconds = time.perf_counter() - start
    total = sum(info["words"] for info in splits.values())
    print(
        f"wrote {out}: vocabulary {len(vocab):,}, {total:,} words in {seconds:.1f} s ({total / seconds:,.0f} words/s)",
        file=log,
    )
    return manifest


class _Spelling:
    """Provisional word id -> its final ids: one vocabulary id per word, or (subword) a run of piece ids."""

    def __init__(self, flat: np.ndarray, lengths: np.ndarray | None = None):
        self.flat, self.lengths = flat, lengths
        self.starts = None if lengths is None else np.cumsum(lengths) - lengths
        self.longest = 1 if lengths is None or not len(lengths) else max(1, int(lengths.max()))

    def ids(self, provisional: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """The words' ids, and (subword) the running number of pieces at the end of each word."""
        if self.lengths is None:
            return self.flat[provisional], None
        lengths = self.lengths[provisional]
        ends = np.cumsum(lengths)
        within = np.arange(int(ends[-1]) if len(ends) else 0) - np.repeat(ends - lengths, lengths)
        return self.flat[np.repeat(self.starts[provisional], lengths) + within], ends


def _subword_spelling(
    provisional: _ProvisionalVocab, num_sentences: int, settings: VocabSettings, tmp: Path
) -> tuple[Vocabulary, _Spelling, dict]:
    """Train the sentencepiece model on the training split's word counts, spell every word met in any split, and
    order the pieces by their training count (``training.subword``)."""
    from lmserve.training import subword

    counts = provisional.counts()
    counts.pop(settings.unk, None)
    trained = subword.train_model(counts, settings.pieces, settings.subword_model, tmp / subword.MODEL_FILE, tmp)
    speller = subword.WordSpeller(tmp / subword.MODEL_FILE, settings.unk)
    flat, lengths = speller.spell([k.decode("utf-8") for k in provisional.index])
    train_counts = np.zeros(len(lengths), dtype=np.int64)
    seen = min(len(lengths), len(provisional.train_counts))
    train_counts[:seen] = provisional.train_counts[:seen]
    piece_counts = np.bincount(flat, weights=np.repeat(train_counts, lengths)).astype(np.int64)
    vocab, to_vocab = speller.vocabulary(piece_counts, num_sentences, settings.unk)
    model = tmp / subword.MODEL_FILE
    info = {
        "type": "subword",
        "subword": {
            "file": subword.MODEL_FILE,
            "sha256": hashlib.sha256(model.read_bytes()).hexdigest(),
            "pieces": len(vocab),
            **trained,
        },
    }
    return vocab, _Spelling(to_vocab[flat], lengths), info


def _piece_offsets(path: Path, piece_ends: list[np.ndarray]) -> dict:
    """Rewrite a split's sentence offsets, counted in words by the first pass, in pieces."""
    words = np.fromfile(path, dtype="<i8")
    ends = np.concatenate([np.zeros(1, dtype=np.int64), *piece_ends])
    writer = _Sha256Writer(path)
    writer.write(ends[words].astype("<i8"))
    return writer.close()


def _read_manifest(root: Path) -> dict:
    path = root / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise PreparedDataError(
            f"{root}: not a prepared dataset (no {MANIFEST}; make one with lm-train prepare)"
        ) from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PreparedDataError(f"{path}: not valid JSON: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise PreparedDataError(f"{path}: format is {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def is_prepared(path: str | Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


class PreparedDataset:
    """A prepared dataset opened for reading; every file's size and sha256 are checked against the manifest."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.manifest = _read_manifest(self.root)
        try:
            self.dtype = np.dtype(self.manifest["dtype"])
            self.splits: dict[str, dict] = self.manifest["splits"]
            recorded = [(VOCAB, None, self.manifest["vocab"]["sha256"])]
            if "subword" in self.manifest["vocab"]:
                model = self.manifest["vocab"]["subword"]
                recorded.append((model["file"], None, model["sha256"]))
            for info in self.splits.values():
                for kind in ("ids", "offsets"):
                    recorded.append((info[kind]["file"], info[kind]["bytes"], info[kind]["sha256"]))
        except (KeyError, TypeError) as e:
            raise PreparedDataError(f"{self.root / MANIFEST}: missing field {e}") from e
        for name, size, sha256 in recorded:
            _check_file(self.root / name, size, sha256)
        try:
            self.vocab = Vocabulary.load(self.root / VOCAB)
        except VocabError as e:
            raise PreparedDataError(str(e)) from e

    @property
    def lowercase(self) -> bool:
        return bool(self.manifest["vocab"]["settings"]["lowercase"])

    def split(self, name: str) -> EncodedCorpus:
        if name not in self.splits:
            raise PreparedDataError(f"{self.root}: has no {name!r} split (it has {', '.join(self.splits)})")
        info = self.splits[name]
        ids = np.memmap(self.root / info["ids"]["file"], dtype=self.dtype, mode="r")
        offsets = np.memmap(self.root / info["offsets"]["file"], dtype="<i8", mode="r")
        tokens = info.get("pieces", info["words"])
        if len(offsets) != info["sentences"] + 1 or len(ids) != tokens or offsets[-1] != len(ids):
            raise PreparedDataError(f"{self.root / info['ids']['file']}: does not match the manifest's counts")
        return EncodedCorpus(
            f"{self.root}:{name}", ids, offsets, int(info["oov"]), info["words"] if "pieces" in info else -1
        )

    @property
    def subword_model(self) -> Path | None:
        """The sentencepiece model of a subword dataset (``training.subword``), None for words."""
        model = self.manifest["vocab"].get("subword")
        return self.root / model["file"] if model else None


def _check_file(path: Path, size: int | None, sha256: str) -> None:
    try:
        actual_size = path.stat().st_size
    except FileNotFoundError as e:
        raise PreparedDataError(f"{path}: missing from the prepared dataset") from e
    if size is not None and actual_size != size:
        raise PreparedDataError(f"{path}: {actual_size} bytes, the manifest says {size} (truncated or replaced)")
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    if digest.hexdigest() != sha256:
        raise PreparedDataError(f"{path}: sha256 {digest.hexdigest()} does not match the manifest's {sha256}")


def encode_subword_file(path: str | Path, model: Path, vocab: Vocabulary, lowercase: bool = False) -> EncodedCorpus:
    """A text file's piece ids under a subword vocabulary (its sentencepiece ``model``), in memory, spelled word by
    word as ``prepare`` spells them; ``text_words`` counts the words."""
    from lmserve.training.subword import WordSpeller

    speller = WordSpeller(model, vocab.unk)
    to_vocab = speller.vocabulary_map(vocab, model)
    ids, lengths, words = [], [], 0
    for block in text_blocks(path, lowercase):
        part = tokenise_block(block)
        flat, spelled = speller.spell([k.decode("utf-8") for k in part.keys])
        pieces, ends = _Spelling(to_vocab[flat], spelled).ids(part.ids)
        ends = np.concatenate(([0], ends if ends is not None else []))
        ids.append(pieces)
        lengths.append(np.diff(ends[np.concatenate(([0], np.cumsum(part.lengths)))]))
        words += len(part.ids)
    array = np.concatenate(ids)
    offsets = np.concatenate(([0], np.cumsum(np.concatenate(lengths))))
    return EncodedCorpus(str(path), array, offsets, int((array == vocab.unk_id).sum()), words)


@functools.lru_cache(maxsize=8)
def _opened(root: str, manifest_mtime_ns: int) -> PreparedDataset:
    return PreparedDataset(root)


def open_dataset(root: str | Path) -> PreparedDataset:
    """``PreparedDataset(root)``, checked once per process (and again after the manifest is rewritten): a run opens
    its dataset for the vocabulary, for each split and for the subword model, and hashing gigabytes of ids each time
    would cost minutes."""
    root = Path(root).resolve()
    try:
        mtime = (root / MANIFEST).stat().st_mtime_ns
    except FileNotFoundError:
        mtime = 0  # PreparedDataset names the missing manifest
    return _opened(str(root), mtime)


def open_corpus(
    spec: str, default_split: str, vocab: Vocabulary | None, lowercase: bool, subword_model: Path | None = None
) -> EncodedCorpus:
    """A data path of a config or the command line as a corpus: a prepared dataset directory (its ``default_split``,
    or ``DIR:SPLIT``) read with ``np.memmap``, or a text file encoded in memory (into pieces of ``subword_model``
    when the vocabulary is a subword one). ``vocab`` None means the prepared dataset's own; otherwise a prepared
    dataset must have been made with exactly that vocabulary."""
    root, split = spec, default_split
    if not Path(spec).exists() and ":" in spec and is_prepared(spec.rsplit(":", 1)[0]):
        root, split = spec.rsplit(":", 1)
    if is_prepared(root):
        dataset = open_dataset(root)
        if vocab is not None and dataset.vocab.tokens != vocab.tokens:
            raise PreparedDataError(
                f"{Path(root) / VOCAB}: vocabulary mismatch: the dataset was prepared with another vocabulary than "
                f"this run's ({len(dataset.vocab)} vs {len(vocab)} entries); prepare it with --vocab of the run"
            )
        if dataset.lowercase != lowercase:
            raise PreparedDataError(
                f"{Path(root) / MANIFEST}: prepared with lowercase = {dataset.lowercase}, the run says {lowercase}"
            )
        return dataset.split(split)
    if vocab is None:
        raise PreparedDataError(f"{spec}: a text file needs a vocabulary (none given)")
    if subword_model is not None:
        return encode_subword_file(spec, subword_model, vocab, lowercase)
    return encode_file(spec, vocab, lowercase)


def summary_line(manifest: dict) -> str:
    parts = [f"{s}: {i['words']:,} words, OOV {100 * i['oov_rate']:.2f}%" for s, i in manifest["splits"].items()]
    return f"vocabulary {manifest['vocab']['size']:,} ({manifest['dtype']}); " + "; ".join(parts)
