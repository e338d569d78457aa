"""The general English LM (configs/english_lm_gpu.toml) trained in one GPU lease: what travels there and back.

A lease carries at most 64 MiB each way, in files of at most 16 MiB (the device tool's limits), and the 2x1024 LM
holds about 25M parameters (100 MB in fp32). So:

    python -m benchmarks.english_lm_gpu pack-text [--mib 58]     # here: .gpu/text, the training text that fits
    bash benchmarks/english_lm_gpu.sh                           # there: prepare, fit, pack-weights into $OUT
    python -m benchmarks.english_lm_gpu unpack DIR --out var/runs/english_lm_gpu   # here: a checkpoint again

``pack-text`` writes the normalised english-text training sentences whole and as much of gutenberg-large's training
text as the budget leaves (xz-compressed, the first lines of it), plus english-text's valid and test splits.
``pack-weights`` stores the newest checkpoint's weights in fp16 (the model trained under bf16 autocast with fp32
master weights; fp16 keeps 11 bits of mantissa, the scores move by about 1e-3 nats) in parts of at most 15 MiB,
splitting a tensor by rows where it is larger, with the checkpoint's config, vocabulary and state beside them;
``unpack`` puts them back together as a checkpoint folder (fp32 weights) that ``lm-train eval``/``export`` read.
"""

from __future__ import annotations

import argparse
import gzip
import json
import lzma
import shutil
from pathlib import Path

PART_BYTES = 15 * 2**20
META = "meta.json"
SUBWORD_MODEL = "subword.model"  # a subword run's sentencepiece model (training.subword.MODEL_FILE), packed beside it


def pack_text(english: Path, gutenberg: Path, out: Path, mib: float) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    for split in ("valid", "test"):
        shutil.copyfile(english / f"{split}.txt.gz", out / f"{split}.txt.gz")
    budget = int(mib * 2**20)
    with gzip.open(english / "train.txt.gz", "rb") as f:
        data = f.read()
    packed = lzma.compress(data, preset=6)
    (out / "english.train.txt.xz").write_bytes(packed)
    left = budget - len(packed) - sum((out / f"{s}.txt.gz").stat().st_size for s in ("valid", "test"))
    # xz packs this text at about 1.26 bytes a word: take lines until the compressed size would pass the budget
    lines = words = size = 0
    compressor = lzma.LZMACompressor(preset=6)
    chunks = []
    with gzip.open(gutenberg / "train.txt.gz", "rt", encoding="utf-8") as f:
        for line in f:
            chunks.append(compressor.compress(line.encode("utf-8")))
            size += len(chunks[-1])
            words += len(line.split())
            lines += 1
            if size > left - 2**20:  # the flush below adds what the compressor still holds
                break
    chunks.append(compressor.flush())
    (out / "gutenberg.train.txt.xz").write_bytes(b"".join(chunks))
    summary = {
        "english_words": len(data.split()),
        "gutenberg_lines": lines,
        "gutenberg_words": words,
        "bytes": sum(p.stat().st_size for p in out.iterdir()),
    }
    (out / "pack.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def pack_weights(run: Path, out: Path, which: str = "latest") -> dict:
    """``which``: the checkpoint pointer to pack, "latest" (a run cut short by SIGTERM) or "best" (early stopping)."""
    import torch
    from safetensors.torch import load_file, save_file

    ckpt = run / "checkpoints" / (run / "checkpoints" / which).read_text().strip()
    tensors = load_file(str(ckpt / "model.safetensors"))
    out.mkdir(parents=True, exist_ok=True)
    parts: list[dict[str, torch.Tensor]] = [{}]
    sizes = [0]
    layout = {}
    for name, tensor in tensors.items():
        half = tensor.to(torch.float16).contiguous()
        rows = max(1, PART_BYTES // max(1, half[0].numel() * 2)) if half.dim() > 0 else 1
        pieces = list(half.split(rows)) if half.dim() > 0 and half.numel() * 2 > PART_BYTES else [half]
        layout[name] = {"dtype": str(tensor.dtype).removeprefix("torch."), "pieces": len(pieces)}
        for k, piece in enumerate(pieces):
            nbytes = piece.numel() * 2
            if sizes[-1] + nbytes > PART_BYTES:
                parts.append({})
                sizes.append(0)
            parts[-1][f"{name}#{k}"] = piece.contiguous()
            sizes[-1] += nbytes
    for i, part in enumerate(parts):
        save_file(part, str(out / f"model.part{i}.safetensors"))
    meta = {
        "checkpoint": ckpt.name,
        "layout": layout,
        "parts": len(parts),
        "config": json.loads((ckpt / "config.json").read_text()),
        "state": json.loads((ckpt / "state.json").read_text()),
    }
    (out / META).write_text(json.dumps(meta) + "\n")
    for name in ("vocab.tsv", SUBWORD_MODEL):
        if (ckpt / name).is_file():
            shutil.copyfile(ckpt / name, out / name)
    return {"checkpoint": ckpt.name, "parts": len(parts)}


def unpack(packed: Path, out: Path) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    meta = json.loads((packed / META).read_text())
    pieces: dict[str, torch.Tensor] = {}
    for i in range(meta["parts"]):
        pieces.update(load_file(str(packed / f"model.part{i}.safetensors")))
    tensors = {
        name: torch.cat([pieces[f"{name}#{k}"] for k in range(info["pieces"])]).to(getattr(torch, info["dtype"]))
        for name, info in meta["layout"].items()
    }
    ckpt = out / "checkpoints" / meta["checkpoint"]
    ckpt.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(ckpt / "model.safetensors"))
    (ckpt / "config.json").write_text(json.dumps(meta["config"], indent=2) + "\n")
    (ckpt / "state.json").write_text(json.dumps(meta["state"], indent=2) + "\n")
    for name in ("vocab.tsv", SUBWORD_MODEL):
        if (packed / name).is_file():
            shutil.copyfile(packed / name, ckpt / name)
    for pointer in ("latest", "best"):
        (out / "checkpoints" / pointer).write_text(meta["checkpoint"] + "\n")
    return ckpt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    text = sub.add_parser("pack-text")
    text.add_argument("--english", type=Path, default=Path("var/english-text"))
    text.add_argument("--gutenberg", type=Path, default=Path("var/gutenberg-large"))
    text.add_argument("--out", type=Path, default=Path(".gpu/text"))
    text.add_argument("--mib", type=float, default=58.0, help="size of everything packed (default %(default)s)")
    weights = sub.add_parser("pack-weights")
    weights.add_argument("run", type=Path)
    weights.add_argument("out", type=Path)
    weights.add_argument("--which", choices=("latest", "best"), default="latest")
    back = sub.add_parser("unpack")
    back.add_argument("packed", type=Path)
    back.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.command == "pack-text":
        print(json.dumps(pack_text(args.english, args.gutenberg, args.out, args.mib)))
    elif args.command == "pack-weights":
        print(json.dumps(pack_weights(args.run, args.out, args.which)))
    else:
        print(unpack(args.packed, args.out))


if __name__ == "__main__":
    main()
