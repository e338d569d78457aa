"""lm-train: fit LSTM language models, evaluate checkpoints, prepare corpora."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from training.config import ConfigError, load_config


def _fit(args) -> int:
    from training.trainer import Trainer

    if args.resume:
        if args.config or args.set:
            raise ConfigError("--resume takes the config saved in the run; do not pass a config or --set")
        trainer = Trainer.resume(Path(args.resume))
    else:
        if not args.config:
            raise ConfigError("lm-train fit needs a CONFIG file (or --resume RUN_DIR)")
        cfg = load_config(args.config, args.set)
        run_dir = Path(args.out) if args.out else Path("var/runs") / Path(args.config).stem
        trainer = Trainer.fresh(cfg, run_dir)
    results = trainer.fit()
    print(json.dumps(results, indent=2))
    return 0


def _eval(args) -> int:
    import torch

    from training.checkpoint import load_model_for_eval
    from training.corpus import encode_file
    from training.evaluate import evaluate
    from training.trainer import describe, make_batcher

    cfg, vocab, model = load_model_for_eval(args.checkpoint)
    if args.mode:
        cfg.data.mode = args.mode
    if args.batch_size:
        cfg.train.eval_batch_size = args.batch_size
    if args.threads:
        torch.set_num_threads(args.threads)
    corpus = encode_file(args.file, vocab, cfg.data.lowercase)
    result = evaluate(model, make_batcher(cfg, corpus, vocab, training=False), vocab.unk_id)
    print(f"{args.file} ({cfg.data.mode} mode): {describe(result, corpus.oov_rate)}", file=sys.stderr)
    print(json.dumps({"file": str(args.file), "mode": cfg.data.mode, "oov_rate": corpus.oov_rate, **result.to_dict()}))
    return 0


def _export(args) -> int:
    import torch

    from training.export import export_bundle

    if args.threads:
        torch.set_num_threads(args.threads)
    manifest = export_bundle(args.checkpoint, args.out, heldout=args.heldout, quantize=args.quantize)
    held = manifest["heldout"]
    print(
        f"wrote {args.out}: {manifest['head']} head, {manifest['normalisation']} scores, held-out ppl "
        f"{held['ppl']:.2f} (bundle scores: {held['score_ppl']:.2f}), log Z mean {held['logz_mean']:.3f} "
        f"std {held['logz_std']:.3f}, max |ONNX - PyTorch| {held['max_abs_diff']:.1e}",
        file=sys.stderr,
    )
    return 0


def _prepare_gutenberg(args) -> int:
    from training.gutenberg import prepare_gutenberg

    summary = prepare_gutenberg(Path(args.data), Path(args.out), args.valid_books, args.test_books)
    print(json.dumps({k: v for k, v in summary.items() if k != "inputs"}, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lm-train", description=__doc__)
    from importlib.metadata import version  # (here only: nothing else in this module needs it)

    parser.add_argument("--version", action="version", version=f"%(prog)s (lmserve) {version('lmserve')}")
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
    fit.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its latest checkpoint")
    fit.set_defaults(func=_fit)

    ev = sub.add_parser("eval", help="exact perplexity of a checkpoint on a text file")
    ev.add_argument("--checkpoint", required=True, help="checkpoint directory, or a run directory (its best one)")
    ev.add_argument("--file", required=True, help="plain or gzipped text, one sentence per line")
    ev.add_argument("--mode", choices=("stream", "sentence"), help="default: the mode the model was trained in")
    ev.add_argument("--batch-size", type=int, help="streams or sentences per batch (default: the run's)")
    ev.add_argument("--threads", type=int, default=0)
    ev.set_defaults(func=_eval)

    ex = sub.add_parser("export", help="checkpoint -> model bundle (ONNX graphs + vocabulary + manifest)")
    ex.add_argument("--checkpoint", required=True, help="checkpoint directory, or a run directory (its best one)")
    ex.add_argument("--out", required=True, help="bundle directory to write (replaced atomically)")
    ex.add_argument("--heldout", help="text for the manifest's perplexity and log Z figures (default: the run's valid)")
    ex.add_argument("--quantize", choices=("int8",), help="int8 dynamic quantisation of the graphs")
    ex.add_argument("--threads", type=int, default=0)
    ex.set_defaults(func=_export)

    prep = sub.add_parser("prepare-gutenberg", help="Project Gutenberg books -> LibriSpeech-style train/valid/test")
    prep.add_argument("--data", default="../shared/data/gutenberg", help="folder with pg*.txt.gz and MANIFEST.tsv")
    prep.add_argument("--out", default="var/gutenberg")
    prep.add_argument("--valid-books", type=int, default=3)
    prep.add_argument("--test-books", type=int, default=3)
    prep.set_defaults(func=_prepare_gutenberg)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from training.checkpoint import CheckpointError
    from training.corpus import CorpusError
    from training.trainer import TrainingInterrupted
    from training.vocab import VocabError

    try:
        return args.func(args)
    except TrainingInterrupted as e:
        print(f"lm-train: interrupted: {e}", file=sys.stderr)
        return 130
    except (ConfigError, CorpusError, VocabError, CheckpointError, ValueError) as e:
        print(f"lm-train: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
