"""What float16 weights alone cost the scorer's scores, before any float16 arithmetic -> fp16_rounding.json

    python -m benchmarks.fp16_rounding --normalize ptb                              # the demo bundle (make demo)
    python -m benchmarks.fp16_rounding --bundle .gpu/bundle --name fp16_rounding_2x1024

``precision="fp16"`` runs on a GPU only (``rescoring.precision``); its bound there is ``gpu_scorer``'s
``fp16_token_max_abs_diff``. This is the part a CPU can show: the graphs ``half_graph`` writes, run by the CPU
provider, which widens every float16 node to float32 and drops the round trips to float16 between nodes that it can,
so that what is left is mostly the weights' rounding: a lower bound. The LibriSpeech dev_other 30-best
lists (the first ``--lists``) are scored by the bundle's float32 graphs and by those, through the same ``Scorer`` code
(its sessions swapped), and compared as ``gpu_scorer.parity`` compares a GPU scorer with the CPU's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import onnxruntime as ort

from benchmarks.common import ROOT, add_results_option, use_results, write_result
from benchmarks.gpu_scorer import parity, scored_lists
from benchmarks.serve_harness import DEV_OTHER
from lmserve.core.textnorm import PRESETS
from lmserve.rescoring.nbest import read_nbest
from lmserve.rescoring.precision import half_graph
from lmserve.rescoring.scorer import Scorer


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", type=Path, default=ROOT / "var" / "bundles" / "demo")
    parser.add_argument("--list", type=Path, default=DEV_OTHER)
    parser.add_argument("--normalize", default="", help="textnorm preset (default: the bundle's own)")
    parser.add_argument("--lists", type=int, default=100)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--name", default="fp16_rounding", help="the result file's name")
    add_results_option(parser)
    args = parser.parse_args(argv)
    use_results(args.results)

    normalizer = PRESETS[args.normalize] if args.normalize else None
    fp32, rounded = (Scorer(args.bundle, threads=args.threads, normalizer=normalizer) for _ in range(2))
    options = rounded.options
    options.log_severity_level = 3  # not the warning per float16 node that constant folding has no CPU kernel for
    for name in rounded.sessions:
        rounded.sessions[name] = ort.InferenceSession(half_graph(rounded.bundle.graph_path(name)), options)
    lists = [[h.text for h in entry.hypotheses] for entry in read_nbest(args.list).entries[: args.lists]]
    want, got = scored_lists(fp32, lists, 32), scored_lists(rounded, lists, 32)
    metrics = parity(want, got) | {"tokens": sum(len(s.token_logprobs) for scores in want for s in scores)}
    manifest = fp32.bundle.manifest
    extra = dict(
        bundle=str(args.bundle),
        model=manifest["model"],
        heldout_ppl=manifest["heldout"]["ppl"],
        weights=manifest.get("weights", {}).get("storage", "fp32"),
        list=str(args.list),
        lists=len(lists),
        normalize=args.normalize or "the bundle's own",
    )
    write_result(args.name, metrics, **extra)
    print(json.dumps(metrics))
    return {"metrics": metrics, **extra}


if __name__ == "__main__":
    main()
