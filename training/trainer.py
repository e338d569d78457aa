"""The training loop behind ``lm-train fit``.

One epoch = one pass over the training batches of that epoch; after it the model is evaluated on the validation
file, the learning rate schedule and early stopping look at the result, and a checkpoint is written. Everything the
loop needs to go on (weights, optimiser, RNG, position, carried state) is in the checkpoint, so ``--resume`` after a
crash, a ``kill -9`` or Ctrl-C continues as if nothing had happened.
"""

from __future__ import annotations

import contextlib
import json
import math
import queue
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.profiler import record_function
from tqdm import tqdm

from lmserve.core.atomic import atomic_write_text
from lmserve.training.batching import Batch, SentenceBatches, StreamBatches, sentence_start_id
from lmserve.training.checkpoint import (
    CheckpointError,
    checkpoint_name,
    load_objective_state,
    load_training_state,
    load_weights,
    mark_best,
    prune_checkpoints,
    resolve_checkpoint,
    save_checkpoint,
)
from lmserve.training.config import CAPTURED, Config, expand_data_path, resumed_config
from lmserve.training.corpus import EncodedCorpus, directed
from lmserve.training.curves import MetricsLog, plot_curves
from lmserve.training.distributed import Distributed, setup, step_seed
from lmserve.training.evaluate import EvalResult, evaluate, flatten
from lmserve.training.fast_step import FastStep, Router
from lmserve.training.from_bundle import bundle_source
from lmserve.training.model import LSTMLM
from lmserve.training.objectives import build_objective
from lmserve.training.prepared import SPLITS, VocabSettings, is_prepared, open_corpus, open_dataset, prepare
from lmserve.training.subword import run_subword_model
from lmserve.training.valid_split import carve, carved_config
from lmserve.training.vocab import Vocabulary


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
    """Adam's update is one fused kernel over all parameters, on the CPU too: the per-tensor loop took a quarter of a
    PTB step and a third of the LibriSpeech LM's (BENCHMARKS.md, "Where a step's time goes"); SGD is fused on GPUs.
    ``train.compile = cuda_graphs`` (and ``compile_graphs``) captures Adam's update in a graph, which needs its step
    counts on the GPU (``capturable``)."""
    o = cfg.optimizer
    on_gpu = next(model.parameters()).is_cuda
    if o.name == "sgd":
        fused = {"fused": True} if on_gpu else {}
        return torch.optim.SGD(model.parameters(), lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay, **fused)
    if o.name == "adagrad":
        return torch.optim.Adagrad(model.parameters(), lr=o.lr, weight_decay=o.weight_decay)
    capturable = cfg.train.compile in CAPTURED
    return torch.optim.Adam(model.parameters(), lr=o.lr, weight_decay=o.weight_decay, fused=True, capturable=capturable)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: Config):
    """The per-epoch scheduler, or None for ``linear``, which :func:`linear_lr` sets before every step."""
    s = cfg.schedule
    if s.type == "linear":
        return None
    if s.type == "fixed":
        # After k epochs the next one runs at lr * decay ** max(0, k + 1 - start_epoch): start_epoch is the last
        # epoch at the initial rate ("halved per epoch after epoch 4" is decay 0.5, start_epoch 4).
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: s.decay ** max(0, k + 1 - s.start_epoch))
    return torch.optim.lr_scheduler.ReduceLROnPlateau(
        optimizer, mode="min", factor=s.decay, patience=s.patience, threshold=s.threshold
    )


def linear_lr(cfg: Config, tokens_seen: int) -> float:
    """``schedule.type = linear``: optimizer.lr until schedule.start_tokens, then a straight line down to
    optimizer.lr * schedule.decay at train.max_tokens. A function of the tokens seen alone, so a resumed run (on any
    number of ranks) continues the same line."""
    s = cfg.schedule
    done = (tokens_seen - s.start_tokens) / (cfg.train.max_tokens - s.start_tokens)
    return cfg.optimizer.lr * (1.0 - (1.0 - s.decay) * min(1.0, max(0.0, done)))


@dataclass
class Data:
    train: EncodedCorpus
    valid: EncodedCorpus
    test: EncodedCorpus | None


