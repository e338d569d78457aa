"""The two ways a corpus becomes batches of ``[T, B]`` (time-major) input and target ids.

- ``StreamBatches``: the corpus as one token stream (``</s>`` after every sentence) split into B parallel streams and
  cut into T-step chunks; the LSTM state is carried from one chunk to the next (Zaremba et al. 2014).
- ``SentenceBatches``: every sentence is ``<s> w1 .. wn </s>`` scored from a fresh state, as sentences are scored
  later when rescoring; sentences of similar length share a batch and padding is masked out of the loss.

Both are deterministic functions of (seed, epoch), so a run resumed mid-epoch sees exactly the batches it would have.

``train.batch_size`` is the *global* batch of one optimisation step. Under ``torchrun`` with W ranks and
``train.accumulate = K`` each step's batch is cut into W x K contiguous parts (stream columns, or sentences of similar
length): rank r trains on parts r, W + r, ..., one micro-batch after the other, and only builds those. Whatever W and
K, a step sees the same examples and (with the global loss denominator, see ``Trainer.step``) the same gradient.
Both read the corpus lazily, so a memory-mapped prepared dataset stays on disk until a batch needs it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from lmserve.training.corpus import EncodedCorpus


@dataclass
class Batch:
    inputs: torch.Tensor  # [T, B] int64
    targets: torch.Tensor  # [T, B] int64
    mask: torch.Tensor | None  # [T, B] bool, None when every position counts
    num_sequences: int

    def to(self, device: torch.device) -> Batch:
        """The batch on ``device`` (batches are built on the CPU; a GPU run moves each one as it trains on it)."""
        mask = None if self.mask is None else self.mask.to(device, non_blocking=True)
        return Batch(
            self.inputs.to(device, non_blocking=True),
            self.targets.to(device, non_blocking=True),
            mask,
            self.num_sequences,
        )

    @property
    def num_tokens(self) -> int:
        return self.targets.numel() if self.mask is None else int(self.mask.sum())

    def pin_memory(self) -> Batch:
        mask = None if self.mask is None else self.mask.pin_memory()
        return Batch(self.inputs.pin_memory(), self.targets.pin_memory(), mask, self.num_sequences)


def sentence_start_id(trained_mode: str, vocab) -> int:
    """What a model reads before a sentence's first word when it scores sentences one by one: ``<s>``, or ``</s>``
    for a model trained as a stream, which never read ``<s>`` (the bundle's "sentence_start", ``core.bundle``)."""
    return vocab.eos_id if trained_mode == "stream" else vocab.bos_id


class StreamBatches:
    """The stream is every sentence followed by ``</s>``; stream b of B is its b-th contiguous slice of ``steps``
    tokens. A batch's tokens are looked up from the sentence offsets, so no copy of the corpus is made."""

    carries_state = True

    def __init__(self, corpus: EncodedCorpus, eos_id: int, batch_size: int, bptt: int):
        self.corpus = corpus
        self.eos_id = eos_id
        self.steps = (corpus.num_words + corpus.num_sentences) // batch_size
        if self.steps < 2:
            raise ValueError(f"{corpus.path}: too short for {batch_size} streams")
        # stream position of each sentence's first token: the words before it plus one </s> per earlier sentence
        self.sentence_starts = np.asarray(corpus.offsets[:-1]) + np.arange(corpus.num_sentences)
        self.bptt = bptt
        self.batch_size = batch_size
        self.starts = list(range(0, self.steps - 1, bptt))

    def num_batches(self, epoch: int = 0, parts: int = 1) -> int:
        return len(self.starts)

    def _tokens(self, positions: np.ndarray) -> np.ndarray:
        sentence = np.searchsorted(self.sentence_starts, positions, side="right") - 1
        word = positions - sentence  # the word's index in ids, unless the position is the sentence's </s>
        is_eos = positions == np.asarray(self.corpus.offsets)[sentence + 1] + sentence
        ids = self.corpus.ids[np.minimum(word, self.corpus.num_words - 1)] if self.corpus.num_words else 0
        return np.where(is_eos, self.eos_id, ids).astype(np.int64)

    def _batch(self, i: int, columns: np.ndarray) -> Batch:
        t = min(self.bptt, self.steps - 1 - i)
        positions = columns[None, :] * self.steps + i + np.arange(t + 1)[:, None]
        tokens = torch.from_numpy(self._tokens(positions))
        return Batch(tokens[:-1], tokens[1:], None, len(columns))

    def steps_of(self, epoch: int = 0, start: int = 0, rank: int = 0, world: int = 1, accumulate: int = 1):
        """Each step's micro-batches for ``rank``: its share of the B streams, in ``accumulate`` parts."""
        parts = np.array_split(np.arange(self.batch_size), world * accumulate)
        mine = [parts[k * world + rank] for k in range(accumulate)]
        for i in self.starts[start:]:
            yield [self._batch(i, columns) for columns in mine]

    def batches(self, epoch: int = 0, start: int = 0) -> Iterator[Batch]:
        for (batch,) in self.steps_of(epoch, start):
            yield batch

    def eval_batches(self, rank: int = 0, world: int = 1) -> Iterator[Batch]:
        """Rank ``rank``'s streams of every batch (state carries from one to the next, so streams are shared out)."""
        columns = np.array_split(np.arange(self.batch_size), world)[rank]
        if len(columns):
            for i in self.starts:
                yield self._batch(i, columns)


class SentenceBatches:
    carries_state = False

    def __init__(
        self,
        corpus: EncodedCorpus,
        bos_id: int,
        eos_id: int,
        batch_size: int,
        *,
        shuffle: bool,
        seed: int = 0,
        max_len: int = 0,
    ):
        self.corpus = corpus
        self.bos_id, self.eos_id = bos_id, eos_id
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        # 4 bytes a sentence for lengths and for the kept sentences' indices, and a plan that is one array of them
        # and one of batch bounds: at a billion words (50M sentences) a list of index arrays would cost gigabytes
        lengths = np.empty(corpus.num_sentences, dtype=np.int32)
        for i in range(0, corpus.num_sentences, 1 << 22):
            lengths[i : i + (1 << 22)] = np.diff(corpus.offsets[i : i + (1 << 22) + 1])
        keep = lengths <= max_len if max_len else np.ones(len(lengths), dtype=bool)
        self.indices = np.flatnonzero(keep).astype(np.int32)
        self.skipped = int((~keep).sum())
        self.lengths = lengths

    def _plan(self, epoch: int, parts: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """Shuffle, sort by length within buckets of 50 batches, cut into batches, shuffle the batches; a last batch
        too small to give each of ``parts`` a sentence is left out of the epoch. Returns the sentence order and the
        ``[start, end)`` bounds of each batch in it, in the epoch's batch order."""
        size = self.batch_size
        starts = np.arange(0, len(self.indices), size)
        bounds = np.stack([starts, np.minimum(starts + size, len(self.indices))], axis=1)
        if not self.shuffle:
            return self.indices[np.argsort(self.lengths[self.indices], kind="stable")], bounds
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(self.indices)
        bucket = 50 * size
        for i in range(0, len(order), bucket):
            chunk = order[i : i + bucket]
            order[i : i + bucket] = chunk[np.argsort(self.lengths[chunk], kind="stable")]
        bounds = bounds[rng.permutation(len(bounds))]
        return order, bounds[bounds[:, 1] - bounds[:, 0] >= parts]

    def num_batches(self, epoch: int = 0, parts: int = 1) -> int:
        full, rest = divmod(len(self.indices), self.batch_size)
        return full + (rest >= parts if rest else 0)

    def steps_of(self, epoch: int = 0, start: int = 0, rank: int = 0, world: int = 1, accumulate: int = 1):
        """Each step's micro-batches for ``rank``: contiguous runs of the step's length-sorted sentences."""
        order, bounds = self._plan(epoch, world * accumulate)
        for lo, hi in bounds[start:]:
            members = order[lo:hi]
            parts = np.array_split(members, world * accumulate)
            yield [self.make_batch(parts[k * world + rank]) for k in range(accumulate)]

    def batches(self, epoch: int = 0, start: int = 0) -> Iterator[Batch]:
        for (batch,) in self.steps_of(epoch, start):
            yield batch

    def eval_batches(self, rank: int = 0, world: int = 1) -> Iterator[Batch]:
        """Every ``world``-th batch from ``rank`` on."""
        order, bounds = self._plan(0)
        for lo, hi in bounds[rank::world]:
            yield self.make_batch(order[lo:hi])

    def make_batch(self, members: np.ndarray) -> Batch:
        lengths = self.lengths[members] + 1  # one prediction per word plus </s>
        steps = int(lengths.max())
        inputs = np.full((steps, len(members)), self.eos_id, dtype=np.int64)
        targets = np.full((steps, len(members)), self.eos_id, dtype=np.int64)
        inputs[0] = self.bos_id
        for b, s in enumerate(members):
            words = self.corpus.sentence(s)
            inputs[1 : len(words) + 1, b] = words
            targets[: len(words), b] = words
        mask = np.arange(steps)[:, None] < lengths[None, :]
        return Batch(torch.from_numpy(inputs), torch.from_numpy(targets), torch.from_numpy(mask), len(members))
