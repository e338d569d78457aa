"""Prefix sharing on LibriSpeech dev_other 30-best lists vs scoring each hypothesis alone -> prefix_sharing_dev_other.json

    python -m benchmarks.prefix_sharing_dev_other --threads 1

The Gutenberg adaptive-softmax model (LibriSpeech-style text, sentence mode) scores all 85,920 hypotheses twice,
taking turns: ``Scorer.score_nbest`` (one prefix tree per utterance, the LSTM run once per distinct prefix) and
``Scorer.score`` on every hypothesis alone (batched by length). Both must give the same scores.
"""

from __future__ import annotations

import argparse
import tarfile

import numpy as np

from benchmarks.common import DATA_DIR, ROOT, ensure_bundle, time_interleaved, write_result
from lmserve.rescoring.scorer import Scorer


def read_espnet_hypotheses(split: str) -> list[list[str]]:
    """The hypothesis texts of every utterance, best first, from the ESPnet n-best folder layout."""
    folder = ROOT / "var" / "librispeech" / split
    if not folder.exists():
        with tarfile.open(DATA_DIR / "librispeech-nbest" / f"{split}.tar.gz") as tar:
            tar.extractall(folder.parent, filter="data")
    files = sorted(folder.glob("raw_hypotheses/*best_recog/text"), key=lambda p: int(p.parent.name.split("best")[0]))
    columns = [p.read_text(encoding="utf-8").splitlines() for p in files]
    lists = []
    for rows in zip(*columns, strict=True):
        ids = {row.split(" ", 1)[0] for row in rows}
        if len(ids) != 1:
            raise ValueError(f"{folder}: n-best files disagree on the utterance of one line: {sorted(ids)}")
        lists.append([row.split(" ", 1)[1].strip() if " " in row else "" for row in rows])
    return lists


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--run", default="var/runs/gutenberg_adaptive")
    args = parser.parse_args()
    bundle = ensure_bundle(ROOT / args.run, ROOT / "var" / "bundles" / "gutenberg_adaptive")
    scorer = Scorer(bundle, threads=args.threads)
    lists = read_espnet_hypotheses("dev_other")
    flat = [h for hyps in lists for h in hyps]

    scorer.stats.lstm_steps = 0
    shared = scorer.score_nbest(lists)
    shared_steps = scorer.stats.lstm_steps
    alone = scorer.score(flat)
    alone_steps = scorer.stats.lstm_steps - shared_steps
    diff = max(
        float(np.abs(a.token_logprobs - b.token_logprobs).max())
        for a, b in zip([s for scores in shared for s in scores], alone, strict=True)
    )
    seconds = time_interleaved(
        {"shared": lambda: scorer.score_nbest(lists), "alone": lambda: scorer.score(flat)}, args.rounds
    )
    tokens = sum(len(s.token_logprobs) for s in alone)
    write_result(
        "prefix_sharing_dev_other",
        {
            "steps_saved_fraction": 1 - shared_steps / alone_steps,
            "wall_speedup": seconds["alone"] / seconds["shared"],
            "lstm_steps_shared": shared_steps,
            "lstm_steps_alone": alone_steps,
            "hypotheses": len(flat),
            "utterances": len(lists),
            "hypotheses_per_s_shared": len(flat) / seconds["shared"],
            "hypotheses_per_s_alone": len(flat) / seconds["alone"],
            "tokens": tokens,
            "max_abs_score_difference": diff,
            "oov_words": sum(s.oov for s in alone),
        },
        bundle=str(bundle.relative_to(ROOT)),
        threads=args.threads,
    )


if __name__ == "__main__":
    main()
