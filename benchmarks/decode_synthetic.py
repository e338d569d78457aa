"""WER of pyctcdecode on synthetic CTC emissions: no LM, KenLM alone, our LM here, our LM over lm-serve ->
decode_synthetic.json

    python -m benchmarks.decode_synthetic [--utterances 100] [--tune-utterances 100] [--beams 16,32,64]

SYNTHETIC EMISSIONS: no real acoustic-model posteriors of a usable size are public, so LibriSpeech dev references go
through the character-level noisy channel of benchmarks/synthetic_ctc.py (its settings are in the result and in
every table made from it). The figures compare LMs inside one search on the same emissions; they say nothing about
WERs on audio.

Decoders, all pyctcdecode at the same beam width (beams 16/32/64; over lm-serve at ``--remote-beams``):

- ``no_lm``: pyctcdecode without a language model;
- ``kenlm``: pyctcdecode's own KenLM path (``LanguageModel``) with the 4-gram, its unigrams the bundle's vocabulary;
- ``ours``: our adapter (rescoring/decoders) with the bundle here, the 4-gram interpolated at λ (as served);
- ``ours_remote``: the same model served by lm-serve on this machine, one StreamNextWords stream, state tokens.

alpha and beta of KenLM and of ours are each tuned on dev_clean (a grid, ``--tune-utterances`` at beam 16) and
applied to dev_other (``--utterances``): never tuned on the test set. 100 tuning utterances, not 30: on 30 (227
words, one error 0.44%) the grid's choice for our LM moved between its points with a change of one or two errors. Speed: frames decoded per second of wall time
and LM calls per second (ours: one call per beam step and token depth; KenLM: one per (state, word) pyctcdecode
asks). The metrics are those at beam 32.
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
import time
from pathlib import Path

import kenlm
import numpy as np
from pyctcdecode import Alphabet, BeamSearchDecoderCTC
from pyctcdecode.language_model import LanguageModel

from benchmarks.common import write_result
from benchmarks.decoding import LABELS, add_model_arguments, references, serve_config
from benchmarks.synthetic_ctc import Channel
from lmserve.rescoring.decoders.lm import DecoderLM
from lmserve.rescoring.decoders.pyctcdecode_lm import build_ctcdecoder
from lmserve.rescoring.metrics import wer_report
from lmserve.server.process import ServerProcess


class CountingKenLM(LanguageModel):
    """pyctcdecode's KenLM ``LanguageModel``, counting its score calls."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = 0

    def score(self, prev_state, word, is_last_word=False):
        self.calls += 1
        return super().score(prev_state, word, is_last_word)


def kenlm_decoder(labels, ngram: Path, unigrams: list[str], alpha: float, beta: float):
    lm = CountingKenLM(kenlm.Model(str(ngram)), unigrams, alpha=alpha, beta=beta)
    return BeamSearchDecoderCTC(Alphabet.build_alphabet(labels), lm), lm


def run(decoder, emissions: list[np.ndarray], beam: int, calls=lambda: 0) -> dict:
    start_calls, start = calls(), time.perf_counter()
    texts = [decoder.decode(e, beam_width=beam) for e in emissions]
    seconds = time.perf_counter() - start
    frames = sum(len(e) for e in emissions)
    return {
        "texts": texts,
        "seconds": seconds,
        "frames_per_s": frames / seconds,
        "lm_calls": calls() - start_calls,
        "lm_calls_per_s": (calls() - start_calls) / seconds,
    }


def wer(texts: list[str], refs: list[str]) -> float:
    return wer_report(refs, texts)["wer"]


