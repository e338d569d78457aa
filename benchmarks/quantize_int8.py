"""int8 dynamic quantisation vs fp32: scoring speed and PTB test perplexity -> quantize_int8.json

    python -m benchmarks.quantize_int8 --threads 1

The Zaremba-small sentence-mode model exported twice (fp32, --quantize int8); both bundles score the PTB test
sentences through the Scorer, on the same batches, taking turns.
"""

from __future__ import annotations

import argparse
import math

from benchmarks.common import ROOT, ensure_bundle, ptb_sentences, time_interleaved, write_result
from lmserve.rescoring.scorer import Scorer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--run", default="var/runs/ptb_small_sentence")
    args = parser.parse_args()
    run = ROOT / args.run
    scorers = {
        "fp32": Scorer(ensure_bundle(run, ROOT / "var" / "bundles" / "ptb_small_sentence"), threads=args.threads),
        "int8": Scorer(
            ensure_bundle(run, ROOT / "var" / "bundles" / "ptb_small_sentence_int8", quantize="int8"),
            threads=args.threads,
        ),
    }
    sentences = ptb_sentences("test")
    ids = [scorers["fp32"].encode(s)[1] for s in sentences]
    batches = [[ids[i] for i in members] for members in scorers["fp32"].plan_batches(ids)]
    tokens = sum(len(x) + 1 for x in ids)
    ppl = {
        name: math.exp(-sum(s.logprob for s in scorer.score(sentences)) / tokens) for name, scorer in scorers.items()
    }
    seconds = time_interleaved(
        {name: (lambda s=scorer: [s.score_ids(b) for b in batches]) for name, scorer in scorers.items()}, args.rounds
    )
    size = {name: scorer.bundle.graph_path("sentences").stat().st_size for name, scorer in scorers.items()}
    write_result(
        "quantize_int8",
        {
            "speedup": seconds["fp32"] / seconds["int8"],
            "ppl_fp32": ppl["fp32"],
            "ppl_int8": ppl["int8"],
            "ppl_change_percent": 100 * (ppl["int8"] / ppl["fp32"] - 1),
            "fp32_tokens_per_s": tokens / seconds["fp32"],
            "int8_tokens_per_s": tokens / seconds["int8"],
            "graph_bytes_fp32": size["fp32"],
            "graph_bytes_int8": size["int8"],
        },
        threads=args.threads,
        data="PTB test, sentence by sentence",
    )


if __name__ == "__main__":
    main()
