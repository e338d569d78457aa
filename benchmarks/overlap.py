"""The leakage guard on real data -> overlap.json

    lm-train prepare-gutenberg --out var/gutenberg
    lm-train prepare-gutenberg --data ../shared/data/gutenberg-large --out var/gutenberg-large
    python -m benchmarks.overlap

Four questions, each answered by ``rescoring.overlap.measure`` with 8-word windows:

- the Gutenberg training text (``gutenberg`` and ``gutenberg-large``, as ``prepare-gutenberg`` writes it: the text
  the LibriSpeech LMs train on) against the LibriSpeech dev_clean and dev_other references;
- PTB's training text against the WSJ 5-best references (HyPoradise dev.json), the references through the ``ptb``
  normaliser the PTB models rescore them with;
- a planted leak: the gutenberg training text with every 10th dev_other reference inserted at random lines, which the
  guard must flag while it stays quiet on the clean corpora.

Each row gives the shares of references and of reference words found, the warning (``WARN_SHARE``), the worst
offenders and the time per million words of LM text (one pass, one core).
"""

from __future__ import annotations

import argparse
import gzip
import random
import tempfile
from pathlib import Path

from benchmarks.common import DATA_DIR, ROOT, write_result
from lmserve.core.textnorm import PRESETS
from lmserve.rescoring.nbest import read_nbest
from lmserve.rescoring.overlap import DEFAULT_N, WARN_SHARE, measure


def references(path: Path) -> tuple[list[str], list[str]]:
    nbest = read_nbest(path)
    return [e.references[0] for e in nbest], [e.id for e in nbest]


def planted(train: Path, refs: list[str], every: int, out: Path, seed: int = 0) -> int:
    """A copy of ``train`` with every ``every``-th reference inserted at a random line; returns how many."""
    chosen = refs[::every]
    with gzip.open(train, "rt", encoding="utf-8") as f:
        lines = f.read().splitlines()
    rng = random.Random(seed)
    for ref in chosen:
        lines.insert(rng.randrange(len(lines) + 1), ref)
    with gzip.open(out, "wt", encoding="utf-8", compresslevel=1) as f:
        f.write("\n".join(lines) + "\n")
    return len(chosen)


def row(name: str, refs, ids, texts, **views) -> dict:
    result = measure(refs, texts, DEFAULT_N, ids=ids, offenders=5, **views)
    print(f"{name}: {result.summary()}; {result.seconds_per_million_words:.2f} s per million words")
    return {
        "row": name,
        **{k: v for k, v in result.to_dict().items() if k != "offenders"},
        "warning": result.warning(),
        "offenders": [
            {"id": o.id, "covered": f"{o.covered_words}/{o.words}", "first_found": o.first_found, "text": o.text}
            for o in result.offenders
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--var", type=Path, default=ROOT / "var", help="where prepare-gutenberg wrote its folders")
    args = parser.parse_args()
    libri = DATA_DIR / "librispeech-nbest"
    clean_refs, clean_ids = references(libri / "dev_clean.tar.gz")
    other_refs, other_ids = references(libri / "dev_other.tar.gz")
    dev_refs, dev_ids = clean_refs + other_refs, clean_ids + other_ids
    wsj_refs, wsj_ids = references(DATA_DIR / "wsj-nbest" / "dev.json")
    rows = []
    for corpus in ("gutenberg", "gutenberg-large"):
        train = args.var / corpus / "train.txt.gz"
        if not train.exists():
            raise FileNotFoundError(f"{train}: run lm-train prepare-gutenberg first (see the docstring)")
        rows.append(row(f"{corpus} train vs LibriSpeech dev_clean+dev_other", dev_refs, dev_ids, [train]))
    rows.append(
        row(
            "PTB train vs WSJ dev references (ptb normaliser)",
            wsj_refs,
            wsj_ids,
            [DATA_DIR / "ptb" / "ptb.train.txt.gz"],
            reference_view=PRESETS["ptb"].normalize,
        )
    )
    with tempfile.TemporaryDirectory() as tmp:
        leak = Path(tmp) / "gutenberg_train_with_leak.txt.gz"
        n = planted(args.var / "gutenberg" / "train.txt.gz", other_refs, 10, leak)
        planted_row = row(f"planted leak: gutenberg train + {n} dev_other references", other_refs, other_ids, [leak])
        planted_row["planted"] = n
        planted_row["text_files"] = ["var/gutenberg/train.txt.gz + every 10th dev_other reference"]
        rows.append(planted_row)
    metrics = {
        r["row"]: {
            "share_references": round(r["share_references"], 5),
            "share_words": round(r["share_words"], 5),
            "warns": r["warning"] is not None,
            "seconds_per_million_words": round(r["seconds_per_million_words"], 3),
        }
        for r in rows
    }
    write_result("overlap", metrics, n=DEFAULT_N, warn_share=WARN_SHARE, rows=rows)


if __name__ == "__main__":
    main()
