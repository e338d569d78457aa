"""``lm-rescore annotate``: another neural LM's sentence scores, written into an n-best list as a feature.

Rescoring reads one neural LM bundle (``--lm``: the ``neural`` feature, and ``interp`` and ``oov_lm`` beside the
n-gram). A second one, a backward LM (``data.direction = backward``: it scores each sentence last word first) or a
forward LM of another domain, joins the recipe as a feature the list carries:

    lm-rescore annotate LIST --lm models/english_lm_backward --feature neural_backward --normalize librispeech \\
        --out LIST.jsonl
    lm-rescore tune LIST.jsonl --lm models/english_lm --ngram ... --features ...,neural,neural_backward

The feature is the natural-log score of the hypothesis' words and ``</s>`` (``lm-rescore score``'s), as the text
normalisation given makes them. Its name starts with ``neural_`` (``features.ANNOTATED``), so that ``evaluate``'s
baselines count it as the neural LM's: "n-gram only" and "no LM" leave it out. The list is written whole as JSON
Lines (``rescoring.nbest.jsonl``: every feature, rank, reference, source and document kept, in order), and a list
that already carries the feature is refused rather than overwritten.
"""

from __future__ import annotations

import argparse
import sys
import time

from lmserve.core.outputs import check_outputs
from lmserve.core.textnorm import PRESETS
from lmserve.rescoring.features import ANNOTATED
from lmserve.rescoring.nbest import FORMATS, read_nbest, write_nbest


def annotate(args) -> int:
    from lmserve.rescoring.scorer import Scorer

    if not args.feature.startswith(ANNOTATED) or len(args.feature) == len(ANNOTATED):
        raise ValueError(
            f"--feature {args.feature!r}: expected a name that starts with {ANNOTATED!r}, e.g. neural_backward "
            "(evaluate counts such features as the neural LM's)"
        )
    if not str(args.out).endswith(".jsonl"):
        raise ValueError(f"--out {args.out}: the annotated list is JSON Lines; give a path that ends in .jsonl")
    check_outputs({"--out": args.out}, {"LIST": args.list, "--lm": args.lm})
    nbest = read_nbest(args.list, args.format)
    for entry in nbest:
        for hyp in entry.hypotheses:
            if args.feature in hyp.features:
                raise ValueError(
                    f"{hyp.origin or entry.origin or args.list}: already carries feature {args.feature!r}; give "
                    "another --feature name"
                )
    scorer = Scorer(args.lm, threads=args.threads, normalizer=PRESETS[args.normalize] if args.normalize else None)
    start = time.perf_counter()
    scores = scorer.score_nbest([[hyp.text for hyp in entry.hypotheses] for entry in nbest])
    seconds = time.perf_counter() - start
    for entry, scored in zip(nbest, scores, strict=True):
        for hyp, score in zip(entry.hypotheses, scored, strict=True):
            hyp.features[args.feature] = score.logprob
    write_nbest(nbest, args.out, "jsonl")
    hypotheses = sum(len(entry.hypotheses) for entry in nbest)
    tokens = sum(len(s.token_logprobs) for scored in scores for s in scored)
    print(
        f"lm-rescore: wrote {args.out}: {len(nbest):,} entries, {hypotheses:,} hypotheses with feature "
        f"{args.feature!r} ({'backward' if scorer.backward else 'forward'} LM {args.lm}, {tokens:,} tokens in "
        f"{seconds:.1f} s)",
        file=sys.stderr,
    )
    return 0


def add_command(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "annotate", help="another neural LM's sentence scores (a backward LM's) into a list as a feature: JSON Lines"
    )
    parser.add_argument("list", help="n-best/k-best list (file or folder; the format is detected)")
    parser.add_argument("--format", choices=sorted(FORMATS), help="the list's format (default: detected)")
    parser.add_argument("--lm", required=True, help="model bundle directory (lm-train export), forward or backward")
    parser.add_argument("--feature", required=True, help="the feature's name, neural_SOMETHING (e.g. neural_backward)")
    parser.add_argument(
        "--normalize",
        choices=sorted(PRESETS),
        help="text normalisation preset (default: the bundle's own text settings), as rescoring's --normalize",
    )
    parser.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads (0 = all cores)")
    parser.add_argument("--out", required=True, help="the list with the feature, JSON Lines (.jsonl) to write")
    parser.set_defaults(func=annotate)
