"""Decoding speed with our LM against KenLM's, every decoder on the same emissions in one run -> decode_speed.json

    python -m benchmarks.decode_speed --bundle var/bundles/demo --ngram var/ngrams/demo_3gram.bin --normalize ptb \
        [--utterances 50] [--beam 32] [--alpha 0.6] [--beta 1.5] [--rounds 3]
    python -m benchmarks.decode_speed --bundle models/english_lm --ngram var/ngrams/english_lm_4gram.bin \
        --normalize librispeech --name decode_speed_english_lm      # the shipped English LM (make ngram-english_lm)

SYNTHETIC EMISSIONS (benchmarks/synthetic_ctc.py, as decode_synthetic): LibriSpeech dev_other references through a
character-level noisy channel, in the case of the model's text normaliser (a PTB model reads lower case). Rows, one
beam width, one alpha and beta for every LM (our LM's scores are natural logs; flashlight's KenLM gives log10, so its
``lm_weight`` is alpha · ln 10 and the fused weights are the same):

- pyctcdecode: no LM, + KenLM (pyctcdecode's own ``LanguageModel``, its unigrams the bundle's vocabulary), + ours in
  this process (``DecoderLM.local``: the bundle, the n-gram interpolated at λ), + ours over lm-serve on this machine
  (one StreamNextWords stream, state tokens; the server's CPU is not counted, its wall time is);
- flashlight-text's lexicon decoder (the bundle's words spelled in the labels): + KenLM (flashlight's own) and + ours
  (``LMServeFlashlightLM`` over the same local ``DecoderLM``).

Time per utterance: the median over ``--rounds`` rounds in which the rows take turns (``common.time_interleaved``: on
a shared machine the ratios stay fair when the load changes), wall time (``ms_per_utt``, the issue's measure) and
this process's CPU time (``cpu_ms_per_utt``: every decoder here runs on one thread, so on a machine that other jobs
share it is the work itself, which waits on the CPU do not inflate; the remote row's leaves the server's out).
``max_abs_diff``: over every utterance of every row of ours, the decoded path's summed LM scores (``neural`` and the
interpolated ``logprob``) against the engine's ``lm-rescore score`` of the tokens the decoder's LM read on that path
(words normalised one by one).
``server_cpu_ms_per_step``: the server's CPU per beam step of 16 decoders of beam 32 stepping as ``beam_step_load``'s
``batched`` way, on the same server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import common
from benchmarks.common import time_interleaved, write_result
from benchmarks.decode_synthetic import kenlm_decoder, wer
from benchmarks.decoding import LABELS, add_model_arguments, cpu_seconds, references, serve_config
from benchmarks.synthetic_ctc import Channel
from lmserve.core.bundle import Bundle
from lmserve.core.textnorm import PRESETS, TextNormalizer
from lmserve.rescoring.decoders.lm import DecoderLM
from lmserve.rescoring.decoders.pyctcdecode_lm import build_ctcdecoder
from lmserve.rescoring.interpolated import InterpolatedLM
from lmserve.rescoring.ngram import NgramLM
from lmserve.rescoring.scorer import Scorer
from lmserve.server.process import ServerProcess


def flashlight_decoders(labels, bundle: Bundle, ngram: Path, local: DecoderLM, args):
    """flashlight's lexicon decoder with KenLM and with ours: tokens are the labels with flashlight's blank and
    silence, the lexicon every bundle word spelled in them (then the silence)."""
    from flashlight.lib.text.decoder import (
        CriterionType,
        LexiconDecoder,
        LexiconDecoderOptions,
        SmearingMode,
        Trie,
    )
    from flashlight.lib.text.decoder.kenlm import KenLM
    from flashlight.lib.text.dictionary import Dictionary

    from lmserve.rescoring.decoders.flashlight_lm import LMServeFlashlightLM, lexicon_decoder

    tokens = ["-", "|", *labels[2:]]
    lexicon = {w: [[*w, "|"]] for w in bundle.tokens if w and set(w) <= set(tokens[2:])}
    ours = lexicon_decoder(tokens, lexicon, LMServeFlashlightLM(local, [*lexicon, "<unk>"]), beam_size=args.beam,
                           lm_weight=args.alpha, word_score=args.beta)  # fmt: skip
    words = Dictionary()
    for word in [*lexicon, "<unk>"]:  # the numbering of LMServeFlashlightLM's words
        words.add_entry(word)
    kenlm = KenLM(str(ngram), words)
    trie = Trie(len(tokens), 1)
    start = kenlm.start(False)
    index = {t: i for i, t in enumerate(tokens)}
    for word, spellings in lexicon.items():
        _, score = kenlm.score(start, words.get_index(word))
        for spelling in spellings:
            trie.insert([index[t] for t in spelling], words.get_index(word), score)
    trie.smear(SmearingMode.MAX)
    options = LexiconDecoderOptions(
        beam_size=args.beam, beam_size_token=len(tokens), beam_threshold=50.0, lm_weight=args.alpha * math.log(10),
        word_score=args.beta, unk_score=float("-inf"), sil_score=0.0, log_add=False, criterion_type=CriterionType.CTC,
    )  # fmt: skip
    decoder = LexiconDecoder(options, trie, kenlm, 1, 0, words.get_index("<unk>"), [], False)

    def kenlm_decode(emissions: np.ndarray) -> str:
        result = decoder.decode(emissions.ctypes.data, *emissions.shape)[0]
        return " ".join(words.get_entry(w) for w in result.words if w >= 0)

    return kenlm_decode, ours, (trie, kenlm)  # (flashlight keeps references to them in C++ only)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--utterances", type=int, default=50, help="dev_other utterances decoded")
    parser.add_argument("--beam", type=int, default=32)
    parser.add_argument("--alpha", type=float, default=0.6)
    parser.add_argument("--beta", type=float, default=1.5)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every row, taking turns (the median)")
    parser.add_argument("--server-steps", type=int, default=50, help="batched steps per decoder (0: no server CPU)")
    parser.add_argument("--no-flashlight", action="store_true", help="(tests) without the flashlight rows")
    parser.add_argument("--texts", type=Path, help="(tests) sentences to decode instead of LibriSpeech's")
    parser.add_argument("--labels", default="", help="(tests) CTC labels as one string after the blank")
    parser.add_argument("--no-write", action="store_true", help="print the result, write no file (tests)")
    parser.add_argument("--name", default="decode_speed", help="the result file's name (another model's run)")
    common.add_results_option(parser)
    args = parser.parse_args(argv)
    common.use_results(args.results)
    args.bundle, args.ngram = args.bundle.absolute(), args.ngram.absolute()
    normalize = args.normalize or None
    bundle = Bundle.load(args.bundle)
    view = PRESETS[normalize] if normalize else TextNormalizer.from_dict(bundle.manifest["text"])
    lower = view.case == "lower"
    if args.texts:
        test = args.texts.read_text().splitlines()[: args.utterances]
        labels = ["", *args.labels] if args.labels else LABELS
    else:
        test = [t.lower() if lower else t for t in references("dev_other", args.utterances)]
        labels = [label.lower() for label in LABELS] if lower else LABELS
    channel = Channel()
    rng = np.random.default_rng([channel.seed, 1])  # decode_synthetic's test emissions
    emissions = [channel.emissions(t, labels, rng) for t in test]
    silence = np.full((1, len(labels)), np.log(0.02 / (len(labels) - 1)), dtype=np.float32)
    silence[0, 1] = np.log(0.98)  # flashlight's lexicon spells a word with the silence after it
    fl_emissions = [np.ascontiguousarray(np.concatenate([e, silence])) for e in emissions]
    local = DecoderLM.local(args.bundle, args.ngram, args.lam, normalize)
    engine = InterpolatedLM(Scorer(args.bundle, threads=1, normalizer=PRESETS["none"]), NgramLM(args.ngram), args.lam)
    weights = dict(alpha=args.alpha, beta=args.beta)
    outputs: dict[str, list] = {}
    cpu: dict[str, list[float]] = {}

    def texts_of(name, decode, inputs):
        def run():
            start = time.process_time()
            outputs[name] = [decode(e) for e in inputs]
            cpu.setdefault(name, []).append(time.process_time() - start)

        return run

    # A decode keeps (text, what parity needs of the best path's LM state), never the state: a state holds its
    # parent and every child the search scored after it, so keeping the states of one row's 50 searches kept their
    # whole trees alive, and Python's collector then walked them in every later row's decodes (flashlight's
    # callbacks make many objects): +30 to 50% on the rows that ran after it, and the rows take turns.
    def light(text, state):
        return text, (state.history(), state.logprob, state.neural)

    def best_beam(decoder):  # the search of decoder.decode (prune_history=True), with the best beam's state
        return lambda e: light(*decoder.decode_beams(e, beam_width=args.beam, prune_history=True)[0][:2])

    def best_path(decoder):
        index = {w: i for i, w in enumerate(decoder.lm.words)}

        def decode(e):
            best = decoder.decode(e)[0]
            return light(" ".join(best.words), decoder.lm.path([index[w] for w in best.words]))

        return decode

    kenlm = kenlm_decoder(labels, args.ngram, local.backend.vocabulary(), **weights)[0]
    plain = build_ctcdecoder(labels)
    cases = {
        "pyctcdecode_no_lm": texts_of("pyctcdecode_no_lm", lambda e: plain.decode(e, beam_width=args.beam), emissions),
        "pyctcdecode_kenlm": texts_of("pyctcdecode_kenlm", lambda e: kenlm.decode(e, beam_width=args.beam), emissions),
        "pyctcdecode_ours": texts_of(
            "pyctcdecode_ours", best_beam(build_ctcdecoder(labels, local, **weights)), emissions
        ),  # fmt: skip
    }
    keep = []
    if not args.no_flashlight:
        fl_kenlm, fl_ours, kept = flashlight_decoders(labels, bundle, args.ngram, local, args)
        keep.append(kept)
        cases["flashlight_kenlm"] = texts_of("flashlight_kenlm", fl_kenlm, fl_emissions)
        cases["flashlight_ours"] = texts_of("flashlight_ours", best_path(fl_ours), fl_emissions)
    print(f"decoding {len(test)} utterances, {args.rounds} rounds of {list(cases)}", flush=True)
    seconds = time_interleaved(cases, args.rounds)
    server_cpu = None
    with tempfile.TemporaryDirectory() as tmp:
        config = serve_config(Path(tmp), args.bundle, args.ngram, args.lam, normalize, workers=2)
        with ServerProcess(config, Path(tmp) / "server.log", start_timeout=300) as server:
            with DecoderLM.remote(server.address, "english") as remote:
                decoder = build_ctcdecoder(labels, remote, **weights)
                start = time.perf_counter()
                texts_of("pyctcdecode_ours_remote", best_beam(decoder), emissions)()
                seconds["pyctcdecode_ours_remote"] = time.perf_counter() - start
            if args.server_steps:
                from benchmarks.beam_step_load import Walk, measure

                sentences = [view.normalize(t) for t in test]
                vocab = [t for t in bundle.tokens if not t.startswith("<")]
                walks = [Walk(sentences, vocab, 32, 1, i, False) for i in range(16)]
                asyncio.run(measure(server.address, "batched", walks, 5))
                before = cpu_seconds(server.pid)
                latencies, _ = asyncio.run(measure(server.address, "batched", walks, args.server_steps))
                server_cpu = 1000 * (cpu_seconds(server.pid) - before) / len(latencies)
            server.stop()
    rows, diffs = {}, []
    for name, results in outputs.items():
        texts = [r if isinstance(r, str) else r[0] for r in results]
        rows[name] = {
            "ms_per_utt": 1000 * seconds[name] / len(test),
            "cpu_ms_per_utt": 1000 * statistics.median(cpu[name]) / len(test),
            "wer": wer(texts, test),
        }
        start = len(diffs)
        if name.endswith("_ours") or name.endswith("_remote"):
            # the tokens the decoder's LM read (words normalised one by one: "one two" is two words there, one N in
            # a sentence normalised whole), scored as lm-rescore score scores them
            scores = engine.score([" ".join(history) for _, (history, _, _) in results])
            for (_, (_, logprob, neural)), s in zip(results, scores, strict=True):
                diffs.append(abs(logprob - float(s.interpolated.sum())))
                diffs.append(abs(neural - float(s.neural.sum())))
            rows[name]["max_abs_diff"] = max(diffs[start:])
        print(name, json.dumps(rows[name]), flush=True)

    def ms(name: str) -> float | None:
        return rows[name]["ms_per_utt"] if name in rows else None

    metrics = {
        "kenlm_ms_per_utt": ms("pyctcdecode_kenlm"),
        "ours_ms_per_utt": ms("pyctcdecode_ours"),
        "ours_vs_kenlm": ms("pyctcdecode_ours") / ms("pyctcdecode_kenlm"),
        "wer_kenlm": rows["pyctcdecode_kenlm"]["wer"],
        "wer_ours": rows["pyctcdecode_ours"]["wer"],
        "flashlight_kenlm_ms_per_utt": ms("flashlight_kenlm"),
        "flashlight_ours_ms_per_utt": ms("flashlight_ours"),
        "server_cpu_ms_per_step": server_cpu,
        "max_abs_diff": max(diffs),
    }
    metrics["ours_vs_kenlm_cpu"] = (
        rows["pyctcdecode_ours"]["cpu_ms_per_utt"] / rows["pyctcdecode_kenlm"]["cpu_ms_per_utt"]
    )
    if "flashlight_kenlm" in rows:
        metrics["flashlight_ours_vs_kenlm"] = ms("flashlight_ours") / ms("flashlight_kenlm")
        metrics["flashlight_ours_vs_kenlm_cpu"] = (
            rows["flashlight_ours"]["cpu_ms_per_utt"] / rows["flashlight_kenlm"]["cpu_ms_per_utt"]
        )
    extra = dict(
        note="SYNTHETIC EMISSIONS: LibriSpeech references through a character-level noisy channel, not audio",
        targets={
            "ours_vs_kenlm": "<= 1.5",
            "flashlight_ours_vs_kenlm": "<= 5",
            "server_cpu_ms_per_step": "<= 1.0",
            "max_abs_diff": "<= 1e-4",
        },  # fmt: skip
        channel=channel.describe(),
        test={"set": "dev_other" if not args.texts else "texts", "utterances": len(test)},
        beam=args.beam,
        weights=weights,
        rounds=args.rounds,
        rows=rows,
        model={"bundle": str(args.bundle), "ngram": str(args.ngram), "lambda": args.lam, "normalize": normalize},
        labels="".join(labels[1:]),
    )
    return write_result(args.name, metrics, no_write=args.no_write, **extra)


if __name__ == "__main__":
    main()
