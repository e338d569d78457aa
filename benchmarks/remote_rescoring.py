"""``lm-rescore nbest --server`` through local lm-serve replicas against the offline run, on LibriSpeech dev_other
-> remote_rescoring.json

    python -m benchmarks.remote_rescoring [--rounds 3] [--limit N]

``make demo``'s pair and dev_clean weights. Each case is one whole ``lm-rescore nbest`` process, start to exit:
offline on every core, or through 1 or 2 replicas (started once, ``workers`` calls of 1 thread each, batching on)
with ``--concurrency`` calls in flight. The cases take turns; figures are medians over the rounds, and every run's
list must be the offline one byte for byte (``identical_all``). Figures: docs/benchmarks/rescoring-at-scale.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import DATA_DIR, ROOT, demo_weights, list_head, write_result
from lmserve.rescoring.nbest import read_nbest
from lmserve.server.process import ServerProcess

BUNDLE = ROOT / "var" / "bundles" / "demo"
NGRAM = ROOT / "var" / "ngrams" / "demo_3gram.bin"


def server_config(folder: Path, workers: int, engine: str) -> Path:
    config = folder / "serve.toml"
    config.write_text(
        f'[server]\nworkers = {workers}\nengine = "{engine}"\nscorer_threads = 1\n\n'
        "[batching]\nenabled = true\n\n"
        f'[models.demo]\nbundle = "{BUNDLE}"\nngram = "{NGRAM}"\nnormalize = "ptb"\nlambda = 0.5\n'
    )
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--list", type=Path, default=DATA_DIR / "librispeech-nbest" / "dev_other.tar.gz")
    parser.add_argument("--limit", type=int, help="only the first N utterances (a smoke test)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--lists-per-call", type=int, default=1)
    parser.add_argument("--workers", type=int, default=1, help="scorer calls at once per replica")
    parser.add_argument("--engine", choices=("threads", "processes"), default="threads")
    parser.add_argument("--name", default="remote_rescoring")
    args = parser.parse_args()
    weights = demo_weights()
    levels = [int(c) for c in args.concurrency.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        source = list_head(args.list, args.limit, tmp)
        hypotheses = read_nbest(source).num_hypotheses
        config = server_config(tmp, args.workers, args.engine)
        with ServerProcess(config, tmp / "a.log") as a, ServerProcess(config, tmp / "b.log") as b:
            one, two = f"127.0.0.1:{a.port}", f"127.0.0.1:{a.port},127.0.0.1:{b.port}"
            cases = {"offline": ["--threads", "0"]}
            for replicas, target in (("", one), ("_two_replicas", two)):
                for c in levels:
                    flags = ["--server", target, "--concurrency", str(c), "--lists-per-call", str(args.lists_per_call)]
                    cases[f"c{c}{replicas}"] = flags
            seconds: dict[str, list[float]] = {name: [] for name in cases}
            identical = True
            for round_ in range(args.rounds):
                reference = None
                for name, flags in cases.items():
                    folder = tmp / f"{name}-{round_}"  # fresh: no score cache from an earlier run
                    folder.mkdir()
                    command = [sys.executable, "-m", "lmserve.rescoring.commands.cli", "nbest", str(source)]
                    command += ["--weights", str(weights), "--out", str(folder / "out.jsonl"), "--quiet"]
                    command += ["--report", str(folder / "report.json"), "--no-overlap-check", *flags]
                    start = time.perf_counter()
                    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
                    seconds[name].append(time.perf_counter() - start)
                    out = (folder / "out.jsonl").read_bytes()
                    reference = reference or out
                    identical &= out == reference
                    print(f"round {round_ + 1}: {name}: {seconds[name][-1]:.2f} s", file=sys.stderr)
    median = {name: statistics.median(values) for name, values in seconds.items()}
    metrics = {f"{name}_hyp_per_s": hypotheses / s for name, s in median.items()}
    best = max(levels)
    metrics[f"c{best}_two_replicas_vs_offline"] = median["offline"] / median[f"c{best}_two_replicas"]
    metrics["identical_all"] = int(identical)
    metrics["hypotheses"] = hypotheses
    metrics["seconds"] = seconds
    print(json.dumps(metrics, indent=2))
    write_result(
        args.name,
        metrics,
        list=str(args.list),
        limit=args.limit,
        rounds=args.rounds,
        lists_per_call=args.lists_per_call,
        server={"workers": args.workers, "engine": args.engine, "scorer_threads": 1, "batching": True},
        bundle="var/bundles/demo",
        ngram="var/ngrams/demo_3gram.bin",
        weights="var/rescore/demo.weights.json",
    )


if __name__ == "__main__":
    main()
