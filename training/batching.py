"""The two ways a corpus becomes batches of ``[T, B]`` (time-major) input and target ids.

- ``StreamBatches``: the corpus as one token stream (``</s>`` after every sentence) split into B parallel streams and
  cut into T-step chunks; the LSTM state is carried from one chunk to the next (Zaremba et al. 2014).
- ``SentenceBatches``: every sentence is ``<s> w1 .. wn </s>`` scored from a fresh state, as sentences are scored
  later when rescoring; sentences of similar length share a batch and padding is masked out of the loss.

Both are deterministic functions of (seed, epoch), so a run resumed mid-epoch sees exactly the batches it would have.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from training.corpus import EncodedCorpus


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


class StreamBatches:
    carries_state = True

    def __init__(self, corpus: EncodedCorpus, eos_id: int, batch_size: int, bptt: int):
        stream = np.empty(corpus.num_words + corpus.num_sentences, dtype=np.int64)
        ends = corpus.offsets[1:] + np.arange(1, corpus.num_sentences + 1)  # position after each sentence's </s>
        word_pos = np.arange(corpus.num_words) + np.repeat(np.arange(corpus.num_sentences), corpus.lengths())
        stream[word_pos] = corpus.ids
        stream[ends - 1] = eos_id
        steps = len(stream) // batch_size
        if steps < 2:
            raise ValueError(f"{corpus.path}: too short for {batch_size} streams")
        self.data = torch.from_numpy(stream[: steps * batch_size].reshape(batch_size, steps).T.copy())
        self.bptt = bptt
        self.batch_size = batch_size
        self.starts = list(range(0, steps - 1, bptt))

    def num_batches(self, epoch: int = 0) -> int:
        return len(self.starts)

    def batches(self, epoch: int = 0, start: int = 0) -> Iterator[Batch]:
        for i in self.starts[start:]:
            t = min(self.bptt, len(self.data) - 1 - i)
            yield Batch(self.data[i : i + t], self.data[i + 1 : i + 1 + t], None, self.batch_size)


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
        lengths = corpus.lengths()
        keep = lengths <= max_len if max_len else np.ones(len(lengths), dtype=bool)
        self.indices = np.flatnonzero(keep)
        self.skipped = int((~keep).sum())
        self.lengths = lengths

    def _plan(self, epoch: int) -> list[np.ndarray]:
        """Shuffle, sort by length within buckets of 50 batches, cut into batches, shuffle the batches."""
        if not self.shuffle:
            order = self.indices[np.argsort(self.lengths[self.indices], kind="stable")]
            return [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(self.indices)
        bucket = 50 * self.batch_size
        for i in range(0, len(order), bucket):
            chunk = order[i : i + bucket]
            order[i : i + bucket] = chunk[np.argsort(self.lengths[chunk], kind="stable")]
        plan = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        return [plan[i] for i in rng.permutation(len(plan))]

    def num_batches(self, epoch: int = 0) -> int:
        return -(-len(self.indices) // self.batch_size)

    def batches(self, epoch: int = 0, start: int = 0) -> Iterator[Batch]:
        for members in self._plan(epoch)[start:]:
            yield self.make_batch(members)

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
