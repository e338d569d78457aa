"""Words outside the vocabulary scored from their spelling by a CNN-softmax model -> oov_scoring.json

    python -m benchmarks.oov_scoring --jobs 2   # about 10 minutes after output_layers_v2, 30 without (2 idle cores)
    python -m benchmarks.oov_scoring --tiny --results /tmp/oov   # a smoke test, under a minute

Two CNN-softmax models trained by target sampling, as output_layers_v2's ``cnnsoftmax`` row: PTB's for the WSJ dev
5-best references, output_layers_v2's Gutenberg run for LibriSpeech dev_other's. Each is exported exact and scores
the references twice: unknown words as <unk> (``*_ppl_unk``) and with ``open_vocab`` (``*_ppl_all_words``: each
unknown word's output vector from its spelling); ``*_ppl_known_words`` leaves their positions out. Figures:
docs/benchmarks/output-layers.md ("Open-vocabulary scores from the character model").
"""

from __future__ import annotations

import argparse
import math
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import benchmarks.common as common
from benchmarks.common import DATA_DIR, ROOT, gutenberg_books, write_result
from benchmarks.output_layers_v2 import (
    CONFIG,
    ROWS,
    TINY,
    TINY_EVAL_SENTENCES,
    TINY_TOKENS,
    TOKENS,
    prepare_data,
    row_settings,
    tiny,
)
from benchmarks.train_run import fit_in_subprocess
from lmserve.core.textnorm import PRESETS
from lmserve.rescoring.nbest import read_nbest
from lmserve.rescoring.rescore import references_of
from lmserve.rescoring.scorer import Scorer

SETS = {
    "wsj_dev": {"list": DATA_DIR / "wsj-nbest" / "dev.json", "preset": "ptb", "model": "ptb"},
    "dev_other": {"list": DATA_DIR / "librispeech-nbest" / "dev_other.tar.gz", "preset": "librispeech", "model": "gb"},
}


def perplexities(scores: list, unknown: list[np.ndarray]) -> dict:
    """Per-word perplexity over all positions, over the positions of known words, and the unknown words' mean."""
    tokens = np.concatenate([s.token_logprobs for s in scores]).astype(np.float64)
    is_unknown = np.concatenate([np.append(u, False) for u in unknown])  # </s> is known
    return {
        "ppl": math.exp(-tokens.mean()),
        "ppl_known_words": math.exp(-tokens[~is_unknown].mean()),
        "mean_unknown_logprob": float(tokens[is_unknown].mean()) if is_unknown.any() else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=2, help="the two models train side by side")
    parser.add_argument("--ptb-tokens", type=int, default=500_000, help="PTB training tokens (an epoch: 930k)")
    parser.add_argument("--gutenberg-tokens", type=int, default=TOKENS, help="as output_layers_v2's --tokens")
    parser.add_argument("--eval-sentences", type=int, default=500, help="as output_layers_v2's")
    parser.add_argument("--threads", type=int, default=1, help="ONNX Runtime threads of the scorer")
    parser.add_argument("--tiny", action="store_true", help="a smoke test: small models, a few thousand tokens")
    common.add_results_option(parser)
    args = parser.parse_args()
    common.use_results(args.results)
    suffix = "_tiny" if args.tiny else ""
    if args.tiny:
        args.ptb_tokens, args.gutenberg_tokens, args.eval_sentences = TINY_TOKENS, TINY_TOKENS, TINY_EVAL_SENTENCES
    folder = ROOT / "var" / f"output_layers_v2{suffix}"
    data = prepare_data(gutenberg_books(), folder, args.eval_sentences, 2000 if args.tiny else 50_000)
    gutenberg_runs = ROOT / "var" / "runs" / f"output_layers_v2{suffix}"
    runs = {
        # output_layers_v2's cnnsoftmax row, trained as that benchmark trains it (the same run when it already did)
        "gb": (
            CONFIG,
            gutenberg_runs / "cnnsoftmax",
            row_settings("cnnsoftmax", data, args.gutenberg_tokens, args.tiny, gutenberg_runs),
        ),
        "ptb": (
            ROOT / "configs" / "ptb_objectives.toml",
            ROOT / "var" / "runs" / f"oov_scoring{suffix}" / "ptb-cnnsoftmax",
            ["train.epochs=1", f"train.max_tokens={args.ptb_tokens}", *(TINY if args.tiny else [])]
            + (tiny("cnnsoftmax", ROWS["cnnsoftmax"]) if args.tiny else ROWS["cnnsoftmax"]),
        ),
    }
    with ThreadPoolExecutor(args.jobs) as pool:
        trained = {key: pool.submit(fit_in_subprocess, config, run, sets) for key, (config, run, sets) in runs.items()}
        results = {key: future.result() for key, future in trained.items()}
    bundles = {}
    for key, (_, run, _) in runs.items():
        bundle = run.parent / f"{run.name}.exact.bundle"
        manifest = bundle / "manifest.json"
        # a bundle exported before its run was trained again (other settings) is stale: export anew
        if not manifest.exists() or manifest.stat().st_mtime < (run / "results.json").stat().st_mtime:
            shutil.rmtree(bundle, ignore_errors=True)
            command = [sys.executable, "-m", "lmserve.training.cli", "export", "--checkpoint", str(run)]
            subprocess.run([*command, "--out", str(bundle), "--exact", "--threads", "1"], check=True, cwd=ROOT)
        bundles[key] = bundle

    metrics, details = {}, {}
    for name, spec in SETS.items():
        references = references_of(read_nbest(spec["list"]), "wer")
        normalizer = PRESETS[spec["preset"]]
        plain = Scorer(bundles[spec["model"]], threads=args.threads, normalizer=normalizer)
        opened = Scorer(bundles[spec["model"]], threads=args.threads, normalizer=normalizer, open_vocab=True)
        unk_scores, open_scores = plain.score(references), opened.score(references)
        unknown = [np.array([w not in plain.index for w in s.words], dtype=bool) for s in unk_scores]
        unk, open_ = perplexities(unk_scores, unknown), perplexities(open_scores, unknown)
        words = sum(len(s.words) for s in unk_scores)
        oov = int(sum(u.sum() for u in unknown))
        metrics |= {
            f"{name}_ppl_all_words": open_["ppl"],
            f"{name}_ppl_unk": unk["ppl"],
            f"{name}_ppl_known_words": unk["ppl_known_words"],
            f"{name}_oov_rate": oov / words,
        }
        details[name] = {
            "references": len(references),
            "words": words,
            "tokens": words + len(references),
            "oov": oov,
            "spelled": sum(s.spelled for s in open_scores),
            "mean_unk_logprob": unk["mean_unknown_logprob"],
            "mean_spelled_logprob": open_["mean_unknown_logprob"],
            "ppl_known_words_open": open_["ppl_known_words"],
            "preset": spec["preset"],
            "bundle": str(bundles[spec["model"]].relative_to(ROOT)),
            "model_test_ppl": results[spec["model"]]["test"]["ppl"],
            "model_tokens_seen": results[spec["model"]]["tokens_seen"],
        }
    print("\n".join(f"{k}: {v:.4g}" for k, v in metrics.items()))
    described = {
        k: {"config": str(c.relative_to(ROOT)), "run": str(r.relative_to(ROOT)), "set": s}
        for k, (c, r, s) in runs.items()
    }
    write_result(f"oov_scoring{suffix}", metrics, details=details, runs=described)


if __name__ == "__main__":
    main()
