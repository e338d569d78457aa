"""The shipped models (``models/``): size, checksums and held-out perplexity, measured with the scorer a user gets.

    make ngram-english_lm        # also writes var/english-text (the held-out documents below)
    python -m benchmarks.shipped_models --heldout english_lm=var/english-text/test.txt.gz

Each model folder is a bundle: it loads with its checksums verified (``Bundle.load``), its bytes are counted (the
target is at most 32 MiB each), and its perplexity is measured on held-out text by ``rescoring.scorer`` (fp16 or int8
weights as stored): sentence by sentence (``NAME_heldout_ppl``) and, for a model trained as a stream, with the state
carried through the text in its order (``NAME_heldout_ppl_context``, ``rescoring.context``; a backward LM's from the
text's last sentence to its first). english-text's held-out
documents are whole talks, dialogues and articles that no training sentence shares (``training.english_text``).
"""

from __future__ import annotations

import argparse
import gzip
import math

from benchmarks.common import ROOT, write_result
from lmserve.core.bundle import Bundle
from lmserve.rescoring.context import score_from_states, states_before
from lmserve.rescoring.scorer import Scorer

MODELS = ROOT / "models"
MAX_BYTES = 32 << 20


def perplexity(scored) -> float:
    logprob = sum(float(s.token_logprobs.sum()) for s in scored)
    tokens = sum(len(s.token_logprobs) for s in scored)
    return math.exp(-logprob / tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heldout", nargs="+", default=[], metavar="NAME=FILE", help="held-out text per model")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    heldout = dict(item.split("=", 1) for item in args.heldout)
    metrics: dict = {}
    folders = sorted(p.parent for p in MODELS.glob("*/manifest.json"))
    for folder in folders:
        name = folder.name
        bundle = Bundle.load(folder)  # every file's sha256 checked against the manifest
        size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
        metrics[f"{name}_bytes"] = size
        if name not in heldout:
            continue
        with gzip.open(heldout[name], "rt", encoding="utf-8") as f:
            sentences = [line.strip() for line in f if line.strip()]
        scorer = Scorer(bundle, threads=args.threads)
        metrics[f"{name}_heldout_ppl"] = perplexity(scorer.score(sentences))
        if bundle.manifest.get("sentence_start") == "</s>":
            ordered = sentences[::-1] if scorer.backward else sentences  # (a backward LM reads the text from its end)
            h, c = states_before(scorer, [""] * len(ordered), ordered)
            in_context = score_from_states(scorer, [[s] for s in ordered], h, c)
            metrics[f"{name}_heldout_ppl_context"] = perplexity([row[0] for row in in_context])
        metrics[f"{name}_heldout_sentences"] = len(sentences)
    sizes = [v for k, v in metrics.items() if k.endswith("_bytes")]
    metrics |= {"models": len(folders), "max_bytes": max(sizes, default=0), "max_bytes_target": MAX_BYTES}
    write_result("shipped_models", metrics, heldout=heldout)


if __name__ == "__main__":
    main()
