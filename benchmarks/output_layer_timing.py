"""The output layer alone: forward and forward+backward ms per batch, V = 10k, 45k, 200k -> output_layer_timing.json

    python -m benchmarks.output_layer_timing --threads 1

Like the p-tHSM timing table: every head gets the same random hidden states ``[batch, hidden]`` and targets drawn
from a Zipf unigram over V, the distribution the class bins, the Huffman tree, the adaptive clusters and the sampled
objective's noise are built from (as ``head.bias_init = "unigram"`` does in training). ``forward`` is the training
loss under ``torch.no_grad``; ``forward_backward`` is the loss and its backward pass into the hidden states and the
head's parameters. Cases take turns (benchmarks.common.time_interleaved), each timed call runs ``--iterations``
batches, and the figure is the median per batch.

Heads: ``full`` (cross-entropy), ``adaptive`` (cutoffs 2000, 10000, 50000 below V; div_value 4), ``class``
(round(sqrt V) sqrt-frequency bins), ``tree`` (Huffman) and ``sampled`` (the full head trained by importance
sampling with ``--samples`` words per batch; its training-perplexity estimate cut to one row: nll_stride = batch).
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import time_interleaved, write_result
from lmserve.training.heads import AdaptiveSoftmax, ClassSoftmax, FullSoftmax, TreeSoftmax
from lmserve.training.objectives import CrossEntropy, ImportanceSampling

HEADS = ("full", "adaptive", "class", "tree", "sampled")


def zipf_log_prior(vocab_size: int) -> torch.Tensor:
    weights = 1.0 / torch.arange(1, vocab_size + 1, dtype=torch.float64)
    return (weights / weights.sum()).log().float()


def build(name: str, hidden: int, vocab_size: int, args) -> tuple[torch.nn.Module, object]:
    """(head, objective) with its structure and biases from the Zipf unigram."""
    if name in ("full", "sampled"):
        head = FullSoftmax(hidden, vocab_size)
    elif name == "adaptive":
        cutoffs = [c for c in (2000, 10000, 50000) if c < vocab_size] or [vocab_size // 5]  # (tiny test runs)
        head = AdaptiveSoftmax(hidden, vocab_size, cutoffs, 4.0)
    elif name == "class":
        head = ClassSoftmax(hidden, vocab_size)
    else:
        head = TreeSoftmax(hidden, vocab_size, "huffman")
    head.init_bias(zipf_log_prior(vocab_size))
    objective = ImportanceSampling(args.samples, nll_stride=args.batch) if name == "sampled" else CrossEntropy()
    return head, objective


def cases(name: str, vocab_size: int, args) -> dict:
    torch.manual_seed(0)
    head, objective = build(name, args.hidden, vocab_size, args)
    hidden = torch.randn(args.batch, args.hidden, requires_grad=True)
    targets = torch.distributions.Categorical(logits=zipf_log_prior(vocab_size)).sample((args.batch,))

    def forward():
        with torch.no_grad():
            for _ in range(args.iterations):
                objective(head, hidden, targets)

    def forward_backward():
        for _ in range(args.iterations):
            head.zero_grad(set_to_none=True)
            hidden.grad = None
            objective(head, hidden, targets).loss.backward()

    forward_backward()  # warm-up: first-call allocations
    return {(name, "forward"): forward, (name, "forward_backward"): forward_backward}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab-sizes", type=int, nargs="+", default=[10_000, 45_000, 200_000])
    parser.add_argument("--heads", nargs="+", choices=HEADS, default=list(HEADS))
    parser.add_argument("--hidden", type=int, default=200, help="hidden size D (the PTB models' 200)")
    parser.add_argument("--batch", type=int, default=512, help="positions per batch (N)")
    parser.add_argument("--samples", type=int, default=1024, help="sampled: words drawn per batch")
    parser.add_argument("--iterations", type=int, default=5, help="batches per timed call")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows, speedups = [], {}
    for vocab_size in args.vocab_sizes:
        timed = {}
        for name in args.heads:
            timed.update(cases(name, vocab_size, args))
        seconds = time_interleaved(timed, args.rounds)
        for name in args.heads:
            row = {"head": name, "vocab_size": vocab_size}
            for mode in ("forward", "forward_backward"):
                row[f"{mode}_ms"] = 1000 * seconds[(name, mode)] / args.iterations
            rows.append(row)
            print(row)
        if "full" in args.heads:
            full = rows[-len(args.heads) + args.heads.index("full")]
            for row in rows[-len(args.heads) :]:
                if row["head"] != "full":
                    speedups[f"vocab_{vocab_size}_{row['head']}_forward_speedup"] = (
                        full["forward_ms"] / row["forward_ms"]
                    )
    write_result(
        "output_layer_timing",
        {"rows": rows, **speedups},
        threads=args.threads,
        settings={k: getattr(args, k) for k in ("hidden", "batch", "samples", "iterations", "rounds")},
    )


if __name__ == "__main__":
    main()