def _split_source(spec: str) -> str | None:
    """The prepared dataset directory a data path names (``DIR`` or ``DIR:SPLIT``), or None for a text file."""
    if is_prepared(spec):
        return spec
    root = spec.rsplit(":", 1)[0]
    return root if ":" in spec and not Path(spec).exists() and is_prepared(root) else None


def training_dataset(cfg: Config, run_dir: Path) -> Path:
    """Where the run's training ids live: ``data.train`` when it is a prepared dataset, else ``RUN/data``, which
    ``prepare_run_data`` makes from the text files (the same code as ``lm-train prepare``)."""
    spec = expand_data_path(cfg.data.train)
    source = _split_source(spec)
    return Path(source) if source else run_dir / "data"


def prepare_run_data(cfg: Config, run_dir: Path, vocab_file: str = "") -> None:
    """Text files of the config -> ``RUN/data`` (a prepared dataset; nothing to do when it is up to date), with the
    vocabulary in ``vocab_file`` when given (an initial checkpoint's) instead of vocab.file or one cut from the text."""
    d, v = cfg.data, cfg.vocab
    if not d.train or not d.valid:
        raise ValueError("data.train and data.valid must both be set")
    if _split_source(expand_data_path(d.train)):
        return
    texts = {s: [expand_data_path(getattr(d, s))] for s in SPLITS if getattr(d, s)}
    texts = {s: paths for s, paths in texts.items() if not _split_source(paths[0])}
    settings = VocabSettings(
        v.min_count,
        v.max_size,
        v.unk,
        vocab_file or v.file and expand_data_path(v.file),
        d.lowercase,
        v.type,
        v.pieces,
        v.subword_model,
    )
    prepare(texts, run_dir / "data", settings, workers=0)


def load_data(cfg: Config, vocab: Vocabulary, run_dir: Path) -> Data:
    d = cfg.data
    text_root = run_dir / "data"

    def corpus(split: str) -> EncodedCorpus | None:
        spec = getattr(d, split)
        if not spec:
            return None
        spec = expand_data_path(spec)
        if _split_source(spec) is None and is_prepared(text_root) and split in open_dataset(text_root).splits:
            return directed(open_corpus(str(text_root), split, vocab, d.lowercase), d.direction)
        # (subword: text in pieces)
        return directed(open_corpus(spec, split, vocab, d.lowercase, run_subword_model(cfg, run_dir)), d.direction)

    return Data(corpus("train"), corpus("valid"), corpus("test"))


def make_batcher(
    cfg: Config, corpus: EncodedCorpus, vocab: Vocabulary, training: bool, trained_mode: str | None = None
):
    """Batches of ``cfg.data.mode``; ``trained_mode`` (default the same) decides how sentences start."""
    t = cfg.train
    size = t.batch_size if training else t.eval_batch_size
    if cfg.data.mode == "stream":
        return StreamBatches(corpus, vocab.eos_id, size, t.bptt)
    return SentenceBatches(
        corpus,
        sentence_start_id(trained_mode or cfg.data.mode, vocab),
        vocab.eos_id,
        size,
        shuffle=training,
        seed=t.seed,
        max_len=cfg.data.max_sentence_len if training else 0,
    )


def prefetched(items: Iterable, depth: int, pin: bool) -> Iterator:
    """``items`` built ``depth`` ahead by a background thread (batches are numpy work that releases the GIL), in
    pinned memory for a GPU's asynchronous copies; ``depth`` 0 builds each one when it is needed."""
    if depth == 0:
        yield from items
        return
    ready: queue.Queue = queue.Queue(depth)
    done = object()
    stop = threading.Event()

    def hand(item) -> bool:
        """Queue ``item`` unless the consumer has stopped (it would never take it): False then."""
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def fill():
        try:
            for item in items:
                if pin:
                    item = [b.pin_memory() for b in item]
                if not hand(item):
                    return
            hand(done)
        except BaseException as e:  # handed to the consumer, raised there
            hand(e)

    thread = threading.Thread(target=fill, daemon=True)
    thread.start()
    try:
        while (item := ready.get()) is not done:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join()


