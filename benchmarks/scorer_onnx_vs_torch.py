"""Scoring throughput: the ONNX Runtime scorer vs the same model in PyTorch eager -> scorer_onnx_vs_torch.json

    python -m benchmarks.scorer_onnx_vs_torch --threads 1

PTB test sentences, two Zaremba-small sentence-mode models: exact scores (full softmax, the headline figures) and
self-normalised scores (trained with the log Z penalty: one dot product per word). Each is measured with the
scorer's own batches (sentences of similar length, ``Scorer.plan_batches``) and with one sentence per call (what a
service sees without micro-batching). Both runtimes get the same batches of token ids and the same thread count, and
take turns; building the input arrays is timed on both sides, text -> ids on neither.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from benchmarks.common import ROOT, ensure_bundle, ptb_sentences, time_interleaved, write_result
from lmserve.rescoring.scorer import Scorer
from lmserve.training.checkpoint import load_model_for_eval
from lmserve.training.export import SentencesGraph
from lmserve.training.objectives import self_normalised

MODELS = {"exact": "var/runs/ptb_small_sentence", "selfnorm": "var/runs/ptb_selfnorm_a0.1_g1"}


def torch_arrays(batch: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    steps = max(len(ids) for ids in batch) + 1
    inputs = torch.full((len(batch), steps), 2, dtype=torch.long)
    targets = torch.full((len(batch), steps), 2, dtype=torch.long)
    inputs[:, 0] = 1
    for row, ids in enumerate(batch):
        inputs[row, 1 : len(ids) + 1] = torch.tensor(ids)
        targets[row, : len(ids)] = torch.tensor(ids)
    return inputs, targets, torch.tensor([len(ids) + 1 for ids in batch])


def measure(run: str, sentences: list[str], threads: int, rounds: int) -> dict[str, float]:
    cfg, _, model = load_model_for_eval(ROOT / run)
    graph = SentencesGraph(model.eval(), self_normalised(cfg))
    scorer = Scorer(ensure_bundle(ROOT / run, ROOT / "var" / "bundles" / (ROOT / run).name), threads=threads)
    ids = [scorer.encode(s)[1] for s in sentences]
    tokens = sum(len(x) + 1 for x in ids)
    plans = {
        "batched": [[ids[i] for i in members] for members in scorer.plan_batches(ids)],
        "per_sentence": [[x] for x in ids],
    }
    figures = {}
    for name, batches in plans.items():

        def eager(batches=batches):
            with torch.no_grad():
                for batch in batches:
                    graph(*torch_arrays(batch))

        seconds = time_interleaved({"onnx": lambda b=batches: [scorer.score_ids(x) for x in b], "torch": eager}, rounds)
        figures[f"{name}_onnx_tokens_per_s"] = tokens / seconds["onnx"]
        figures[f"{name}_torch_tokens_per_s"] = tokens / seconds["torch"]
        figures[f"{name}_speedup"] = seconds["torch"] / seconds["onnx"]
    onnx_ppl = float(np.exp(-sum(s.logprob for s in scorer.score(sentences)) / tokens))
    return {**figures, "batches": len(plans["batched"]), "tokens": tokens, "score_ppl": onnx_ppl}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sentences = ptb_sentences("test")
    results = {kind: measure(run, sentences, args.threads, args.rounds) for kind, run in MODELS.items()}
    exact = results["exact"]
    metrics = {
        "onnx_tokens_per_s": exact["batched_onnx_tokens_per_s"],
        "torch_tokens_per_s": exact["batched_torch_tokens_per_s"],
        "speedup": exact["batched_speedup"],
    }
    for kind, figures in results.items():
        metrics.update({f"{kind}_{key}": value for key, value in figures.items()})
    write_result("scorer_onnx_vs_torch", metrics, threads=args.threads, models=MODELS)


if __name__ == "__main__":
    main()
