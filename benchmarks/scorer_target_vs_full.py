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

from benchmarks.common import ROOT, time_interleaved, write_result
from benchmarks.scoring_graphs import GraphSet, gutenberg_sentences, zipf_like


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
