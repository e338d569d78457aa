"""Target-only vs full-softmax sentence graphs, 2x256 LSTM, V = 45k and 200k -> scorer_target_vs_full.json

    python -m benchmarks.scorer_target_vs_full --threads 1

For each vocabulary size one randomly initialised model (speed does not depend on the weights) is exported three
ways: the self-normalised target-only graph (one dot product per token), the exactly normalised full-softmax graph
(all V logits and their log-sum-exp per token), and the LSTM alone (its hidden states summed, no output layer). The
last one bounds the possible speed-up: target-only can at best cost what the LSTM costs. V = 45k uses real Gutenberg
validation sentences with a 45k-word Gutenberg vocabulary; V = 200k uses Zipf-distributed ids with the same lengths.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from torch import nn

from benchmarks.common import ROOT, time_interleaved, write_result
from lmserve.training.config import HeadConfig, ModelConfig
from lmserve.training.export import SentencesGraph, export_onnx
from lmserve.training.model import LSTMLM

EMBEDDING = HIDDEN = 256
LAYERS = 2
MAX_BATCH_TOKENS = 512  # the full-softmax graph holds [tokens, V] floats: 400 MB at V = 200k


class LSTMOnlyGraph(nn.Module):
    """The sentences graph without an output layer: what scoring would cost if the head were free."""

    def __init__(self, model: LSTMLM):
        super().__init__()
        self.model = model

    def forward(self, input_ids, target_ids, lengths):
        hidden, _ = self.model(input_ids.transpose(0, 1))
        return hidden.transpose(0, 1).sum(-1)


@dataclass
class GraphSet:
    vocab_size: int
    sessions: dict[str, ort.InferenceSession]
    kinds = ("target", "full", "lstm")

    @classmethod
    def build(cls, vocab_size: int, folder: Path, threads: int) -> GraphSet:
        folder.mkdir(parents=True, exist_ok=True)
        if not all((folder / f"{kind}.onnx").exists() for kind in cls.kinds):
            torch.manual_seed(0)
            model = LSTMLM(
                vocab_size, ModelConfig(embedding_size=EMBEDDING, hidden_size=HIDDEN, layers=LAYERS), HeadConfig()
            ).eval()
            ids = torch.tensor([[1, 5, 6], [1, 7, 2]])
            axes = {
                "input_ids": {0: "batch", 1: "time"},
                "target_ids": {0: "batch", 1: "time"},
                "lengths": {0: "batch"},
                "logprobs": {0: "batch", 1: "time"},
            }
            graphs = {
                "target": SentencesGraph(model, True),
                "full": SentencesGraph(model, False),
                "lstm": LSTMOnlyGraph(model),
            }
            for kind, graph in graphs.items():
                export_onnx(
                    graph,
                    (ids, ids.roll(-1, 1), torch.tensor([3, 2])),
                    folder / f"{kind}.onnx",
                    ["input_ids", "target_ids", "lengths"],
                    ["logprobs"],
                    axes,
                )
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        sessions = {
            kind: ort.InferenceSession(str(folder / f"{kind}.onnx"), options, providers=["CPUExecutionProvider"])
            for kind in cls.kinds
        }
        return cls(vocab_size, sessions)

    def run(self, kind: str, sentences: list[list[int]]) -> None:
        session = self.sessions[kind]
        wanted = {i.name for i in session.get_inputs()}  # the LSTM-only graph has no use for (and no) target_ids
        for batch in batches(sentences):
            steps = max(len(s) for s in batch) + 1
            inputs = np.full((len(batch), steps), 2, dtype=np.int64)
            targets = np.full((len(batch), steps), 2, dtype=np.int64)
            inputs[:, 0] = 1
            for row, ids in enumerate(batch):
                inputs[row, 1 : len(ids) + 1] = ids
                targets[row, : len(ids)] = ids
            lengths = np.array([len(s) + 1 for s in batch], dtype=np.int64)
            feed = {"input_ids": inputs, "target_ids": targets, "lengths": lengths}
            session.run(None, {name: value for name, value in feed.items() if name in wanted})

    def flops_per_token(self) -> dict[str, float]:
        """Multiply-adds x 2 of the matrix products per scored token (elementwise work is left out)."""
        lstm = sum(2 * 4 * HIDDEN * ((EMBEDDING if layer == 0 else HIDDEN) + HIDDEN) for layer in range(LAYERS))
        return {"lstm": lstm, "target": lstm + 2 * HIDDEN, "full": lstm + 2 * HIDDEN * self.vocab_size}


def batches(sentences: list[list[int]]) -> list[list[list[int]]]:
    ordered = sorted(sentences, key=len)
    out, current = [], []
    for s in ordered:
        if current and (len(current) + 1) * (len(s) + 1) > MAX_BATCH_TOKENS:
            out.append(current)
            current = []
        current.append(s)
    return [*out, current] if current else out


def gutenberg_sentences(vocab_size: int, count: int) -> list[list[int]]:
    """Held-out Gutenberg sentences as ids of a ``vocab_size``-word vocabulary built on the training books."""
    from benchmarks.common import DATA_DIR, ROOT
    from lmserve.training.corpus import encode_file, read_sentences
    from lmserve.training.gutenberg import prepare_gutenberg
    from lmserve.training.vocab import Vocabulary

    prepared = ROOT / "var" / "gutenberg"
    if not (prepared / "prepare.json").exists():
        prepare_gutenberg(DATA_DIR / "gutenberg", prepared)
    vocab = Vocabulary.build(read_sentences(prepared / "train.txt.gz"), max_size=vocab_size)
    corpus = encode_file(prepared / "valid.txt.gz", vocab)
    return [corpus.sentence(i).tolist() for i in range(min(count, corpus.num_sentences))]


def zipf_like(sentences: list[list[int]], vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Same lengths, ids drawn from a Zipf distribution over ``vocab_size`` words (rank 1 = id 3)."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, vocab_size - 2)
    weights /= weights.sum()
    return [(rng.choice(len(weights), size=len(s), p=weights) + 3).tolist() for s in sentences]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sentences", type=int, default=400, help="Gutenberg validation sentences to score")
    args = parser.parse_args()
    sentences45 = gutenberg_sentences(45000, args.sentences)
    metrics, details = {}, {}
    for name, vocab, sentences in (("45k", 45000, sentences45), ("200k", 200000, zipf_like(sentences45, 200000))):
        graphs = GraphSet.build(vocab, ROOT / "var" / "bench" / f"graphs_{name}", threads=args.threads)
        tokens = sum(len(s) + 1 for s in sentences)
        seconds = time_interleaved(
            {kind: (lambda k=kind, g=graphs, s=sentences: g.run(k, s)) for kind in graphs.kinds}, args.rounds
        )
        metrics[f"vocab_{name}_speedup"] = seconds["full"] / seconds["target"]
        metrics[f"vocab_{name}_bound"] = seconds["full"] / seconds["lstm"]
        metrics[f"vocab_{name}_share_of_bound"] = metrics[f"vocab_{name}_speedup"] / metrics[f"vocab_{name}_bound"]
        for kind, s in seconds.items():
            metrics[f"vocab_{name}_{kind}_tokens_per_s"] = tokens / s
        details[name] = {"vocab_size": vocab, "tokens": tokens, "flops_per_token": graphs.flops_per_token()}
    write_result(
        "scorer_target_vs_full",
        metrics,
        details=details,
        threads=args.threads,
        model="2-layer LSTM, 256 embedding, 256 hidden, full softmax head",
    )


if __name__ == "__main__":
    main()
