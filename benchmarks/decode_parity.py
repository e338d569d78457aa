"""The decoders' summed LM scores against ``lm-rescore score`` -> decode_parity.json

    python -m benchmarks.decode_parity [--utterances 100] [--beam 32]

LibriSpeech dev_other references become synthetic CTC emissions (benchmarks/synthetic_ctc.py, the channel's
settings in the result) and are decoded with our LM in the loop: pyctcdecode with the bundle here (the 4-gram
interpolated at λ, as served), pyctcdecode with the same model over lm-serve (one stream, state tokens), and
flashlight-text's lexicon decoder (the bundle's vocabulary spelled in characters) with the bundle here. For every
decoded sentence, the neural LM score the adapter summed along the decoded path (its words, then </s>) is compared
with ``lm-rescore score --lm BUNDLE --normalize librispeech`` run as a command on the decoded sentences.
``max_abs_diff`` is the largest difference over all of them (target ≤ 1e-4).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import write_result
from benchmarks.decoding import LABELS, add_model_arguments, references, serve_config
from benchmarks.synthetic_ctc import Channel
from lmserve.rescoring.decoders.lm import DecoderLM
from lmserve.rescoring.decoders.pyctcdecode_lm import build_ctcdecoder
from lmserve.server.process import ServerProcess


def lm_rescore_score(bundle: Path, normalize: str | None, sentences: list[str], folder: Path) -> list[float]:
    """``lm-rescore score`` itself, as a user runs it."""
    path = folder / "decoded.txt"
    path.write_text("".join(s + "\n" for s in sentences))
    command = [
        sys.executable,
        "-m",
        "lmserve.rescoring.commands.cli",
        "score",
        "--lm",
        str(bundle),
        "--input",
        str(path),
    ]
    command += ["--format", "jsonl", "--threads", "1", *(["--normalize", normalize] if normalize else [])]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return [json.loads(line)["logprob"] for line in out.splitlines()]


def pyctcdecode_paths(lm: DecoderLM, labels, emissions: list[np.ndarray], beam: int, alpha: float, beta: float):
    decoder = build_ctcdecoder(labels, lm, alpha=alpha, beta=beta)
    out = []
    for e in emissions:
        text, state, *_ = decoder.decode_beams(e, beam_width=beam)[0]
        out.append((text, state.neural))
    return out


def flashlight_paths(
    lm: DecoderLM, labels, vocabulary: list[str], emissions: list[np.ndarray], beam: int, alpha: float
):
    """The bundle's words that the labels spell, as a lexicon ("|" after each word, as wav2letter's)."""
    from lmserve.rescoring.decoders.flashlight_lm import LMServeFlashlightLM, lexicon_decoder

    words = [w for w in vocabulary if all(c in labels[2:] for c in w)]
    tokens = ["-", "|", *labels[2:]]
    fl_lm = LMServeFlashlightLM(lm, [*words, "<unk>"])
    decoder = lexicon_decoder(tokens, {w: [[*w, "|"]] for w in words}, fl_lm, beam_size=beam, lm_weight=alpha)
    out = []
    silence = np.full((1, len(labels)), np.log(1e-4), dtype=np.float32)
    silence[0, 1] = 0.0
    for e in emissions:
        (best,) = decoder.decode(np.concatenate([e, silence]))  # "|" ends the last word, as wav2letter's data does
        path = fl_lm.path([fl_lm.words.index(w) for w in best.words])
        out.append((" ".join(best.words), path.neural))
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--split", default="dev_other")
    parser.add_argument("--utterances", type=int, default=100)
    parser.add_argument("--beam", type=int, default=32)
    parser.add_argument("--alpha", type=float, default=0.5)
    parser.add_argument("--beta", type=float, default=1.0)
    parser.add_argument("--flashlight-utterances", type=int, default=20, help="0: no flashlight decoding")
    parser.add_argument("--labels", default="", help="(tests) CTC labels as one string after the blank")
    parser.add_argument("--texts", type=Path, help="(tests) sentences to decode instead of LibriSpeech's")
    parser.add_argument("--no-write", action="store_true", help="print the result, write no file (tests)")
    args = parser.parse_args(argv)
    labels = ["", *args.labels] if args.labels else LABELS
    normalize = args.normalize or None
    texts = args.texts.read_text().splitlines() if args.texts else references(args.split, args.utterances)
    texts = texts[: args.utterances]
    channel = Channel()
    rng = np.random.default_rng(channel.seed)
    emissions = [channel.emissions(t, labels, rng) for t in texts]
    ngram = args.ngram if args.ngram and args.ngram.exists() else None
    runs: dict[str, list[tuple[str, float]]] = {}
    seconds: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        local = DecoderLM.local(args.bundle, ngram, args.lam if ngram else None, normalize)
        start = time.perf_counter()
        runs["pyctcdecode_local"] = pyctcdecode_paths(local, labels, emissions, args.beam, args.alpha, args.beta)
        seconds["pyctcdecode_local"] = time.perf_counter() - start
        config = serve_config(tmp / "server", args.bundle, ngram, args.lam if ngram else None, normalize, workers=1)
        with ServerProcess(config, tmp / "server.log", start_timeout=300) as server:
            with DecoderLM.remote(server.address, "english") as remote:
                start = time.perf_counter()
                runs["pyctcdecode_remote"] = pyctcdecode_paths(
                    remote, labels, emissions, args.beam, args.alpha, args.beta
                )
                seconds["pyctcdecode_remote"] = time.perf_counter() - start
            server.stop()
        if args.flashlight_utterances:
            try:
                vocabulary = local.backend.vocabulary()
                start = time.perf_counter()
                chosen = emissions[: args.flashlight_utterances]
                runs["flashlight_local"] = flashlight_paths(local, labels, vocabulary, chosen, args.beam, args.alpha)
                seconds["flashlight_local"] = time.perf_counter() - start
            except ImportError as e:
                print(f"flashlight-text missing, skipped: {e}", file=sys.stderr)
        per_decoder = {}
        worst = 0.0
        for name, paths in runs.items():
            cli = lm_rescore_score(args.bundle, normalize, [text for text, _ in paths], tmp)
            diffs = np.abs(np.array([score for _, score in paths]) - np.array(cli))
            worst = max(worst, float(diffs.max()))
            per_decoder[name] = {
                "sentences": len(paths),
                "max_abs_diff": float(diffs.max()),
                "mean_abs_diff": float(diffs.mean()),
                "seconds": seconds[name],
                "examples": [
                    {"text": t, "adapter": s, "lm_rescore_score": c}
                    for (t, s), c in list(zip(paths, cli, strict=True))[:3]
                ],
            }
            print(f"{name}: {len(paths)} sentences, max |diff| {diffs.max():.3g}", flush=True)
    metrics = {"max_abs_diff": worst}
    extra = dict(
        target="max_abs_diff <= 1e-4",
        decoders=per_decoder,
        channel=channel.describe(),
        split=args.split,
        beam=args.beam,
        alpha=args.alpha,
        beta=args.beta,
        model={
            "bundle": str(args.bundle),
            "ngram": str(ngram) if ngram else None,
            "lambda": args.lam,
            "normalize": normalize,
        },
        compared="the adapter's summed neural score of the decoded words and </s> vs lm-rescore score (neural)",
    )
    if args.no_write:
        print(json.dumps({"metrics": metrics, **extra}, indent=1))
    else:
        write_result("decode_parity", metrics, **extra)
    return {"metrics": metrics, **extra}


if __name__ == "__main__":
    main()
