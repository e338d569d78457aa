"""The training loop behind ``lm-train fit``.

One epoch = one pass over the training batches of that epoch; after it the model is evaluated on the validation
file, the learning rate schedule and early stopping look at the result, and a checkpoint is written. Everything the
loop needs to go on (weights, optimiser, RNG, position, carried state) is in the checkpoint, so ``--resume`` after a
crash, a ``kill -9`` or Ctrl-C continues as if nothing had happened.
"""

from __future__ import annotations

import json
import math
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from training.atomic import atomic_write_text
from training.batching import Batch, SentenceBatches, StreamBatches
from training.checkpoint import (
    CheckpointError,
    checkpoint_name,
    load_training_state,
    load_weights,
    mark_best,
    prune_checkpoints,
    resolve_checkpoint,
    save_checkpoint,
)
from training.config import Config, config_from_dict, expand_data_path
from training.corpus import EncodedCorpus, encode_file, file_fingerprint, read_sentences
from training.curves import MetricsLog, plot_curves
from training.evaluate import EvalResult, evaluate, flatten
from training.model import LSTMLM
from training.objectives import build_objective
from training.vocab import Vocabulary


class TrainingInterrupted(Exception):
    """Ctrl-C or SIGTERM: a checkpoint was saved, ``--resume`` continues."""


class _StopFlag:
    """The first SIGINT/SIGTERM asks the loop to stop after the current batch; a second one stops at once."""

    def __init__(self):
        self.raised = False
        self._previous = {}

    def _handle(self, signum, frame):
        self.raised = True
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def build_optimizer(model: LSTMLM, cfg: Config) -> torch.optim.Optimizer:
    o = cfg.optimizer
    if o.name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)
    if o.name == "adagrad":
        return torch.optim.Adagrad(model.parameters(), lr=o.lr, weight_decay=o.weight_decay)
    return torch.optim.Adam(model.parameters(), lr=o.lr, weight_decay=o.weight_decay)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: Config):
    s = cfg.schedule
    if s.type == "fixed":
        # After k epochs the next one runs at lr * decay ** max(0, k + 1 - start_epoch): start_epoch is the last
        # epoch at the initial rate ("halved per epoch after epoch 4" is decay 0.5, start_epoch 4).
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: s.decay ** max(0, k + 1 - s.start_epoch))
    return torch.optim.lr_scheduler.ReduceLROnPlateau(
        optimizer, mode="min", factor=s.decay, patience=s.patience, threshold=s.threshold
    )


@dataclass
class Data:
    train: EncodedCorpus
    valid: EncodedCorpus
    test: EncodedCorpus | None


def load_data(cfg: Config, vocab: Vocabulary) -> Data:
    d = cfg.data
    if not d.train or not d.valid:
        raise ValueError("data.train and data.valid must both be set")

    def encode(path: str) -> EncodedCorpus | None:
        return encode_file(expand_data_path(path), vocab, d.lowercase) if path else None

    return Data(encode(d.train), encode(d.valid), encode(d.test))


def make_batcher(cfg: Config, corpus: EncodedCorpus, vocab: Vocabulary, training: bool):
    t = cfg.train
    size = t.batch_size if training else t.eval_batch_size
    if cfg.data.mode == "stream":
        return StreamBatches(corpus, vocab.eos_id, size, t.bptt)
    return SentenceBatches(
        corpus,
        vocab.bos_id,
        vocab.eos_id,
        size,
        shuffle=training,
        seed=t.seed,
        max_len=cfg.data.max_sentence_len if training else 0,
    )


def build_vocab(cfg: Config) -> Vocabulary:
    v = cfg.vocab
    if v.file:
        return Vocabulary.load(expand_data_path(v.file))
    sentences = read_sentences(expand_data_path(cfg.data.train), cfg.data.lowercase)
    return Vocabulary.build(sentences, v.min_count, v.max_size, v.unk)