class StepLosses:
    """The summed NLL of the steps since it was last read. The faster steps (training/fast_step.py) give their NLL as
    a tensor the GPU may still be computing: reading each at once would make the CPU wait for every step to end before
    it launches the next, and the GPU would idle between steps. Such NLLs are summed where they are and read once per
    log interval; a non-finite sum names the steps it covers. The eager step's floats are checked as they come."""

    def __init__(self):
        self.total: float | torch.Tensor = 0.0
        self.since = ""  # the first step in the sum

    def add(self, nll: float | torch.Tensor, step: str) -> None:
        if not isinstance(nll, torch.Tensor) and not math.isfinite(nll):
            raise FloatingPointError(f"training loss is {nll} at {step}")
        self.total = self.total + nll
        self.since = self.since or step

    def read(self, step: str) -> float:
        """The sum (waiting for the steps in it to end), from zero again; ``step``: the last step in it."""
        total, since = float(self.total), self.since
        self.total, self.since = 0.0, ""
        if not math.isfinite(total):
            raise FloatingPointError(f"training loss is {total} in the steps from {since} to {step}")
        return total


class LossModule(nn.Module):
    """The model and its objective as one module: DistributedDataParallel then sees every parameter the loss uses
    (a head is called after the LSTM, outside the model's own forward)."""

    def __init__(self, model: LSTMLM, objective):
        super().__init__()
        self.model = model
        self.objective = objective

    def forward(self, batch: Batch, state):
        with record_function("lstm"):  # the regions that benchmarks/step_profile.py reports
            hidden, state = self.model(batch.inputs, state)
        with record_function("head"):
            h, targets = flatten(hidden, batch)
            out = self.objective(self.model.head, h, targets)
        return out.loss, out.nll.detach(), state


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
    def __init__(self, cfg: Config, run_dir: Path, vocab: Vocabulary, dist: Distributed):
        self.cfg = cfg
        self.run_dir = run_dir
        self.vocab = vocab
        self.dist = dist
        self.log = MetricsLog(run_dir / "metrics.jsonl", enabled=dist.is_main)
        self.data = load_data(cfg, vocab, run_dir)
        for name in ("train", "valid", "test"):
            corpus = getattr(self.data, name)
            if corpus is not None:
                self._say(
                    f"{name}: {corpus.path}: {corpus.num_sentences} sentences, {corpus.num_words} words, "
                    f"OOV rate {100 * corpus.oov_rate:.2f}%"
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
            self._say(
                f"train: skipping {self.train_batches.skipped} sentences longer than {cfg.data.max_sentence_len} words"
            )
        parts = dist.world * cfg.train.accumulate
        if cfg.train.batch_size % parts or (cfg.data.mode == "stream" and cfg.train.batch_size < parts):
            raise ValueError(
                f"train.batch_size = {cfg.train.batch_size} (the global batch) must be a multiple of "
                f"{dist.world} ranks x train.accumulate {cfg.train.accumulate}"
            )
        self.device = dist.device
        torch.manual_seed(cfg.train.seed)
        self.model = LSTMLM(len(vocab), cfg.model, cfg.head, vocab.tokens)
        self.model.head.init_bias(torch.tensor(vocab.target_log_prior()), set_bias=cfg.head.bias_init == "unigram")
        self.model.to(self.device)  # built and initialised on the CPU, so a seed gives the same start on any device
        self.objective = build_objective(cfg.objective)
        self.loss = LossModule(self.model, self.objective)
        if dist.active:
            # find_unused_parameters: a step may leave parameters without a gradient (adaptive clusters no target
            # falls in); DDP then reduces zeros for them instead of waiting forever
            self.loss = nn.parallel.DistributedDataParallel(
                self.loss,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                find_unused_parameters=True,
                broadcast_buffers=False,
            )
        self.optimizer = build_optimizer(self.model, cfg)
        self.scheduler = build_scheduler(self.optimizer, cfg)
        self.router, self.fast = None, None  # train.compile: routed batches through a compiled or captured step
        if cfg.train.compile != "none":
            if dist.active:
                raise ValueError(f"train.compile = {cfg.train.compile} trains on one process, not under torchrun")
            self.router = Router(self.model, cfg.train.batch_size, vocab.eos_id, self.train_batches.carries_state)
            self.fast = FastStep(
                cfg.train.compile, self.model, self.optimizer, cfg.train.clip_norm, cfg.train.precision == "bf16"
            )
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
            "data_fingerprint": open_dataset(training_dataset(cfg, run_dir)).splits["train"]["inputs"],
        }
        self.carried = None  # stream mode: the whole batch's LSTM state carried into the next step after a stop
        n_params = sum(p.numel() for p in self.model.parameters())
        self._say(
            f"model: {n_params:,} parameters, vocabulary {len(vocab)}, head {cfg.head.type}"
            + (f"; rank 0 of {dist.world} ({dist.device})" if dist.active else "")
        )

    def _say(self, text: str) -> None:
        if self.dist.is_main:
            print(text, file=sys.stderr)

    @classmethod
    def fresh(cls, cfg: Config, run_dir: Path, init_from: Path | None = None) -> Trainer:
        """A new run; with ``init_from`` (a checkpoint, ``training.adapt``) it starts from that model's weights and
        vocabulary instead of random weights and a vocabulary cut from the text."""
        dist = setup(training_device(cfg.train.device))
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        carved = carved_config(cfg, run_dir)
        if dist.is_main:
            error = None
            if (run_dir / "checkpoints").exists():
                error = f"{run_dir}: already has checkpoints; pass --resume to continue, or choose another --out"
            else:
                created = not run_dir.exists()
                run_dir.mkdir(parents=True, exist_ok=True)
                try:
                    if carved is not cfg:
                        print(carve(cfg, run_dir), file=sys.stderr)
                    prepare_run_data(carved, run_dir, str(init_from / "vocab.tsv") if init_from else "")
                except ValueError as e:  # CorpusError, VocabError, ...: every rank reports it
                    error = str(e)
                    if created:  # a run that never started leaves no folder behind (an empty config did)
                        shutil.rmtree(run_dir, ignore_errors=True)
                else:
                    atomic_write_text(run_dir / "config.json", json.dumps(carved.to_dict(), indent=2) + "\n")
        error = dist.broadcast_object(error if dist.is_main else None)
        if error:
            raise CheckpointError(error) if "checkpoints" in error else ValueError(error)
        cfg = carved
        vocab = open_dataset(training_dataset(cfg, run_dir)).vocab
        if init_from is not None:
            if vocab.tokens != Vocabulary.load(init_from / "vocab.tsv").tokens:
                raise ValueError(
                    f"data.train = {cfg.data.train}: a prepared dataset with another vocabulary than the initial "
                    f"checkpoint's; prepare it with --vocab {init_from / 'vocab.tsv'}"
                )
        elif cfg.vocab.file and dist.is_main:
            given = Vocabulary.load(expand_data_path(cfg.vocab.file))
            if given.tokens != vocab.tokens:
                raise ValueError(
                    f"vocab.file = {cfg.vocab.file}: vocabulary mismatch with {training_dataset(cfg, run_dir)}"
                )
        if dist.is_main:
            vocab.save(run_dir / "vocab.tsv")
        trainer = cls(cfg, run_dir, vocab, dist)
        if init_from is not None:
            trainer._start_from(init_from)
        return trainer

    @classmethod
    def resume(cls, run_dir: Path, overrides: list[str] = ()) -> Trainer:
        """Continue from the latest checkpoint with its config, or with ``overrides`` of how long the run goes on
        and at which rate (:data:`~lmserve.training.config.RESUME_SETTABLE`): a finished run then goes on to the
        new epochs or token budget, for example annealed by ``schedule.type = linear``."""
        ckpt = resolve_checkpoint(run_dir, "latest")
        saved = json.loads((ckpt / "config.json").read_text())
        cfg = resumed_config(saved, list(overrides), str(ckpt / "config.json"))
        dist = setup(training_device(cfg.train.device))
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        trainer = cls(cfg, run_dir, Vocabulary.load(ckpt / "vocab.tsv"), dist)
        load_weights(trainer.model, ckpt / "model.safetensors")
        state, carried = load_training_state(ckpt, trainer.optimizer)
        trainer.objective.load_state_dict(
            {k: v.to(trainer.device) for k, v in load_objective_state(ckpt).items()}
        )  # an adapted proposal
        trainer.carried = None if carried is None else tuple(t.to(trainer.device) for t in carried)
        scheduler_state = state.pop("scheduler")
        if trainer.scheduler is not None and saved["schedule"]["type"] == cfg.schedule.type:
            trainer.scheduler.load_state_dict(scheduler_state)  # a new schedule type starts from optimizer.lr
        if overrides:
            state["finished"] = None  # fit() stops again at once if the new limits are already reached
            if dist.is_main:
                atomic_write_text(run_dir / "config.json", json.dumps(cfg.to_dict(), indent=2) + "\n")
        trainer.state = state
        trainer.log.write(
            "resume", checkpoint=ckpt.name, epochs_done=state["epochs_done"], batch=state["batch"], set=list(overrides)
        )
        trainer._say(f"resuming from {ckpt}" + (f" with {' '.join(overrides)}" if overrides else ""))
        return trainer

    @classmethod
    def fresh_or_resume(cls, cfg: Config, run_dir: Path, init_from: Path | None = None) -> Trainer:
        """Resume ``run_dir`` when it has a checkpoint (its config must be ``cfg``), else start it: the one command
        that ``torchrun --max-restarts`` can run again after a rank died."""
        try:
            ckpt = resolve_checkpoint(run_dir, "latest")
        except CheckpointError:
            return cls.fresh(cfg, run_dir, init_from)
        saved = json.loads((ckpt / "config.json").read_text())
        cfg = carved_config(cfg, run_dir)  # as fresh() saved it
        if saved != cfg.to_dict():
            changed = sorted(
                f"{section}.{key}"
                for section, body in cfg.to_dict().items()
                for key, value in body.items()
                if saved.get(section, {}).get(key) != value
            )
            raise CheckpointError(
                f"{run_dir}: its config differs from this one ({', '.join(changed)}); use another --out"
            )
        return cls.resume(run_dir)

    # -- the loop --------------------------------------------------------------------------------------------

    @property
    def parts(self) -> int:
        """Parts of each step's global batch: one per rank and accumulated micro-batch."""
        return self.dist.world * self.cfg.train.accumulate

    def _my_parts(self) -> list[int]:
        return [k * self.dist.world + self.dist.rank for k in range(self.cfg.train.accumulate)]

    def train_steps(self, epoch: int, start: int = 0) -> Iterator[list]:
        """This rank's micro-batches of each step of ``epoch`` from batch ``start`` on, as :meth:`step` takes them
        (routed into static shapes for ``train.compile``; the router runs in the prefetch thread)."""
        steps = self.train_batches.steps_of(epoch, start, self.dist.rank, self.dist.world, self.cfg.train.accumulate)
        return steps if self.router is None else map(self.router, steps)

    def fit(self) -> dict:
        cfg, st = self.cfg, self.state
        self._clock = (st["wall_seconds"], time.perf_counter())
        try:
            with _StopFlag() as stop:
                if st.get("init_from") and st["best_valid_ppl"] is None:
                    self._evaluate_initial()
                while st["finished"] is None:
                    if st["epochs_done"] >= cfg.train.epochs:
                        st["finished"] = "epochs"
                        break
                    if cfg.train.max_tokens and st["tokens_seen"] >= cfg.train.max_tokens:
                        st["finished"] = "token budget"
                        break
                    outcome = self._train_epoch(stop)
                    if outcome == "interrupted":
                        path = self._save(carried=self.carried)
                        self.log.write("interrupted", checkpoint=path.name, tokens_seen=st["tokens_seen"])
                        raise TrainingInterrupted(f"saved {path}; continue with: lm-train fit --resume {self.run_dir}")
                    path = self._end_epoch(budget_spent=outcome == "budget")
                    if self.dist.sum([float(stop.raised)])[0]:
                        raise TrainingInterrupted(f"saved {path}; continue with: lm-train fit --resume {self.run_dir}")
            return self._finish()
        finally:
            if isinstance(self.loss, nn.parallel.DistributedDataParallel):
                self.loss = self.loss.module  # see Distributed.close
            self.dist.close()

    def _train_epoch(self, stop: _StopFlag) -> str:
        cfg, st = self.cfg, self.state
        epoch = st["epochs_done"]
        budget = cfg.train.max_tokens
        self.model.train()
        states = self._carried_parts()
        total = self.train_batches.num_batches(epoch, self.parts)
        bar = tqdm(
            total=total,
            initial=st["batch"],
            desc=f"epoch {epoch + 1}/{cfg.train.epochs}",
            unit="batch",
            mininterval=1.0 if sys.stderr.isatty() else 30.0,
            dynamic_ncols=True,
            leave=False,
            disable=not self.dist.is_main,
        )
        losses, window_tokens, window_start = StepLosses(), 0, time.perf_counter()

        def read_losses() -> float:  # the wait for the steps still running counts as training time
            t0 = time.perf_counter()
            nll = losses.read(f"epoch {epoch + 1}, batch {st['batch'] - 1}")
            st["train_seconds"] += time.perf_counter() - t0
            st["epoch_nll"] += nll
            return nll

        outcome = "done"
        steps = self.train_steps(epoch, st["batch"])
        for micro in prefetched(steps, cfg.train.prefetch, pin=self.device.type == "cuda"):
            t0 = time.perf_counter()
            result = self.step(micro, states, stop.raised)
            if result is None:  # a rank was asked to stop: every rank stops before this step
                outcome = "interrupted"
                break
            nll, n, states = result
            st["train_seconds"] += time.perf_counter() - t0
            losses.add(nll, f"epoch {epoch + 1}, batch {st['batch']}")
            st["batch"] += 1
            st["tokens_seen"] += n
            st["epoch_tokens"] += n
            window_tokens += n
            bar.update()
            if st["batch"] % cfg.train.log_interval == 0 or st["batch"] == total:
                window_nll = read_losses()
                elapsed = time.perf_counter() - window_start
                lr = self.optimizer.param_groups[0]["lr"]
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
                window_tokens, window_start = 0, time.perf_counter()
            if budget and st["tokens_seen"] >= budget:
                outcome = "budget"
                break
        read_losses()  # the steps since the last log line
        bar.close()
        if outcome == "budget" and st["batch"] == total:
            outcome = "done"  # the budget and the epoch ran out together
        self.carried = self._gather_carried(states) if outcome in ("interrupted", "budget") else None
        return outcome

    def step(self, micro: list[Batch], states: list, stop: bool):
        """One optimisation step over this rank's micro-batches; returns (summed NLL over all ranks, tokens over all
        ranks, LSTM states to carry), or None when any rank was asked to stop (then no rank takes the step). The NLL
        is a float, or with ``train.compile`` a tensor on the device, not yet waited for (:class:`StepLosses`).

        Every micro-batch's summed loss is divided by the *global* number of sequences (or tokens) of the step and
        multiplied by the world size, which DDP's gradient average divides out again: W ranks x K micro-batches then
        compute the gradient one process computes on the whole batch. With ``train.compile`` the micro-batch is a
        routed one and the work is training/fast_step.py's."""
        cfg, st, dist = self.cfg, self.state, self.dist
        sequences, tokens, stopping = dist.sum(
            [sum(b.num_sequences for b in micro), sum(b.num_tokens for b in micro), float(stop)]
        )
        if stopping:
            return None
        denominator = sequences if cfg.train.loss_reduction == "sequence_sum" else tokens
        scale = dist.world / denominator
        carries = self.train_batches.carries_state
        if self.fast is not None:
            self._set_lr()
            nll, state = self.fast(micro[0], states[0], scale)
            return nll, int(tokens), [state if carries else None]
        self.optimizer.zero_grad(set_to_none=True)
        nll, new_states = 0.0, []
        for k, (part, batch, state) in enumerate(zip(self._my_parts(), micro, states, strict=True)):
            torch.manual_seed(step_seed(cfg.train.seed, st["epochs_done"], st["batch"], part))
            last = k == len(micro) - 1
            sync = contextlib.nullcontext() if last or not dist.active else self.loss.no_sync()
            with sync:
                with self._autocast():  # bf16 matrix products in the forward pass; backward follows its dtypes
                    loss, part_nll, state = self.loss(batch.to(self.device), state)
                with record_function("backward"):
                    (loss.float() * scale).backward()
            nll += part_nll.item()
            new_states.append(tuple(s.detach() for s in state) if carries else None)
        with record_function("optimizer"):
            self._set_lr()
            if cfg.train.clip_norm:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.train.clip_norm)
            self.optimizer.step()
        (nll,) = dist.sum([nll])
        return nll, int(tokens), new_states

    def _set_lr(self) -> None:
        if self.cfg.schedule.type == "linear":
            for group in self.optimizer.param_groups:
                group["lr"] = linear_lr(self.cfg, self.state["tokens_seen"])

    def _autocast(self):
        if self.cfg.train.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _carried_parts(self) -> list:
        """This rank's share of the carried state of the whole batch (saved in part order), one per micro-batch."""
        if self.carried is None:
            return [None] * self.cfg.train.accumulate
        sizes = [len(p) for p in np.array_split(np.arange(self.cfg.train.batch_size), self.parts)]
        pieces = [torch.split(t, sizes, dim=1) for t in self.carried]
        return [(pieces[0][p].contiguous(), pieces[1][p].contiguous()) for p in self._my_parts()]

    def _gather_carried(self, states: list):
        """The carried state of the whole batch, its parts in order (so a resumed run may use other W or K)."""
        if not self.train_batches.carries_state or states[0] is None:
            return None
        mine = {p: tuple(t.cpu() for t in s) for p, s in zip(self._my_parts(), states, strict=True)}
        if self.dist.active:
            everyone = [None] * self.dist.world
            torch.distributed.all_gather_object(everyone, mine)
            mine = {p: s for ranks in everyone for p, s in ranks.items()}
        ordered = [mine[p] for p in range(self.parts)]
        return tuple(torch.cat([s[i] for s in ordered], dim=1).to(self.device) for i in range(2))

    def _evaluate(self, batcher) -> EvalResult:
        return evaluate(self.model, batcher, self.vocab.unk_id, self.dist)

    def _start_from(self, ckpt: Path) -> None:
        """The initial checkpoint's weights (``training.adapt``), and how much of the new text its vocabulary lacks."""
        load_weights(self.model, ckpt / "model.safetensors")
        source = bundle_source(ckpt)  # a checkpoint rebuilt from a model bundle (training.from_bundle): the bundle
        self.state["init_from"] = {"bundle": source} if source else {"checkpoint": str(ckpt)}
        self.state["init_from"]["valid_ppl"] = None
        lacking = ", ".join(
            f"{name} {counts['oov']:,} of {counts['words']:,} ({100 * counts['oov_rate']:.2f}%)"
            for name, counts in self._oov_counts().items()
        )
        self._say(
            f"init from {source or ckpt}: its vocabulary of {len(self.vocab):,} kept; words outside it -> <unk>: "
            f"{lacking}"
        )

    def _oov_counts(self) -> dict[str, dict]:
        """Per split: its words, and those that are <unk> (outside the vocabulary, or written <unk> in the text)."""
        return {
            name: {"words": corpus.num_words, "oov": corpus.oov, "oov_rate": corpus.oov_rate}
            for name in ("train", "valid", "test")
            if (corpus := getattr(self.data, name)) is not None
        }

    def _evaluate_initial(self) -> None:
        """The initial weights evaluated before any update and saved as the first ``best`` checkpoint: an epoch must
        beat them to replace them, so the run never ends worse on the validation text than it started."""
        st = self.state
        valid = self._evaluate(self.valid_batches)
        st["best_valid_ppl"] = st["init_from"]["valid_ppl"] = valid.ppl
        self.log.write("valid", epoch=0, tokens_seen=0, lr=self.optimizer.param_groups[0]["lr"], **valid.to_dict())
        self._say(f"initial model: valid ppl {valid.ppl:.2f}")
        path = self._save()
        if self.dist.is_main:
            mark_best(self.run_dir, path.name)
        self.dist.barrier()

    def _end_epoch(self, budget_spent: bool) -> Path:
        """Validate, then save. A token budget that ran out part-way through an epoch leaves the epoch open: the
        checkpoint keeps its batch position (and the streams' carried state), so ``--resume --set
        train.max_tokens=...`` reads on into text the model has not seen instead of starting the epoch again."""
        cfg, st = self.cfg, self.state
        valid = self._evaluate(self.valid_batches)
        train_ppl = math.exp(st["epoch_nll"] / max(1, st["epoch_tokens"]))
        epoch = st["epochs_done"] + 1
        if not budget_spent:
            st["epochs_done"] += 1
            st["batch"] = 0
            st["epoch_nll"], st["epoch_tokens"] = 0.0, 0
        lr = self.optimizer.param_groups[0]["lr"]
        self.log.write(
            "valid",
            epoch=epoch,
            tokens_seen=st["tokens_seen"],
            lr=lr,
            train_ppl=train_ppl,
            tokens_per_s=st["tokens_seen"] / st["train_seconds"],
            **valid.to_dict(),
        )
        self._say(
            f"epoch {epoch}{', token budget spent' if budget_spent else ''}: train ppl {train_ppl:.2f}, "
            f"valid ppl {valid.ppl:.2f}, lr {lr:.4g}, {st['tokens_seen'] / st['train_seconds']:.0f} tokens/s"
        )
        improved = st["best_valid_ppl"] is None or valid.ppl < st["best_valid_ppl"]
        if improved:
            st["best_valid_ppl"] = valid.ppl
        patience = cfg.train.early_stop_patience
        if budget_spent:  # the epoch is still open: patience and per-epoch schedules count it when it ends
            st["finished"] = "token budget"
        else:
            st["bad_epochs"] = 0 if improved else st["bad_epochs"] + 1
            if isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                self.scheduler.step(valid.ppl)
            elif self.scheduler is not None:
                self.scheduler.step()
            if patience and st["bad_epochs"] >= patience:
                st["finished"] = f"early stop: no better validation ppl for {patience} epochs"
            elif st["epochs_done"] >= cfg.train.epochs:
                st["finished"] = "epochs"
        path = self._save(carried=self.carried)
        if self.dist.is_main:
            if improved:
                mark_best(self.run_dir, path.name)
            prune_checkpoints(self.run_dir)
            plot_curves(self.log.read(), self.run_dir / "curves.png", str(self.run_dir.name))
        self.dist.barrier()  # the best checkpoint exists before any rank may read it
        return path

    def _save(self, carried=None) -> Path:
        """Rank 0 writes the checkpoint (weights and optimiser state are the same on every rank)."""
        st = self.state
        base, since = self._clock
        st["wall_seconds"] = base + time.perf_counter() - since
        name = checkpoint_name(st["epochs_done"], st["batch"])
        if not self.dist.is_main:
            return self.run_dir / "checkpoints" / name
        return save_checkpoint(
            self.run_dir,
            name,
            model=self.model,
            optimizer=self.optimizer,
            config=self.cfg,
            vocab=self.vocab,
            state={**st, "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None},
            carried=carried,
            subword_model=run_subword_model(self.cfg, self.run_dir),
            objective_state=self.objective.state_dict(),
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
            "tokens_per_s": st["tokens_seen"] / st["train_seconds"] if st["train_seconds"] else 0.0,  # 0 epochs: 0
            "world_size": self.dist.world,
            "valid": self._evaluate(self.valid_batches).to_dict(),
            "valid_oov_rate": self.data.valid.oov_rate,
        }
        if st.get("init_from"):
            results["init_from"] = {**st["init_from"], "oov": self._oov_counts()}
        if self.data.test is not None:
            test_batches = make_batcher(self.cfg, self.data.test, self.vocab, training=False)
            results["test"] = self._evaluate(test_batches).to_dict()
            results["test_oov_rate"] = self.data.test.oov_rate
            self.log.write("test", **results["test"])
        if self.dist.is_main:
            atomic_write_text(self.run_dir / "results.json", json.dumps(results, indent=2) + "\n")
        return results


def describe(result: EvalResult, oov_rate: float) -> str:
    return (
        f"ppl {result.ppl:.2f} ({result.tokens} tokens), without OOV targets {result.ppl_no_oov:.2f}, "
        f"OOV rate {100 * oov_rate:.2f}%, log Z mean {result.logz_mean:.3f} std {result.logz_std:.3f}"
    )