def tune(make, emissions, refs, grid, beam: int) -> tuple[dict, list]:
    """The (alpha, beta) of ``grid`` with the lowest WER on the tuning set; every point's WER."""
    points = []
    for alpha, beta in grid:
        decoder = make(alpha, beta)
        points.append({"alpha": alpha, "beta": beta, "wer": wer(run(decoder, emissions, beam)["texts"], refs)})
        print(f"  tune alpha={alpha} beta={beta}: WER {points[-1]['wer']:.2f}", flush=True)
    best = min(points, key=lambda p: p["wer"])
    return {"alpha": best["alpha"], "beta": best["beta"]}, points


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--utterances", type=int, default=100, help="dev_other utterances decoded")
    parser.add_argument("--tune-utterances", type=int, default=100, help="dev_clean utterances for alpha/beta")
    parser.add_argument("--beams", default="16,32,64")
    parser.add_argument("--remote-beams", default="32")
    parser.add_argument("--alphas", default="0.3,0.6,1.0")
    parser.add_argument("--betas", default="0.5,1.5")
    parser.add_argument("--labels", default="", help="(tests) CTC labels as one string after the blank")
    parser.add_argument("--texts", type=Path, help="(tests) tuning and test sentences, one file, halves")
    parser.add_argument("--no-write", action="store_true", help="print the result, write no file (tests)")
    args = parser.parse_args(argv)
    labels = ["", *args.labels] if args.labels else LABELS
    normalize = args.normalize or None
    if args.texts:
        lines = args.texts.read_text().splitlines()
        dev, test = lines[: args.tune_utterances], lines[args.tune_utterances :][: args.utterances]
    else:
        dev, test = references("dev_clean", args.tune_utterances, seed=1), references("dev_other", args.utterances)
    channel = Channel()
    # one generator each, so that the test emissions do not depend on how many tuning utterances came first
    dev_rng, test_rng = (np.random.default_rng([channel.seed, part]) for part in (0, 1))
    dev_emissions = [channel.emissions(t, labels, dev_rng) for t in dev]
    test_emissions = [channel.emissions(t, labels, test_rng) for t in test]
    beams = [int(b) for b in args.beams.split(",")]
    remote_beams = [int(b) for b in args.remote_beams.split(",") if b]
    grid = list(itertools.product(map(float, args.alphas.split(",")), map(float, args.betas.split(","))))
    local = DecoderLM.local(args.bundle, args.ngram, args.lam, normalize)
    unigrams = local.backend.vocabulary()

    def ours(lm):
        return lambda alpha, beta: build_ctcdecoder(labels, lm, alpha=alpha, beta=beta)

    def kenlm(alpha, beta):
        return kenlm_decoder(labels, args.ngram, unigrams, alpha, beta)[0]

    print("tuning KenLM on dev", flush=True)
    kenlm_weights, kenlm_grid = tune(kenlm, dev_emissions, dev, grid, 16)
    print("tuning ours on dev", flush=True)
    ours_weights, ours_grid = tune(ours(local), dev_emissions, dev, grid, 16)

    rows = []

    def record(name: str, beam: int, result: dict) -> None:
        row = {"decoder": name, "beam": beam, "wer": wer(result["texts"], test)}
        row |= {k: v for k, v in result.items() if k != "texts"}
        rows.append(row)
        print(json.dumps(row), flush=True)

    for beam in beams:
        record("no_lm", beam, run(build_ctcdecoder(labels), test_emissions, beam))
        decoder, counted = kenlm_decoder(labels, args.ngram, unigrams, **kenlm_weights)
        record("kenlm", beam, run(decoder, test_emissions, beam, lambda c=counted: c.calls))
        decoder = build_ctcdecoder(labels, local, **ours_weights)
        record("ours", beam, run(decoder, test_emissions, beam, lambda: local.calls))
    if remote_beams:
        with tempfile.TemporaryDirectory() as tmp:
            config = serve_config(Path(tmp), args.bundle, args.ngram, args.lam, normalize, workers=2)
            with ServerProcess(config, Path(tmp) / "server.log", start_timeout=300) as server:
                with DecoderLM.remote(server.address, "english") as remote:
                    for beam in remote_beams:
                        decoder = build_ctcdecoder(labels, remote, **ours_weights)
                        record("ours_remote", beam, run(decoder, test_emissions, beam, lambda: remote.calls))
                server.stop()

    def at(name: str, beam: int = 32) -> float | None:
        return next((r["wer"] for r in rows if r["decoder"] == name and r["beam"] == beam), None)

    metrics = {
        "wer_no_lm": at("no_lm"),
        "wer_kenlm": at("kenlm"),
        "wer_ours": at("ours"),
        "wer_ours_remote": at("ours_remote"),
    }
    extra = dict(
        note="SYNTHETIC EMISSIONS: LibriSpeech references through a character-level noisy channel, not audio",
        channel=channel.describe(),
        tuned_on={"set": "dev_clean" if not args.texts else "texts[:tune]", "utterances": len(dev), "beam": 16},
        test={"set": "dev_other" if not args.texts else "texts[tune:]", "utterances": len(test)},
        weights={"kenlm": kenlm_weights, "ours": ours_weights},
        tuning={"kenlm": kenlm_grid, "ours": ours_grid},
        rows=rows,
        model={"bundle": str(args.bundle), "ngram": str(args.ngram), "lambda": args.lam, "normalize": normalize},
        labels="".join(labels[1:]),
    )
    return write_result("decode_synthetic", metrics, no_write=args.no_write, **extra)


if __name__ == "__main__":
    main()
