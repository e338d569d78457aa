"""The 2x1024 English LM's bundle in fp32, fp16 and int8 weight storage: size and perplexity -> bundle_size.json

    python -m benchmarks.bundle_size --run var/runs/english_lm_gpu --threads 2

The general English LM of issue 31 (configs/english_lm_gpu.toml: 2x1024 LSTM, 256-wide input embedding, 512-wide
projection, 50k-word adaptive softmax; 30.4M parameters) is exported three times with ``lm-train export --weights``
and the LibriSpeech dev_other references (in the ``librispeech`` preset, the LM's own form) as the held-out text, so
that each manifest's ``heldout.score_ppl`` is the dev_other reference perplexity of the stored graphs (OOV words as
<unk>, </s> counted) and ``heldout.ppl`` that of PyTorch in fp32. ``ppl_change_pct`` of a storage is its score_ppl
over the fp32 bundle's, minus 1, in percent. ``bytes`` is the whole bundle folder (graphs, weights.bin, vocabulary,
manifest). The headline ``bytes`` and ``ppl_change_pct`` are those of the smallest storage whose perplexity is within
1% of fp32 (the rule is fixed here, before the figures). ``three_graph_bytes`` is what the fp32 bundle weighed before
the graphs shared one weights file: its graphs' external data counted once per graph. Scoring speed: the first
``--speed-sentences`` references through each bundle's scorer, taking turns (``*_score_s``, median of 3 rounds).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import onnx

from benchmarks.common import DATA_DIR, ROOT, time_interleaved, write_result
from lmserve.core.bundle import Bundle
from lmserve.core.textnorm import PRESETS
from lmserve.rescoring.nbest import read_nbest
from lmserve.rescoring.rescore import references_of
from lmserve.rescoring.scorer import Scorer

STORAGES = ("fp32", "fp16", "int8")
PPL_BOUND_PCT = 1.0


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir())


def three_graph_bytes(bundle: Bundle) -> int:
    """The bundle's size had every graph carried its own weights (the layout before weights.bin)."""
    total = folder_bytes(bundle.path) - (bundle.path / bundle.manifest["weights"]["file"]).stat().st_size
    for name in bundle.manifest["graphs"]:
        model = onnx.load(str(bundle.graph_path(name)), load_external_data=False)
        for init in model.graph.initializer:
            total += sum(int(e.value) for e in init.external_data if e.key == "length")
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, default=ROOT / "var" / "runs" / "english_lm_gpu")
    parser.add_argument("--list", type=Path, default=DATA_DIR / "librispeech-nbest" / "dev_other.tar.gz")
    parser.add_argument("--out", type=Path, default=ROOT / "var" / "bundle_size")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--speed-sentences", type=int, default=400)
    args = parser.parse_args()
    import torch

    from lmserve.training.export import export_bundle

    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    references = [" ".join(PRESETS["librispeech"].normalize(r)) for r in references_of(read_nbest(args.list), "wer")]
    heldout = args.out / "dev_other_references.txt"
    heldout.write_text("\n".join(references) + "\n")
    bundles = {}
    for storage in STORAGES:
        path = args.out / f"english_lm_{storage}"
        if not (path / "manifest.json").exists():  # resumable: an export is minutes on two cores
            export_bundle(args.run, path, heldout=str(heldout), weights=storage)
        bundles[storage] = Bundle.load(path)
    held = {k: b.manifest["heldout"] for k, b in bundles.items()}
    metrics = {"fp32_ppl": held["fp32"]["score_ppl"], "torch_fp32_ppl": held["fp32"]["ppl"]}
    for storage, bundle in bundles.items():
        metrics[f"{storage}_bytes"] = folder_bytes(bundle.path)
        metrics[f"{storage}_ppl_change_pct"] = 100 * (held[storage]["score_ppl"] / held["fp32"]["score_ppl"] - 1)
        metrics[f"{storage}_max_abs_diff"] = held[storage]["max_abs_diff"]
    metrics["three_graph_bytes"] = three_graph_bytes(bundles["fp32"])
    within = [s for s in STORAGES if abs(metrics[f"{s}_ppl_change_pct"]) <= PPL_BOUND_PCT]
    chosen = min(within, key=lambda s: metrics[f"{s}_bytes"])
    metrics |= {"bytes": metrics[f"{chosen}_bytes"], "ppl_change_pct": metrics[f"{chosen}_ppl_change_pct"]}
    sample = references[: args.speed_sentences]
    scorers = {k: Scorer(b, threads=args.threads) for k, b in bundles.items()}
    seconds = time_interleaved({k: (lambda s=s: s.score(sample)) for k, s in scorers.items()})
    metrics |= {f"{k}_score_s": v for k, v in seconds.items()}
    write_result(
        "bundle_size",
        metrics,
        chosen_storage=chosen,
        model=str(args.run),
        heldout={"list": str(args.list), "sentences": held["fp32"]["sentences"], "tokens": held["fp32"]["tokens"]},
        rule=f"the smallest storage whose dev_other reference perplexity is within {PPL_BOUND_PCT}% of fp32",
    )


if __name__ == "__main__":
    main()
