"""Scoring throughput: the ONNX Runtime scorer vs the same model in PyTorch eager -> scorer_onnx_vs_torch.json

    python -m benchmarks.scorer_onnx_vs_torch --threads 1

PTB test sentences, the Zaremba-small sentence-mode model (full softmax, exact scores). Both sides score the same
length-sorted batches (the scorer's own batching) with the same number of threads, taking turns.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from benchmarks.common import ROOT, ensure_bundle, ptb_sentences, time_interleaved, write_result
from rescoring.scorer import Scorer
from training.checkpoint import load_model_for_eval
from training.export import SentencesGraph


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--run", default="var/runs/ptb_small_sentence")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bundle = ensure_bundle(ROOT / args.run, ROOT / "var" / "bundles" / "ptb_small_sentence")
    scorer = Scorer(bundle, threads=args.threads)
    sentences = ptb_sentences("test")
    _, _, model = load_model_for_eval(ROOT / args.run)
    graph = SentencesGraph(model.eval(), self_normalised=False)

    # the scorer's batches of token ids, fed to both runtimes; text -> ids stays outside the timing
    ids = [scorer.encode(s)[1] for s in sentences]
    batches = [[ids[i] for i in members] for members in scorer.plan_batches(ids)]
    tokens = sum(len(x) + 1 for x in ids)

    def onnx_runtime():
        return [scorer.score_ids(batch) for batch in batches]

    def torch_eager():
        with torch.no_grad():
            for batch in batches:
                steps = max(len(ids) for ids in batch) + 1
                inputs = torch.full((len(batch), steps), 2, dtype=torch.long)
                targets = torch.full((len(batch), steps), 2, dtype=torch.long)
                inputs[:, 0] = 1
                for row, ids in enumerate(batch):
                    inputs[row, 1 : len(ids) + 1] = torch.tensor(ids)
                    targets[row, : len(ids)] = torch.tensor(ids)
                graph(inputs, targets, torch.tensor([len(ids) + 1 for ids in batch]))

    seconds = time_interleaved({"onnx": onnx_runtime, "torch": torch_eager}, args.rounds)
    total_onnx = sum(float(s.logprob) for s in scorer.score(sentences))
    write_result(
        "scorer_onnx_vs_torch",
        {
            "onnx_tokens_per_s": tokens / seconds["onnx"],
            "torch_tokens_per_s": tokens / seconds["torch"],
            "speedup": seconds["torch"] / seconds["onnx"],
            "tokens": tokens,
            "sentences": len(sentences),
            "batches": len(batches),
            "threads": args.threads,
            "test_ppl_onnx": float(np.exp(-total_onnx / tokens)),
        },
        bundle=str(bundle.relative_to(ROOT)),
        note="both sides time building their input arrays from token ids and running the graph",
    )


if __name__ == "__main__":
    main()
