"""lm-rescore: score sentences with a model bundle (n-best/k-best rescoring arrives with its issue)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import BinaryIO

from rescoring.bundle import BundleError


def read_lines(stream: BinaryIO, name: str) -> list[str]:
    """Lines of a binary stream as text; bad UTF-8 is an error naming the line."""
    lines = []
    for lineno, raw in enumerate(stream, 1):
        try:
            lines.append(raw.decode("utf-8").rstrip("\r\n"))
        except UnicodeDecodeError as e:
            raise ValueError(f"{name}:{lineno}: not valid UTF-8 ({e.reason} at byte {e.start})") from e
    return lines


def _score(args) -> int:
    from rescoring.scorer import Scorer

    scorer = Scorer(args.lm, threads=args.threads)
    if args.input == "-":
        sentences = read_lines(sys.stdin.buffer, "<stdin>")
    else:
        with open(args.input, "rb") as f:
            sentences = read_lines(f, args.input)
    start = time.perf_counter()
    scores = scorer.score(sentences)
    elapsed = time.perf_counter() - start
    out = sys.stdout
    for text, s in zip(sentences, scores, strict=True):
        total = s.log10prob if args.log10 else s.logprob
        if args.format == "jsonl":
            tokens = s.token_log10probs if args.log10 else s.token_logprobs
            record = {"text": text, "logprob": s.logprob, "log10prob": s.log10prob, "oov": s.oov}
            if args.per_token:
                record["tokens"] = [[w, float(v)] for w, v in zip([*s.words, "</s>"], tokens, strict=True)]
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
        elif args.per_token:
            tokens = s.token_log10probs if args.log10 else s.token_logprobs
            pairs = " ".join(f"{w}={v:.4f}" for w, v in zip([*s.words, "</s>"], tokens, strict=True))
            out.write(f"{total:.6f}\t{pairs}\n")
        else:
            out.write(f"{total:.6f}\n")
    tokens = sum(len(s.token_logprobs) for s in scores)
    kind = "log-probabilities" if scorer.normalised else "self-normalised scores"
    print(
        f"lm-rescore: {len(scores)} sentences, {tokens} tokens, {sum(s.oov for s in scores)} OOV words as <unk>; "
        f"{kind} ({'log10' if args.log10 else 'natural log'}); {tokens / max(elapsed, 1e-9):.0f} tokens/s",
        file=sys.stderr,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lm-rescore", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    score = sub.add_parser("score", help="one score per input line: the sentence's log-probability under the LM")
    score.add_argument("--lm", required=True, help="model bundle directory (lm-train export)")
    score.add_argument("--input", default="-", help="sentences, one per line (default: standard input)")
    score.add_argument("--per-token", action="store_true", help="also print every token's score (</s> last)")
    score.add_argument("--log10", action="store_true", help="scores in log10 instead of natural log")
    score.add_argument("--format", choices=("text", "jsonl"), default="text")
    score.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads (0 = all cores)")
    score.set_defaults(func=_score)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (BundleError, ValueError, FileNotFoundError) as e:
        print(f"lm-rescore: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
