"""The HTML error analysis of a real run: generation time and size for dev_other -> html_report.json, and screenshots.

    make demo    # var/bundles/demo, var/ngrams/demo_3gram.bin, var/rescore/demo.weights.json and the LM score cache
    python -m benchmarks.html_report [--screenshots docs]

The rescoring is done once; what is timed is what ``--html`` adds (``rescoring.report_html.write_html``), best and
median of 3 runs. ``--screenshots DIR`` renders the page with headless Chromium once per filter
(``DIR/html_report_FILTER.png``). Figures: docs/benchmarks/rescoring.md ("HTML error analysis of dev_other").
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from PIL import Image

from benchmarks.common import DATA_DIR, ROOT, write_result
from lmserve.rescoring import overlap
from lmserve.rescoring.nbest import read_nbest
from lmserve.rescoring.report_html import write_html
from lmserve.rescoring.rescore import LanguageModels, report, reranked, setup_from_record, setup_record
from lmserve.rescoring.tune import read_weights

FILTERS = ("all", "changed", "improved", "worsened", "unchanged")
TARGET_SECONDS = 5.0


def chromium_command(url: str, png: Path, profile: str, size: str) -> list[str]:
    """Headless Chromium that fetches nothing besides the page (no GPU, QUIC, first-run, sync, updates)."""
    return [
        shutil.which("chromium") or "chromium",
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
        f"--window-size={size}",
        f"--screenshot={png}",
        url,
    ]


def screenshots(page: Path, out: Path, size: str = "1400,1800") -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    made = []
    for name in FILTERS:
        png = out / f"html_report_{name}.png"
        with tempfile.TemporaryDirectory() as profile:
            url = f"file://{page.resolve()}#filter={name}&open=1" + ("&features=1" if name == "changed" else "")
            command = chromium_command(url, png, profile, size)
            subprocess.run(command, check=True, capture_output=True, timeout=120)
        Image.open(png).convert("P", palette=Image.Palette.ADAPTIVE, colors=64).save(png, optimize=True)  # small
        print(" ".join(command).replace(profile, "$(mktemp -d)"))
        made.append(str(png.relative_to(ROOT) if png.is_relative_to(ROOT) else png))
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", type=Path, default=ROOT / "var" / "rescore" / "demo.weights.json")
    parser.add_argument("--cache", type=Path, default=ROOT / "var" / "rescore" / "dev_other.lmscores.jsonl")
    parser.add_argument("--out", type=Path, default=ROOT / "var" / "rescore" / "dev_other.report.html")
    parser.add_argument("--screenshots", type=Path, help="folder for PNG screenshots of every filter (Chromium)")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    record = read_weights(args.weights)
    saved = record["setup"]
    nbest = read_nbest(DATA_DIR / "librispeech-nbest" / "dev_other.tar.gz")
    models = LanguageModels.load(saved["lm"], saved["ngram"], saved["normalize"], threads=1)
    setup = setup_from_record(record)
    ranked, chosen = reranked(nbest, setup, models.scores(nbest, args.cache))
    rep = report(nbest, chosen, record["metric"])
    rep.update(weights={"file": str(args.weights), **record["weights"]}, setup=setup_record(models, setup))
    rep["normalisation"] = models.normalisation
    texts = overlap.training_texts(models.scorer.bundle.manifest)  # what lm-rescore nbest checks by itself
    refs = [e.references[0] for e in nbest]
    leak = overlap.measure(refs, texts, ids=[e.id for e in nbest], reference_view=models.normalizer.normalize)
    rep["overlap"] = {**leak.to_dict(), "warning": leak.warning()}
    seconds = []
    for _ in range(args.runs):
        start = time.perf_counter()
        write_html(args.out, rep, nbest, ranked, chosen)
        seconds.append(time.perf_counter() - start)
    size = args.out.stat().st_size
    print(f"{args.out}: {size / 1e6:.1f} MB in {min(seconds):.2f} s (median {statistics.median(seconds):.2f} s)")
    made = screenshots(args.out, args.screenshots) if args.screenshots else []
    write_result(
        "html_report",
        {
            "utterances": len(nbest),
            "hypotheses": nbest.num_hypotheses,
            "seconds_best": round(min(seconds), 3),
            "seconds_median": round(statistics.median(seconds), 3),
            "target_seconds": TARGET_SECONDS,
            "meets_target": min(seconds) <= TARGET_SECONDS,
            "bytes": size,
        },
        list="librispeech-nbest/dev_other.tar.gz",
        weights=str(args.weights.relative_to(ROOT) if args.weights.is_relative_to(ROOT) else args.weights),
        wer={name: rep[name]["wer"] for name in ("1best", "rescored", "oracle")},
        changed_choices=rep["changed_choices"],
        screenshots=made,
    )


if __name__ == "__main__":
    main()
