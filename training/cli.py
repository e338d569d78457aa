"""lm-train: fit LSTM language models, evaluate checkpoints, prepare corpora."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import lmserve
from lmserve.core.bundle import WEIGHT_STORAGES
from lmserve.core.command import stdout_closed
from lmserve.core.outputs import check_outputs
from lmserve.training.config import CHECKOUT_DATA_DIR, DATA_ENV, ConfigError, data_dir, expand_data_path, load_config
from lmserve.training.english_text import FORMS


def _fit(args) -> int:
    from lmserve.training.adapt import adapted_config, initial_checkpoint
    from lmserve.training.trainer import Trainer

    if args.resume:
        if args.config:
            raise ConfigError("--resume takes the config saved in the run; do not pass a config (--set may extend it)")
        if args.init_from:
            raise ConfigError("--resume continues a run from its own checkpoint; --init-from starts a new run")
        trainer = Trainer.resume(Path(args.resume), args.set)
    else:
        if not args.config:
            raise ConfigError("lm-train fit needs a CONFIG file (or --resume RUN_DIR)")
        init_from = initial_checkpoint(args.init_from) if args.init_from else None
        if init_from is None:
            cfg = load_config(args.config, args.set)
        else:
            cfg = adapted_config(args.config, args.set, init_from)
        run_dir = Path(args.out) if args.out else Path("var/runs") / Path(args.config).stem
        data = {f"data.{split}": _data_path(getattr(cfg.data, split)) for split in ("train", "valid", "test")}
        data["vocab.file"] = _data_path(cfg.vocab.file)
        check_outputs({"--out": run_dir}, {"CONFIG": args.config, "--init-from": init_from, **data}, {"--out"})
        created = not run_dir.exists()
        try:
            if args.auto_resume:
                trainer = Trainer.fresh_or_resume(cfg, run_dir, init_from)
            else:
                trainer = Trainer.fresh(cfg, run_dir, init_from)
        except BaseException:  # a run that never started leaves no folder behind
            if created:
                shutil.rmtree(run_dir, ignore_errors=True)
            raise
    results = trainer.fit()
    print(json.dumps(results, indent=2))
    return 0


def _eval(args) -> int:
    import torch

    from lmserve.training.checkpoint import load_model_for_eval, resolve_checkpoint
    from lmserve.training.corpus import directed
    from lmserve.training.evaluate import evaluate
    from lmserve.training.prepared import open_corpus
    from lmserve.training.subword import checkpoint_subword_model, per_word
    from lmserve.training.trainer import describe, make_batcher

    cfg, vocab, model = load_model_for_eval(args.checkpoint)
    trained_mode = cfg.data.mode
    if args.mode:
        cfg.data.mode = args.mode
    if args.batch_size:
        cfg.train.eval_batch_size = args.batch_size
    if args.threads:
        torch.set_num_threads(args.threads)
    subword = checkpoint_subword_model(cfg, resolve_checkpoint(args.checkpoint))
    corpus = directed(open_corpus(args.file, "test", vocab, cfg.data.lowercase, subword), cfg.data.direction)
    result = evaluate(model, make_batcher(cfg, corpus, vocab, training=False, trained_mode=trained_mode), vocab.unk_id)
    print(f"{args.file} ({cfg.data.mode} mode): {describe(result, corpus.oov_rate)}", file=sys.stderr)
    words = per_word(result, corpus) if subword else {}
    if words:
        print(
            f"per word (pieces summed over {words['words']:,} words and </s>): ppl {words['ppl_per_word']:.2f}",
            file=sys.stderr,
        )
    print(
        json.dumps(
            {"file": str(args.file), "mode": cfg.data.mode, "oov_rate": corpus.oov_rate, **result.to_dict(), **words}
        )
    )
    return 0


def _export(args) -> int:
    check_outputs(
        {"--out": args.out}, {"--checkpoint": args.checkpoint, "--heldout": _data_path(args.heldout)}, {"--out"}
    )
    import torch

    from lmserve.training.export import export_bundle, export_warnings

    if args.threads:
        torch.set_num_threads(args.threads)
    manifest = export_bundle(
        args.checkpoint, args.out, heldout=args.heldout, quantize=args.quantize, exact=args.exact, weights=args.weights
    )
    held = manifest["heldout"]
    size = sum(p.stat().st_size for p in Path(args.out).iterdir())
    print(
        f"wrote {args.out} ({size / 2**20:.1f} MiB, {manifest['weights']['storage']} weights): {manifest['head']} "
        f"head, {manifest['normalisation']} scores, held-out ppl {held['ppl']:.2f} (bundle scores: "
        f"{held['score_ppl']:.2f}), log Z mean {held['logz_mean']:.3f} "
        f"std {held['logz_std']:.3f}, max |ONNX - PyTorch| {held['max_abs_diff']:.1e}",
        file=sys.stderr,
    )
    if "ppl_per_word" in held:
        print(f"subword model: held-out perplexity per word {held['ppl_per_word']:.2f}", file=sys.stderr)
    for warning in export_warnings(manifest):
        print(f"lm-train: warning: {warning}", file=sys.stderr)
    return 0


def _prepare(args) -> int:
    from lmserve.training.prepared import SPLITS, VocabSettings, prepare, summary_line

    inputs = {split: getattr(args, split) or [] for split in SPLITS}
    if args.text_dir:
        if any(inputs.values()):
            raise ConfigError("lm-train prepare: give --text-dir or --train/--valid/--test, not both")
        root = Path(args.text_dir)
        inputs = {split: [root / f"{split}.txt.gz"] for split in SPLITS if (root / f"{split}.txt.gz").exists()}
    read = {f"--{split}": [_data_path(str(p)) for p in files] for split, files in inputs.items()}
    check_outputs({"--out": args.out}, {**read, "--text-dir": args.text_dir, "--vocab": args.vocab}, {"--out"})
    settings = VocabSettings(
        args.min_count,
        args.max_size,
        args.unk,
        args.vocab or "",
        args.lowercase,
        args.type,
        args.pieces,
        args.subword_model,
    )
    manifest = prepare(inputs, Path(args.out), settings, workers=args.workers)
    print(summary_line(manifest), file=sys.stderr)
    return 0


def _prepare_gutenberg(args) -> int:
    from lmserve.training.gutenberg import prepare_gutenberg

    books = Path(args.data) if args.data else data_dir() / "gutenberg"
    check_outputs({"--out": args.out}, {"--data": books}, {"--out"})
    summary = prepare_gutenberg(books, Path(args.out), args.valid_books, args.test_books)
    print(json.dumps({k: v for k, v in summary.items() if k != "inputs"}, indent=2))
    return 0


def _prepare_english(args) -> int:
    from lmserve.training.english_text import prepare_english_text

    folder = Path(args.data) if args.data else data_dir() / "english-text"
    check_outputs({"--out": args.out}, {"--data": folder}, {"--out"})
    sources = tuple(args.sources.split(",")) if args.sources else None
    summary = prepare_english_text(folder, Path(args.out), sources, args.form)
    print(json.dumps(summary["counts"], indent=2))
    return 0


def _data_path(path: str | None) -> str | None:
    """A data path as a file or folder: ``{data}`` expanded, a prepared dataset's ``DIR:SPLIT`` as ``DIR``."""
    if not path:
        return None
    path = expand_data_path(path)
    folder, sep, split = path.rpartition(":")
    return folder if sep and split in ("train", "valid", "test") else path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lm-train", description=__doc__)
    # lmserve's own version, "0+unknown" in a checkout that was never installed (a tree copied to a GPU machine)
    parser.add_argument("--version", action="version", version=f"%(prog)s (lmserve) {lmserve.__version__}")
    parser.add_argument(
        "--data-dir",
        help=f"the shared data folder that {{data}} in configs names (before the command; the same as "
        f"${DATA_ENV}=DIR; default ${DATA_ENV}, else {CHECKOUT_DATA_DIR} from the current directory)",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    fit = sub.add_parser("fit", help="train a model from a TOML config")
    fit.add_argument("config", nargs="?", help="TOML config (see configs/)")
    fit.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a config value (TOML syntax, e.g. --set optimizer.lr=0.5)",
    )
    fit.add_argument("--out", help="run directory (default var/runs/CONFIG_NAME)")
    fit.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its latest checkpoint; --set may extend it (train.epochs, "
        "train.max_tokens, schedule.*: e.g. anneal a finished run with schedule.type=linear)",
    )
    fit.add_argument(
        "--auto-resume",
        action="store_true",
        help="with CONFIG and --out: continue the run when it has a checkpoint (same config), else start it; "
        "the form for torchrun --max-restarts",
    )
    fit.add_argument(
        "--init-from",
        metavar="MODEL",
        help="start from this trained model instead of random weights: a checkpoint, a run directory (its best one) or "
        "a model bundle with a full or adaptive head (its weights rebuilt from its graphs, fp16/int8 storage widened "
        "to float32); its model, head and vocabulary are kept (the config's [model]/[head]/[vocab] may only agree), "
        "new words become <unk>, the initial weights are evaluated first and stay best unless an epoch beats them",
    )
    fit.set_defaults(func=_fit)

    ev = sub.add_parser("eval", help="exact perplexity of a checkpoint on a text file")
    ev.add_argument("--checkpoint", required=True, help="checkpoint directory, or a run directory (its best one)")
    ev.add_argument(
        "--file",
        required=True,
        help="plain or gzipped text, one sentence per line, or a prepared dataset (its test split, or DIR:SPLIT)",
    )
    ev.add_argument("--mode", choices=("stream", "sentence"), help="default: the mode the model was trained in")
    ev.add_argument("--batch-size", type=int, help="streams or sentences per batch (default: the run's)")
    ev.add_argument("--threads", type=int, default=0)
    ev.set_defaults(func=_eval)

    ex = sub.add_parser("export", help="checkpoint -> model bundle (ONNX graphs + vocabulary + manifest)")
    ex.add_argument("--checkpoint", required=True, help="checkpoint directory, or a run directory (its best one)")
    ex.add_argument("--out", required=True, help="bundle directory to write (replaced atomically)")
    ex.add_argument("--heldout", help="text for the manifest's perplexity and log Z figures (default: the run's valid)")
    ex.add_argument("--quantize", choices=("int8",), help="int8 dynamic quantisation of the graphs")
    ex.add_argument(
        "--weights",
        choices=WEIGHT_STORAGES,
        default="fp32",
        help="how weights.bin stores the weights the graphs share: fp16 halves the bundle, int8 (per-row scales) "
        "quarters it; the scorer computes in float32 either way and the manifest records the held-out perplexity "
        "of the stored graphs (default fp32)",
    )
    ex.add_argument(
        "--exact",
        action="store_true",
        help="normalised graphs (exact log-probabilities) also for a model trained to be served self-normalised "
        "(a sampled objective or the log Z penalty)",
    )
    ex.add_argument("--threads", type=int, default=0)
    ex.set_defaults(func=_export)

    pr = sub.add_parser(
        "prepare",
        help="text -> prepared dataset (vocabulary + memory-mapped token ids) that fit and eval read",
        description="Tokenise training text once: the vocabulary with counts, each split's ids as one flat uint16/uint32 "
        "array plus sentence offsets, and a manifest with checksums. Use the output directory as data.train / "
        "data.valid / data.test (or DIR:SPLIT) wherever a text file is accepted.",
    )
    pr.add_argument("--out", required=True, help="dataset directory to write (replaced atomically)")
    pr.add_argument("--text-dir", help="a prepare-gutenberg output: its train/valid/test.txt.gz")
    pr.add_argument("--train", nargs="+", metavar="FILE", help="training text files (plain or gzipped)")
    pr.add_argument("--valid", nargs="+", metavar="FILE")
    pr.add_argument("--test", nargs="+", metavar="FILE")
    pr.add_argument("--min-count", type=int, default=1, help="keep words seen at least this often in train")
    pr.add_argument("--max-size", type=int, default=0, help="vocabulary size, specials included (0 = no limit)")
    pr.add_argument("--vocab", help="use this vocabulary file instead of building one")
    pr.add_argument("--unk", default="<unk>", help="the data's own unknown-word token")
    pr.add_argument("--lowercase", action="store_true")
    pr.add_argument(
        "--type",
        choices=("word", "subword"),
        default="word",
        help="subword: an open vocabulary of sentencepiece pieces",
    )
    pr.add_argument("--pieces", type=int, default=8000, help="subword: sentencepiece model size (default 8000)")
    pr.add_argument("--subword-model", choices=("unigram", "bpe"), default="unigram", help="subword: model type")
    pr.add_argument("--workers", type=int, default=2, help="tokenising processes (0 = in this process)")
    pr.set_defaults(func=_prepare)

    prep = sub.add_parser("prepare-gutenberg", help="Project Gutenberg books -> LibriSpeech-style train/valid/test")
    prep.add_argument("--data", help="folder with pg*.txt.gz and MANIFEST.tsv (default: DATA_DIR/gutenberg)")
    prep.add_argument("--out", default="var/gutenberg")
    prep.add_argument("--valid-books", type=int, default=3)
    prep.add_argument("--test-books", type=int, default=3)
    prep.set_defaults(func=_prepare_gutenberg)

    eng = sub.add_parser(
        "prepare-english", help="the shared english-text folder -> train/valid/test sentences (LibriSpeech or written)"
    )
    eng.add_argument("--data", help="folder with ted/sgd/cabnc/reuters.txt.gz (default: DATA_DIR/english-text)")
    eng.add_argument("--out", default="var/english-text")
    eng.add_argument(
        "--sources", help="comma-separated subset of ted,sgd,cabnc,reuters (default: all; written: sgd,cabnc,reuters)"
    )
    eng.add_argument(
        "--form",
        choices=sorted(FORMS),
        default="librispeech",
        help="librispeech: upper-case A-Z words (ASR); written: case, punctuation and digits as written (MT)",
    )
    eng.set_defaults(func=_prepare_english)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.data_dir:  # through the environment, so that every {data} of this run (and its children) means it
        os.environ[DATA_ENV] = str(Path(args.data_dir).resolve())
    from lmserve.training.checkpoint import CheckpointError
    from lmserve.training.corpus import CorpusError
    from lmserve.training.trainer import TrainingInterrupted
    from lmserve.training.vocab import VocabError

    try:
        return args.func(args)
    except BrokenPipeError:  # stdout's reader went away (| head): quietly, as a shell expects
        return stdout_closed()
    except TrainingInterrupted as e:
        print(f"lm-train: interrupted: {e}", file=sys.stderr)
        return 130
    except (ConfigError, CorpusError, VocabError, CheckpointError, ValueError, OSError) as e:
        print(f"lm-train: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
