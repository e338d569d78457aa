"""lm-rescore: score sentences with a model bundle; build, query and mix KenLM n-grams; write the references of a list
as LM training text; add another neural LM's scores to a list as a feature (``annotate``:
``rescoring/commands/annotate.py``); tune weights on dev n-best/k-best lists and rerank lists with them (``tune``, ``nbest``:
``rescoring/commands/rescore_cli.py``); judge a recipe on held-out data beside its baselines (``evaluate``:
``rescoring/commands/evaluate_cli.py``)."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from lmserve.core.atomic import atomic_write_lines
from lmserve.core.bundle import Bundle
from lmserve.core.command import add_common_arguments, parse_args, run_command
from lmserve.core.lines import file_lines, iter_lines, read_lines
from lmserve.core.outputs import check_outputs
from lmserve.core.textnorm import PRESETS, TextNormalizer
from lmserve.rescoring.commands import annotate, evaluate_cli, rescore_cli
from lmserve.rescoring.lmscores import ngram_view
from lmserve.rescoring.nbest import FORMATS, read_nbest
from lmserve.rescoring.ngram import LN10, NgramError, build_ngram, model_files
from lmserve.rescoring.ngram_mix import load_ngram, text_record, text_record_path, tune_mixture, write_text_record
from lmserve.rescoring.score_lines import FORMATS as SCORE_FORMATS
from lmserve.rescoring.score_lines import score_line
from lmserve.rescoring.scorer_args import add_device_argument, add_precision_argument, precision_conflict


def _text_settings(args) -> tuple[Callable[[str], list[str]], dict]:
    """How text becomes n-gram tokens: ``--normalize`` (a ``core.textnorm`` preset) and, with ``--like BUNDLE``,
    that bundle's own text settings and vocabulary (other words become ``<unk>``), so that the n-gram sees exactly the
    tokens the neural LM sees and their per-word interpolation mixes distributions over the same words; and the
    record of them (``ngram_mix.text_record``) that ``ngram build`` leaves beside a model and ``ngram mix``
    compares."""
    normalizer = PRESETS[args.normalize] if args.normalize else None
    vocab = None
    if args.like:
        bundle = Bundle.load(args.like)
        normalizer = normalizer or TextNormalizer.from_dict(bundle.manifest["text"])
        vocab = None if bundle.subword_model else set(bundle.tokens)  # an open vocabulary: every word as it is
    normalizer = normalizer or PRESETS["none"]
    return ngram_view(normalizer, vocab), text_record(normalizer, vocab, args.normalize, args.like)


def _text_view(args) -> Callable[[str], list[str]]:
    return _text_settings(args)[0]


def _check_texts(paths: list[str], flag: str) -> None:
    """Text files, not models: an n-gram where text belongs (``--heldout A.bin``) is an error naming the flag."""
    for path in paths:
        if not Path(path).is_file():
            raise FileNotFoundError(f"{flag} {path}: no such text file")
        with open(path, "rb") as f:
            head = f.read(64)
        if head.startswith(b"mmap lm ") or head.lstrip().startswith(b"\\data\\"):
            kind = "a KenLM binary model" if head.startswith(b"mmap lm ") else "an ARPA model"
            raise ValueError(
                f"{flag} {path}: {kind}, not text; expected plain or gzipped text, one sentence a line"
                + (" (the models to mix go in --ngram)" if flag == "--heldout" else "")
            )


def _tokenised(paths: list[str], view: Callable[[str], list[str]], flag: str) -> Iterator[list[str]]:
    """Tokenised lines of plain or gzipped text files; blank lines are skipped, not taken as empty sentences
    (which would inflate p(</s> | <s>)). Errors name the ``flag`` and the file (``core.lines.file_lines``)."""
    for path in paths:
        for line in file_lines(path, flag):
            words = view(line)
            if words:
                yield words


def _score(args) -> int:
    from lmserve.rescoring.scorer import Scorer

    scorer = Scorer(
        args.lm,
        threads=args.threads,
        device=args.device,
        normalizer=PRESETS[args.normalize] if args.normalize else None,
        open_vocab=args.open_vocab,
        precision=args.precision,
    )
    if args.input == "-":
        sentences = read_lines(sys.stdin.buffer, "<stdin>")
    else:
        with open(args.input, "rb") as f:
            sentences = read_lines(f, args.input)
    start = time.perf_counter()
    scores = scorer.score(sentences)
    elapsed = time.perf_counter() - start
    for text, s in zip(sentences, scores, strict=True):
        tokens = list(zip([*s.words, "</s>"], s.token_logprobs.tolist(), strict=True)) if args.per_token else None
        extra = {"spelled": s.spelled} if args.open_vocab else {}
        sys.stdout.write(score_line(text, s.logprob, s.oov, args.format, args.log10, tokens, **extra))
    tokens = sum(len(s.token_logprobs) for s in scores)
    kind = SCORE_KINDS[scorer.normalisation]
    spelled = sum(s.spelled for s in scores)
    oov = f"{spelled} OOV words spelled" if args.open_vocab else f"{sum(s.oov for s in scores)} OOV words as <unk>"
    print(
        f"lm-rescore: {len(scores)} sentences, {tokens} tokens, {oov}; "
        f"{kind} ({'log10' if args.log10 else 'natural log'}); {tokens / max(elapsed, 1e-9):.0f} tokens/s",
        file=sys.stderr,
    )
    return 0


SCORE_KINDS = {
    "exact": "log-probabilities",
    "self-normalised": "self-normalised scores",
    "unnormalised": "unnormalised scores (not log-probabilities)",
}


def _ngram_build(args) -> int:
    arpa, model_bin = model_files(args.out)
    record = text_record_path(arpa)
    check_outputs(
        {"--out": [arpa, None if args.no_binary else model_bin, record]}, {"--text": args.text, "--like": args.like}
    )
    _check_texts(args.text, "--text")
    view, text = _text_settings(args)
    start = time.perf_counter()
    info = build_ngram(
        _tokenised(args.text, view, "--text"),
        args.order,
        args.out,
        prune=args.prune,
        binary=not args.no_binary,
        discount_fallback=args.discount_fallback,
        memory=args.memory,
    )
    info["text_record"] = str(write_text_record(arpa, text))
    info.update(text=args.text, normalize=args.normalize, like=args.like, seconds=round(time.perf_counter() - start, 2))
    print(json.dumps(info, indent=2))
    return 0


def _ngram_install_tools(args) -> int:
    from lmserve.rescoring.commands.kenlm_tools import install_tools

    check_outputs({"--dest": args.dest}, {"--source": args.source}, folders={"--dest"})
    for path in install_tools(args.dest, args.source, args.jobs):
        print(path)
    print(f"lm-rescore ngram build finds them with LMSERVE_KENLM_BIN={Path(args.dest).resolve()}", file=sys.stderr)
    return 0


def _ngram_mix(args) -> int:
    paths = args.ngram.split(",")
    if len(paths) < 2 or not all(paths):
        raise ValueError(f"--ngram {args.ngram}: expected two or more models, comma-separated (A.bin,B.bin)")
    check_outputs({"--out": args.out}, {"--ngram": paths, "--heldout": args.heldout, "--like": args.like})
    _check_texts(args.heldout, "--heldout")
    heldout = {"files": args.heldout, "normalize": args.normalize, "like": args.like}
    view, text = _text_settings(args)
    record = tune_mixture(paths, _tokenised(args.heldout, view, "--heldout"), args.out, heldout, text)
    print(json.dumps(record, indent=2))
    models = ", ".join(f"{m['path']} {m['weight']:.4f} (ppl {m['heldout_ppl']:.2f})" for m in record["models"])
    held = record["heldout"]
    print(
        f"lm-rescore: wrote {args.out}: {models}; mixture ppl {held['ppl']:.2f} on {held['tokens']:,} held-out tokens "
        f"(with </s>) after {held['iterations']} EM iterations" + ("" if held["converged"] else " (not converged)"),
        file=sys.stderr,
    )
    return 0


def _references(args) -> int:
    """An n-best list's references as text to train or adapt an LM on, one per line, in the LM's own form."""
    check_outputs({"--out": args.out}, {"LIST": args.list})
    nbest = read_nbest(args.list, args.format)
    normalizer = PRESETS[args.normalize or "none"]
    lines, without, empty = [], 0, 0
    for entry in nbest:
        without += not entry.references
        for reference in entry.references:
            words = normalizer.normalize(reference)
            if words:
                lines.append(" ".join(words))
            else:
                empty += 1
    if not lines:
        raise ValueError(f"{args.list}: none of its {len(nbest)} entries has a reference")
    atomic_write_lines(args.out, lines)
    skipped = [f"{n} {what}" for n, what in ((without, "entries without one"), (empty, "empty after normalising")) if n]
    print(
        f"lm-rescore: wrote {args.out}: {len(lines):,} references of {len(nbest):,} entries, normalised "
        f"{args.normalize or 'none'}" + (f" ({', '.join(skipped)} left out)" if skipped else ""),
        file=sys.stderr,
    )
    return 0


def _ngram_query(args) -> int:
    lm = load_ngram(args.lm)
    view = _text_view(args)
    total = tokens = oovs = sentences = 0
    for line in iter_lines(sys.stdin.buffer, "<stdin>"):
        words = view(line)
        score, oov = lm.score(words), lm.oov(words)
        print(f"{score:.6f}\t{score / LN10:.6f}\t{oov}")
        total += score
        tokens += len(words) + 1
        oovs += oov
        sentences += 1
    ppl = math.exp(-total / tokens) if tokens else float("nan")
    print(
        f"lm-rescore: {sentences} sentences, {tokens} tokens (with </s>), {oovs} OOV words scored as <unk>; "
        f"total ln {total:.4f}, log10 {total / LN10:.4f}; perplexity {ppl:.2f} ({lm.order}-gram {args.lm})",
        file=sys.stderr,
    )
    return 0


def _text_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--normalize", choices=sorted(PRESETS), help="text normalisation preset (default: none)")
    parser.add_argument("--like", help="model bundle: use its text settings and vocabulary (others -> <unk>)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lm-rescore", description=__doc__)
    add_common_arguments(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    score = sub.add_parser("score", help="one score per input line: the sentence's log-probability under the LM")
    score.add_argument("--lm", required=True, help="model bundle directory (lm-train export)")
    score.add_argument("--input", default="-", help="sentences, one per line (default: standard input)")
    score.add_argument("--per-token", action="store_true", help="also print every token's score (</s> last)")
    score.add_argument("--log10", action="store_true", help="scores in log10 instead of natural log")
    score.add_argument(
        "--format", choices=SCORE_FORMATS, default="text", help="text or jsonl, laid out as lm-serve client score's"
    )
    score.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads (0 = all cores)")
    add_device_argument(score)
    add_precision_argument(score)
    score.add_argument(
        "--normalize",
        choices=sorted(PRESETS),
        help="text normalisation preset (default: the bundle's own text settings), as lm-serve's models.NAME.normalize",
    )
    score.add_argument(
        "--open-vocab",
        action="store_true",
        help="score words outside the vocabulary from their spelling, not as <unk> (bundles of charcnn and "
        "cnnsoftmax heads), as lm-serve's models.NAME.open_vocab",
    )
    score.set_defaults(func=_score, conflicts=precision_conflict)

    ngram = sub.add_parser("ngram", help="KenLM n-gram models: build with lmplz, query, mix").add_subparsers(
        dest="ngram_command", required=True
    )
    build = ngram.add_parser("build", help="estimate a modified Kneser-Ney n-gram: MODEL.arpa and MODEL.bin")
    build.add_argument("--order", type=int, required=True, help="n-gram order, e.g. 3 or 5")
    build.add_argument("--text", nargs="+", required=True, help="training text, plain or .gz, one sentence per line")
    build.add_argument("--out", required=True, help="model path without extension (a .arpa or .bin one is dropped)")
    build.add_argument("--prune", type=int, nargs="+", help="count threshold per order, e.g. 0 1 1 (lmplz --prune)")
    build.add_argument("--no-binary", action="store_true", help="write the ARPA file only, no KenLM binary")
    _text_arguments(build)
    build.add_argument(
        "--discount-fallback", action="store_true", help="fixed discounts where lmplz cannot estimate them (tiny text)"
    )
    build.add_argument("--memory", default="1G", help="lmplz sort memory, e.g. 4G or 30%% (default: %(default)s)")
    build.set_defaults(func=_ngram_build)
    query = ngram.add_parser("query", help="per input line: ln score, log10 score and OOV count (tab-separated)")
    query.add_argument("--lm", required=True, help="ARPA (plain or .gz), KenLM binary model, or a mixture (ngram mix)")
    _text_arguments(query)
    query.set_defaults(func=_ngram_query)
    mix = ngram.add_parser(
        "mix",
        help="tune the weights of a linear mixture of n-grams on held-out text (EM) -> MIX.json, usable as --ngram",
    )
    mix.add_argument("--ngram", required=True, help="the models, comma-separated: A.bin,B.bin (ARPA or KenLM binary)")
    mix.add_argument(
        "--heldout",
        nargs="+",
        required=True,
        help="held-out text (plain or .gz, one sentence per line; not the test set)",
    )
    mix.add_argument("--out", required=True, help="mixture file to write (JSON; model paths relative to it)")
    _text_arguments(mix)
    mix.set_defaults(func=_ngram_mix)
    tools = ngram.add_parser("install-tools", help="compile KenLM's lmplz and build_binary (cmake, C++, boost)")
    tools.add_argument("--dest", required=True, help="folder for the two programs (then LMSERVE_KENLM_BIN=DEST)")
    tools.add_argument("--source", help="a kenlm source archive (default: pip downloads the installed version's)")
    tools.add_argument("--jobs", type=int, default=2, help="parallel compile jobs (default: %(default)s)")
    tools.set_defaults(func=_ngram_install_tools)
    refs = sub.add_parser(
        "references", help="the references of an n-best list, one per line: in-domain text to train or adapt an LM on"
    )
    refs.add_argument("list", help="n-best/k-best list (file or folder; the format is detected)")
    refs.add_argument("--format", choices=sorted(FORMATS), help="the list's format (default: detected)")
    refs.add_argument("--out", required=True, help="text file to write")
    refs.add_argument(
        "--normalize",
        choices=sorted(PRESETS),
        help="text normalisation preset: the form of the LM's training text (librispeech for our Gutenberg and "
        "LibriSpeech LMs; default: none)",
    )
    refs.set_defaults(func=_references)
    annotate.add_command(sub)
    rescore_cli.add_commands(sub)
    evaluate_cli.add_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Errors, Ctrl-C and SIGTERM end in one line on stderr (``core.command``; OSError: files, and lm-serve
    with --server); ``LMSERVE_DEBUG=1`` or ``--debug`` shows the traceback."""
    args = parse_args(build_parser(), argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what a report records as its command
    return run_command("lm-rescore", lambda: args.func(args), args.debug, user_errors=(NgramError,))


if __name__ == "__main__":
    sys.exit(main())
