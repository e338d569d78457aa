import numpy as np
import torch

from lmserve.training.batching import SentenceBatches, StreamBatches
from lmserve.training.corpus import EncodedCorpus

EOS, BOS = 2, 1


def corpus(sentences: list[list[int]]) -> EncodedCorpus:
    ids = np.asarray([w for s in sentences for w in s], dtype=np.int32)
    offsets = np.cumsum([0] + [len(s) for s in sentences])
    return EncodedCorpus("mem", ids, offsets, 0)


SENTENCES = [[10 + i] * (1 + i % 5) + [50 + i] for i in range(23)]


def stream_of(sentences):
    return [w for s in sentences for w in [*s, EOS]]


def test_stream_batches_are_contiguous_parallel_streams():
    batches = StreamBatches(corpus(SENTENCES), EOS, batch_size=3, bptt=4)
    flat = stream_of(SENTENCES)
    steps = len(flat) // 3
    got = list(batches.batches())
    assert len(got) == batches.num_batches()
    for b in range(3):
        column = torch.cat([got[0].inputs[:1, b]] + [x.targets[:, b] for x in got]).tolist()
        assert column == flat[b * steps : (b + 1) * steps]  # stream b is a contiguous slice of the corpus
    for prev, nxt in zip(got, got[1:], strict=False):
        assert torch.equal(prev.targets[-1], nxt.inputs[0])  # state carried: the next chunk continues the last
    assert all(x.mask is None and x.num_sequences == 3 for x in got)
    assert got[-1].inputs.shape[0] <= 4


def test_stream_resume_start_skips_batches():
    batches = StreamBatches(corpus(SENTENCES), EOS, batch_size=2, bptt=3)
    full = list(batches.batches())
    rest = list(batches.batches(start=4))
    assert len(rest) == len(full) - 4 and torch.equal(rest[0].inputs, full[4].inputs)


def test_sentence_batches_are_independent_bos_eos_sequences_with_masked_padding():
    data = corpus(SENTENCES)
    batches = SentenceBatches(data, BOS, EOS, batch_size=4, shuffle=True, seed=7)
    seen = []
    for batch in batches.batches(epoch=0):
        for b in range(batch.inputs.shape[1]):
            n = int(batch.mask[:, b].sum())
            inputs, targets = batch.inputs[:n, b].tolist(), batch.targets[:n, b].tolist()
            assert inputs[0] == BOS and targets[-1] == EOS and inputs[1:] == targets[:-1]
            assert not batch.mask[n:, b].any()
            seen.append(tuple(targets[:-1]))
        assert batch.num_tokens == int(batch.mask.sum())
    assert sorted(seen) == sorted(tuple(s) for s in SENTENCES)  # every sentence exactly once


def test_sentence_plan_depends_on_seed_and_epoch_only():
    data = corpus(SENTENCES)

    def order(seed, epoch, start=0):
        batches = SentenceBatches(data, BOS, EOS, batch_size=4, shuffle=True, seed=seed)
        return [b.targets[0].tolist() for b in batches.batches(epoch, start)]

    assert order(1, 0) == order(1, 0)
    assert order(1, 0) != order(1, 1)
    assert order(1, 2, start=3) == order(1, 2)[3:]


def test_sentence_batches_group_similar_lengths_and_skip_long_ones_in_training():
    lengths = [1, 30, 2, 29, 3, 28, 2, 31]
    data = corpus([[7] * n for n in lengths])
    eval_batches = list(SentenceBatches(data, BOS, EOS, batch_size=4, shuffle=False).batches())
    assert [b.inputs.shape[0] for b in eval_batches] == [4, 32]  # short ones together, long ones together
    train = SentenceBatches(data, BOS, EOS, batch_size=4, shuffle=True, max_len=10)
    assert train.skipped == 4 and sum(b.num_sequences for b in train.batches()) == 4


def test_empty_sentence_is_one_prediction_of_eos():
    batch = next(SentenceBatches(corpus([[]]), BOS, EOS, batch_size=1, shuffle=False).batches())
    assert batch.inputs.tolist() == [[BOS]] and batch.targets.tolist() == [[EOS]]
