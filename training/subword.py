"""Open vocabulary: words spelled as sentencepiece pieces (``vocab.type = "subword"``).

``lm-train prepare`` trains a sentencepiece model (unigram or BPE) on the training split's word counts and encodes
every word as its pieces, one word at a time, so that a word's pieces never cross a word boundary and a word's
log-probability is the sum of its pieces' (the scorer reads the same model from the bundle and splits words the same
way). The model is trained with ``byte_fallback``: a character it never saw is spelled in UTF-8 byte pieces, so every
word has a spelling and nothing is out of vocabulary (only the data's own ``<unk>`` token, which stays ``<unk>``), and
with the ``identity`` normalisation: the pieces of a word concatenate to "▁" + the word.

The LM's vocabulary lists the pieces: ids 0, 1, 2 are <unk>, <s>, </s> (sentencepiece's own ids of its unknown and
control symbols), then every other piece of the model by descending training count, as for words.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import sentencepiece as spm

from lmserve.training.vocab import BOS, EOS, VocabError, Vocabulary

MODEL_FILE = "subword.model"
MODEL_TYPES = ("unigram", "bpe")
TRAINING_WORDS = 200_000  # the most frequent distinct training words (with their counts) sentencepiece learns from:
# unigram training took 8.5 s and 544 MB on Gutenberg's 65,793 (BPE 0.7 s, 58 MB), and grows with the words given


def train_model(word_counts: Mapping[str, int], pieces: int, model_type: str, path: Path, scratch: Path) -> dict:
    """Learn a ``pieces``-piece model from word counts (at most ``TRAINING_WORDS`` distinct words, the most frequent)
    and write it to ``path``; returns what it was trained on."""
    if model_type not in MODEL_TYPES:
        raise ValueError(f"vocab.subword_model = {model_type!r}: expected one of {', '.join(MODEL_TYPES)}")
    words = sorted(word_counts, key=lambda w: (-word_counts[w], w))[:TRAINING_WORDS]
    tsv = scratch / ".subword-words.tsv"
    tsv.write_text("".join(f"{w}\t{word_counts[w]}\n" for w in words), encoding="utf-8")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        input=str(tsv),
        input_format="tsv",
        model_writer=model,
        model_type=model_type,
        vocab_size=pieces,
        hard_vocab_limit=False,  # a small corpus may not have ``pieces`` pieces: take what it has
        byte_fallback=True,
        character_coverage=1.0,
        normalization_rule_name="identity",
        unk_id=Vocabulary.unk_id,
        bos_id=Vocabulary.bos_id,
        eos_id=Vocabulary.eos_id,
        pad_id=-1,
        unk_piece="<unk>",
        bos_piece=BOS,
        eos_piece=EOS,
        num_threads=1,
        minloglevel=2,
    )
    tsv.unlink()
    path.write_bytes(model.getvalue())
    return {"model_type": model_type, "pieces_asked": pieces, "distinct_words": len(words)}


class WordSpeller:
    """Words -> piece ids of a sentencepiece model (its own ids, before the vocabulary's frequency order)."""

    def __init__(self, path: Path, unk: str):
        self.processor = spm.SentencePieceProcessor(model_file=str(path))
        self.unk = unk

    def spell(self, words: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """All words' pieces one after another, and each word's number of pieces. The data's ``unk`` word is the
        one piece <unk>."""
        spelled = self.processor.encode(words)
        pieces = [[Vocabulary.unk_id] if w == self.unk else p for w, p in zip(words, spelled, strict=True)]
        lengths = np.fromiter(map(len, pieces), dtype=np.int64, count=len(pieces))
        flat = np.fromiter((i for p in pieces for i in p), dtype=np.int64, count=int(lengths.sum()))
        return flat, lengths

    def vocabulary_map(self, vocab: Vocabulary, where: Path) -> np.ndarray:
        """Model id -> id in ``vocab``, which must list exactly the model's pieces (``VocabError`` otherwise)."""
        sp = self.processor
        pieces = [sp.id_to_piece(i) for i in range(3, sp.get_piece_size())]
        missing = [p for p in pieces if p not in vocab.index]
        if missing or len(pieces) + 3 != len(vocab):
            raise VocabError(
                f"{where}: the sentencepiece model has {len(pieces) + 3} pieces, the vocabulary {len(vocab)}"
                + (f"; it lacks {missing[:5]}" if missing else "")
                + ": the model and the vocabulary come from different prepared datasets"
            )
        return np.array([0, 1, 2, *(vocab.index[p] for p in pieces)], dtype=np.int64)

    def vocabulary(self, piece_counts: np.ndarray, num_sentences: int, unk: str) -> tuple[Vocabulary, np.ndarray]:
        """The LM vocabulary (every piece of the model, by descending count) and the map model id -> vocabulary id."""
        sp = self.processor
        size = sp.get_piece_size()
        counts = np.zeros(size, dtype=np.int64)
        counts[: len(piece_counts)] = piece_counts[:size]
        others = sorted(range(3, size), key=lambda i: (-counts[i], i))
        to_vocab = np.zeros(size, dtype=np.int64)
        to_vocab[[0, 1, 2, *others]] = np.arange(size)
        tokens = [unk, BOS, EOS, *(sp.id_to_piece(i) for i in others)]
        vocab = Vocabulary(tokens, [int(counts[0]), num_sentences, num_sentences, *(int(counts[i]) for i in others)])
        return vocab, to_vocab


def per_word(result, corpus) -> dict:
    """Perplexity per word of a subword model's ``EvalResult`` on ``corpus``: the same total log-probability (a
    word's is the sum of its pieces') over the text's words and </s> instead of its pieces and </s>, so that it
    compares with word models. Nothing is out of vocabulary (byte pieces spell any word), so every word counts; only
    the text's own <unk> tokens are scored as <unk> (and counted in ``oov_rate``)."""
    words = corpus.text_words + corpus.num_sentences
    return {"words": words, "ppl_per_word": math.exp(math.log(result.ppl) * result.tokens / words)}


def checkpoint_subword_model(cfg, ckpt: Path) -> Path | None:
    """The sentencepiece model a subword checkpoint carries (``MODEL_FILE`` beside its weights), so that a checkpoint
    copied out of its run still evaluates and exports; None for a word vocabulary."""
    if cfg.vocab.type != "subword":
        return None
    model = Path(ckpt) / MODEL_FILE
    if not model.is_file():
        raise VocabError(f"{ckpt}: a subword checkpoint without its sentencepiece model {MODEL_FILE}")
    return model


def run_subword_model(cfg, run_dir: Path) -> Path | None:
    """The sentencepiece model of a subword run (a checkpoint's run is ``ckpt.parents[1]``): the one in the run's
    prepared training dataset (``data.train``, or ``RUN/data`` made from text files); None for a word vocabulary."""
    if cfg.vocab.type != "subword":
        return None
    from lmserve.training.prepared import open_dataset
    from lmserve.training.trainer import training_dataset

    dataset = training_dataset(cfg, Path(run_dir).resolve())
    model = open_dataset(dataset).subword_model
    if model is None:
        raise VocabError(f"{dataset}: vocab.type is subword, but this prepared dataset has a word vocabulary")
    return model