def training_device(name: str) -> torch.device:
    """``train.device`` as a torch device, checked here rather than at the first batch."""
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"train.device = {name!r}: PyTorch {torch.__version__} sees no CUDA GPU on this machine "
                '(set train.device = "cpu", or install a CUDA build of torch where there is one)'
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"train.device = {name!r}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
        if device.index is not None:
            torch.cuda.set_device(device)  # so that the CUDA RNG state saved in checkpoints is this GPU's
        # full fp32 in cuDNN's LSTM as in every other product: TF32 would round operands to 10-bit mantissas, and a
        # GPU run's perplexities then differ from the CPU's evaluation of its own checkpoint (a launch-bound small
        # model gains nothing from it)
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    return device


class Trainer:
    def __init__(self, cfg: Config, run_dir: Path, vocab: Vocabulary):
        self.cfg = cfg
        self.run_dir = run_dir
        self.vocab = vocab
        self.log = MetricsLog(run_dir / "metrics.jsonl")
        self.data = load_data(cfg, vocab)
        for name in ("train", "valid", "test"):
            corpus = getattr(self.data, name)
            if corpus is not None:
                print(
                    f"{name}: {corpus.path}: {corpus.num_sentences} sentences, {corpus.num_words} words, "
                    f"OOV rate {100 * corpus.oov_rate:.2f}%",
                    file=sys.stderr,
                )
                self.log.write(
                    "data",
                    split=name,
                    path=corpus.path,
                    sentences=corpus.num_sentences,
                    words=corpus.num_words,
                    oov_rate=corpus.oov_rate,
                )
        self.train_batches = make_batcher(cfg, self.data.train, vocab, training=True)
        self.valid_batches = make_batcher(cfg, self.data.valid, vocab, training=False)
        if getattr(self.train_batches, "skipped", 0):
            print(
                f"train: skipping {self.train_batches.skipped} sentences longer than {cfg.data.max_sentence_len} words",
                file=sys.stderr,
            )
        self.device = training_device(cfg.train.device)
        torch.manual_seed(cfg.train.seed)
        self.model = LSTMLM(len(vocab), cfg.model, cfg.head, vocab.tokens)
        self.model.head.init_bias(torch.tensor(vocab.target_log_prior()), set_bias=cfg.head.bias_init == "unigram")
        self.model.to(self.device)  # built and initialised on the CPU, so a seed gives the same start on any device
        self.objective = build_objective(cfg.objective)
        self.optimizer = build_optimizer(self.model, cfg)
        self.scheduler = build_scheduler(self.optimizer, cfg)
        self.state = {
            "epochs_done": 0,
            "batch": 0,
            "tokens_seen": 0,
            "train_seconds": 0.0,
            "wall_seconds": 0.0,
            "epoch_nll": 0.0,
            "epoch_tokens": 0,
            "best_valid_ppl": None,
            "bad_epochs": 0,
            "finished": None,
            "data_fingerprint": [file_fingerprint(self.data.train.path)],
        }
        self.carried = None  # stream mode: LSTM state carried into the next batch after an interruption
        n_params = sum(p.numel() for p in self.model.parameters())
        print(f"model: {n_params:,} parameters, vocabulary {len(vocab)}, head {cfg.head.type}", file=sys.stderr)

    @classmethod
    def fresh(cls, cfg: Config, run_dir: Path) -> Trainer:
        if (run_dir / "checkpoints").exists():
            raise CheckpointError(
                f"{run_dir}: already has checkpoints; pass --resume to continue, or choose another --out"
            )
        run_dir.mkdir(parents=True, exist_ok=True)
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        vocab = build_vocab(cfg)
        vocab.save(run_dir / "vocab.tsv")
        atomic_write_text(run_dir / "config.json", json.dumps(cfg.to_dict(), indent=2) + "\n")
        return cls(cfg, run_dir, vocab)

    @classmethod
    def resume(cls, run_dir: Path) -> Trainer:
        ckpt = resolve_checkpoint(run_dir, "latest")
        cfg = config_from_dict(json.loads((ckpt / "config.json").read_text()), str(ckpt / "config.json"))
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        trainer = cls(cfg, run_dir, Vocabulary.load(ckpt / "vocab.tsv"))
        load_weights(trainer.model, ckpt / "model.safetensors")
        state, carried = load_training_state(ckpt, trainer.optimizer)
        trainer.carried = None if carried is None else tuple(t.to(trainer.device) for t in carried)
        trainer.scheduler.load_state_dict(state.pop("scheduler"))
        trainer.state = state
        trainer.log.write("resume", checkpoint=ckpt.name, epochs_done=state["epochs_done"], batch=state["batch"])
        print(f"resuming from {ckpt}", file=sys.stderr)
        return trainer

    # -- the loop --------------------------------------------------------------------------------------------

    def fit(self) -> dict:
        cfg, st = self.cfg, self.state
        self._clock = (st["wall_seconds"], time.perf_counter())
        with _StopFlag() as stop:
            while st["finished"] is None:
                if st["epochs_done"] >= cfg.train.epochs:
                    st["finished"] = "epochs"
                    break
                outcome = self._train_epoch(stop)
                if outcome == "interrupted":
                    path = self._save(carried=self.carried)
                    self.log.write("interrupted", checkpoint=path.name, tokens_seen=st["tokens_seen"])
                    raise TrainingInterrupted(f"saved {path}; continue with: lm-train fit --resume {self.run_dir}")
                path = self._end_epoch(budget_spent=outcome == "budget")
                if stop.raised:
                    raise TrainingInterrupted(f"saved {path}; continue with: lm-train fit --resume {self.run_dir}")
        return self._finish()

    def _train_epoch(self, stop: _StopFlag) -> str:
        cfg, st, model = self.cfg, self.state, self.model
        epoch = st["epochs_done"]
        budget = cfg.train.max_tokens
        model.train()
        state = self.carried
        total = self.train_batches.num_batches(epoch)
        lr = self.optimizer.param_groups[0]["lr"]
        bar = tqdm(
            total=total,
            initial=st["batch"],
            desc=f"epoch {epoch + 1}/{cfg.train.epochs}",
            unit="batch",
            mininterval=1.0 if sys.stderr.isatty() else 30.0,
            dynamic_ncols=True,
            leave=False,
        )
        window_nll, window_tokens, window_start = 0.0, 0, time.perf_counter()
        outcome = "done"
        for batch in self.train_batches.batches(epoch, start=st["batch"]):
            t0 = time.perf_counter()
            nll, n, state = self.step(batch, state)
            st["train_seconds"] += time.perf_counter() - t0
            if not math.isfinite(nll):
                raise FloatingPointError(f"training loss is {nll} at epoch {epoch + 1}, batch {st['batch']}")
            st["batch"] += 1
            st["tokens_seen"] += n
            st["epoch_nll"] += nll
            st["epoch_tokens"] += n
            window_nll += nll
            window_tokens += n
            bar.update()
            if st["batch"] % cfg.train.log_interval == 0 or st["batch"] == total:
                elapsed = time.perf_counter() - window_start
                record = dict(
                    epoch=epoch + 1,
                    batch=st["batch"],
                    tokens_seen=st["tokens_seen"],
                    lr=lr,
                    ppl=math.exp(window_nll / window_tokens),
                    tokens_per_s=window_tokens / elapsed,
                )
                self.log.write("train", **record)
                bar.set_postfix(
                    loss=f"{math.log(record['ppl']):.3f}",
                    ppl=f"{record['ppl']:.1f}",
                    tok_s=f"{record['tokens_per_s']:.0f}",
                    lr=f"{lr:.3g}",
                )
                window_nll, window_tokens, window_start = 0.0, 0, time.perf_counter()
            if budget and st["tokens_seen"] >= budget:
                outcome = "budget"
                break
            if stop.raised:
                outcome = "interrupted"
                break
        bar.close()
        self.carried = state if outcome == "interrupted" else None
        return outcome

    def step(self, batch: Batch, state):
        """One optimisation step; returns (summed NLL, predicted tokens, LSTM state to carry or None)."""
        cfg, model = self.cfg, self.model
        batch = batch.to(self.device)
        hidden, state = model(batch.inputs, state)
        state = tuple(s.detach() for s in state) if self.train_batches.carries_state else None
        h, targets = flatten(hidden, batch)
        out = self.objective(model.head, h, targets)
        denominator = batch.num_sequences if cfg.train.loss_reduction == "sequence_sum" else len(targets)
        self.optimizer.zero_grad(set_to_none=True)
        (out.loss / denominator).backward()
        if cfg.train.clip_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.clip_norm)
        self.optimizer.step()
        return out.nll.item(), len(targets), state

    def _end_epoch(self, budget_spent: bool) -> Path:
        cfg, st = self.cfg, self.state
        valid = evaluate(self.model, self.valid_batches, self.vocab.unk_id)
        train_ppl = math.exp(st["epoch_nll"] / max(1, st["epoch_tokens"]))
        st["epochs_done"] += 1
        st["batch"] = 0
        st["epoch_nll"], st["epoch_tokens"] = 0.0, 0
        lr = self.optimizer.param_groups[0]["lr"]
        self.log.write(
            "valid",
            epoch=st["epochs_done"],
            tokens_seen=st["tokens_seen"],
            lr=lr,
            train_ppl=train_ppl,
            tokens_per_s=st["tokens_seen"] / st["train_seconds"],
            **valid.to_dict(),
        )
        print(
            f"epoch {st['epochs_done']}: train ppl {train_ppl:.2f}, valid ppl {valid.ppl:.2f}, lr {lr:.4g}, "
            f"{st['tokens_seen'] / st['train_seconds']:.0f} tokens/s",
            file=sys.stderr,
        )
        improved = st["best_valid_ppl"] is None or valid.ppl < st["best_valid_ppl"]
        if improved:
            st["best_valid_ppl"] = valid.ppl
            st["bad_epochs"] = 0
        else:
            st["bad_epochs"] += 1
        if isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            self.scheduler.step(valid.ppl)
        else:
            self.scheduler.step()
        patience = cfg.train.early_stop_patience
        if budget_spent:
            st["finished"] = "token budget"
        elif patience and st["bad_epochs"] >= patience:
            st["finished"] = f"early stop: no better validation ppl for {patience} epochs"
        elif st["epochs_done"] >= cfg.train.epochs:
            st["finished"] = "epochs"
        path = self._save()
        if improved:
            mark_best(self.run_dir, path.name)
        prune_checkpoints(self.run_dir)
        plot_curves(self.log.read(), self.run_dir / "curves.png", str(self.run_dir.name))
        return path

    def _save(self, carried=None) -> Path:
        st = self.state
        base, since = self._clock
        st["wall_seconds"] = base + time.perf_counter() - since
        return save_checkpoint(
            self.run_dir,
            checkpoint_name(st["epochs_done"], st["batch"]),
            model=self.model,
            optimizer=self.optimizer,
            config=self.cfg,
            vocab=self.vocab,
            state={**st, "scheduler": self.scheduler.state_dict()},
            carried=carried,
        )

    def _finish(self) -> dict:
        """Evaluate the best checkpoint on validation and test and write ``results.json``."""
        st = self.state
        best = resolve_checkpoint(self.run_dir, "best")
        load_weights(self.model, best / "model.safetensors")
        results = {
            "stopped": st["finished"],
            "best_checkpoint": best.name,
            "epochs": st["epochs_done"],
            "tokens_seen": st["tokens_seen"],
            "train_seconds": st["train_seconds"],
            "wall_seconds": st["wall_seconds"],
            "tokens_per_s": st["tokens_seen"] / st["train_seconds"],
            "valid": evaluate(self.model, self.valid_batches, self.vocab.unk_id).to_dict(),
            "valid_oov_rate": self.data.valid.oov_rate,
        }
        if self.data.test is not None:
            test_batches = make_batcher(self.cfg, self.data.test, self.vocab, training=False)
            results["test"] = evaluate(self.model, test_batches, self.vocab.unk_id).to_dict()
            results["test_oov_rate"] = self.data.test.oov_rate
            self.log.write("test", **results["test"])
        atomic_write_text(self.run_dir / "results.json", json.dumps(results, indent=2) + "\n")
        return results


def describe(result: EvalResult, oov_rate: float) -> str:
    return (
        f"ppl {result.ppl:.2f} ({result.tokens} tokens), without OOV targets {result.ppl_no_oov:.2f}, "
        f"OOV rate {100 * oov_rate:.2f}%, log Z mean {result.logz_mean:.3f} std {result.logz_std:.3f}"
    )
