"""``lm-rescore nbest --shard K/N`` then ``merge`` against one run, on LibriSpeech dev_other -> shard_merge.json

    python -m benchmarks.shard_merge [--shards 4] [--limit N]

The demo pair that ``make demo`` builds (var/bundles/demo, var/ngrams/demo_3gram.bin) and its dev_clean weights
(var/rescore/demo.weights.json: ``score``, ``interp`` at its λ, ``length``, PTB text normalisation, as the Makefile
runs it). Every run is its own ``lm-rescore`` process in a fresh folder (no score cache from another run), the shards
one after the other as a scheduler's array would run them anywhere. ``identical`` is 1 when the merged list is the
one run's byte for byte; ``report_identical`` when every field of the merged report equals the one run's, the leakage
check's timing aside. A second run of the whole list reads the first one's score cache and must write the same bytes
too (``rerun_from_cache_identical``). The LM quality does not matter here, only identity.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import DATA_DIR, demo_weights, list_head, write_result

TIMING = ("seconds", "seconds_per_million_words")


def lm_rescore(*args: str) -> float:
    """Wall seconds of one ``lm-rescore`` command (its output goes to our stderr)."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "lmserve.rescoring.commands.cli", *args], check=True, stdout=sys.stderr)
    return time.perf_counter() - start


def untimed(path: Path) -> dict:
    report = json.loads(path.read_text())
    for key in TIMING:
        report.get("overlap", {}).pop(key, None)
    return report


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--list", type=Path, default=DATA_DIR / "librispeech-nbest" / "dev_other.tar.gz")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--limit", type=int, help="only the first N utterances (a smoke test)")
    parser.add_argument("--name", default="shard_merge")
    args = parser.parse_args()
    weights = demo_weights()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        source = list_head(args.list, args.limit, tmp)
        common = ["nbest", str(source), "--weights", str(weights), "--out-format", "jsonl", "--quiet"]

        def run(folder: str, *flags: str) -> float:
            (tmp / folder).mkdir(exist_ok=True)
            out = ["--out", str(tmp / folder / "out.jsonl"), "--report", str(tmp / folder / "report.json")]
            return lm_rescore(*common, *out, *flags)

        seconds = {"one_run": run("whole")}
        first_sha = sha256(tmp / "whole" / "out.jsonl")
        seconds["rerun_from_cache"] = run("whole")  # the same folder: the first run's score cache is there
        shard_seconds = [run(f"shard{k}", "--shard", f"{k}/{args.shards}") for k in range(1, args.shards + 1)]
        reports = [str(tmp / f"shard{k}" / "report.json") for k in range(1, args.shards + 1)]
        merge = ["merge", *reports, "--out", str(tmp / "merged" / "out.jsonl")]
        seconds["merge"] = lm_rescore(*merge, "--report", str(tmp / "merged" / "report.json"))

        whole, merged = untimed(tmp / "whole" / "report.json"), untimed(tmp / "merged" / "report.json")
        same = (tmp / "whole" / "out.jsonl").read_bytes() == (tmp / "merged" / "out.jsonl").read_bytes()
        differing = [key for key in {**whole, **merged} if whole.get(key) != merged.get(key)]
        ranges = [json.loads(Path(r).read_text())["shard"] for r in reports]
        metrics = {
            "identical": int(same),
            "report_identical": int(not differing and list(whole) == list(merged)),
            "rerun_from_cache_identical": int(first_sha == sha256(tmp / "whole" / "out.jsonl")),
            "utterances": whole["utterances"],
            "hypotheses": whole["hypotheses"],
            "shards": args.shards,
            "shard_utterances": [s["stop"] - s["start"] for s in ranges],
            **{f"wer_{name}": whole[name]["wer"] for name in ("1best", "rescored", "oracle")},
            **{f"merged_wer_{name}": merged[name]["wer"] for name in ("1best", "rescored", "oracle")},
            "changed_choices": whole["changed_choices"],
            "merged_changed_choices": merged["changed_choices"],
            "bootstrap_p_value": whole["bootstrap"]["p_value"],
            "merged_bootstrap_p_value": merged["bootstrap"]["p_value"],
            "overlap_matched_references": whole.get("overlap", {}).get("matched_references"),
            "merged_overlap_matched_references": merged.get("overlap", {}).get("matched_references"),
            "output_sha256": sha256(tmp / "whole" / "out.jsonl"),
            "merged_output_sha256": sha256(tmp / "merged" / "out.jsonl"),
            "report_fields_differing": differing,
            "one_run_s": seconds["one_run"],
            "rerun_from_cache_s": seconds["rerun_from_cache"],
            "shard_s": shard_seconds,
            "merge_s": seconds["merge"],
        }
    print(json.dumps(metrics, indent=2))
    write_result(
        args.name,
        metrics,
        list=str(args.list),
        limit=args.limit,
        bundle="var/bundles/demo",
        ngram="var/ngrams/demo_3gram.bin",
        weights="var/rescore/demo.weights.json",
        note="each run its own process in a fresh folder; the shards one after the other; the timings come "
        "from a shared 2-core machine (informative only)",
    )


if __name__ == "__main__":
    main()
