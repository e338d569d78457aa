"""Training configuration: TOML file + ``--set section.key=value`` overrides -> typed, validated dataclasses.

A run is fully described by its resolved config, which is saved with every checkpoint so that ``--resume``,
``lm-train eval`` and export never need the original TOML file.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path

from lmserve.core.tomlconfig import ConfigError, check_keys, check_table, parse_override, read_toml

# The shared data sets: $LMSERVE_DATA (or lm-train --data-dir, which sets it), else ../shared/data from the current
# directory, where they lie for a source checkout's root (make and CI run there). Never a path computed from where
# the package is installed.
DATA_ENV = "LMSERVE_DATA"
CHECKOUT_DATA_DIR = Path("..") / "shared" / "data"


@dataclass
class DataConfig:
    """Text files (plain or gzipped, one sentence per line) and how they are cut into batches."""

    # each a text file, or a prepared dataset directory (`lm-train prepare`; its split of this name, or DIR:SPLIT)
    train: str = ""
    valid: str = ""
    test: str = ""
    lowercase: bool = False
    # stream: B parallel streams cut in BPTT chunks, state carried (Zaremba et al.);
    # sentence: independent "<s> ... </s>" sequences from a fresh state, as sentences are scored later.
    mode: str = "stream"
    # sentence mode only: training sentences longer than this are skipped (0 = keep all); evaluation keeps all.
    max_sentence_len: int = 0
    # with one text file and no data.valid: the last lines of data.train (this share of them, contiguous) become the
    # validation text, written to RUN/carved/ with the rest (training/valid_split.py); 0 = data.valid is required
    valid_fraction: float = 0.0
    # forward: each word from the words before it; backward: from the words after it, as a backward LM for
    # rescoring beside a forward one (every split read last word first and last sentence first: a stream carries the
    # state from a sentence to the one before it). The bundle says so (manifest "direction") and scores sentences
    # reversed; it gives ``lm-rescore annotate`` a list feature and no decoder scores (docs/training.md)
    direction: str = "forward"


@dataclass
class VocabConfig:
    """The vocabulary cut from data.train's text; with a prepared dataset it is the dataset's own (made by
    ``lm-train prepare``'s options) and only ``file`` is checked against it."""

    file: str = ""  # reuse an existing vocabulary file instead of building one from the training text
    min_count: int = 1
    max_size: int = 0  # total size including the specials; 0 = no limit
    unk: str = "<unk>"  # the data's own unknown-word token, if it has one (PTB does)
    # word: whitespace words (min_count/max_size); subword: an open vocabulary of sentencepiece pieces learnt from
    # the training text by prepare (training/subword.py), a word scored as the sum of its pieces
    type: str = "word"
    pieces: int = 8000  # subword: pieces in the sentencepiece model (specials and 256 byte pieces included)
    subword_model: str = "unigram"  # subword: unigram | bpe


@dataclass
class ModelConfig:
    embedding_size: int = 200
    hidden_size: int = 200
    layers: int = 2
    dropout: float = 0.0  # on non-recurrent connections only (Zaremba et al.)
    tie_embeddings: bool = False
    projection_size: int = 0  # project the top hidden state to this size before the head (0 = none)
    init_range: float = 0.1  # every parameter ~ U(-r, r); 0 keeps PyTorch's defaults
    # slim input embeddings (Li et al. 2018): each word's embedding is input_slim_subvectors sub-vectors drawn from
    # input_slim_pool shared ones (a fraction input_slim_pool / (input_slim_subvectors * |V|) of the parameters);
    # 0 = a full matrix. (head.slim_subvectors and head.slim_pool are the slim *output* layer's.)
    input_slim_pool: int = 0
    input_slim_subvectors: int = 10


@dataclass
class HeadConfig:
    type: str = "full"  # full | adaptive | class | tree | slim | charcnn | dsoftmax | cnnsoftmax
    # adaptive: ids < cutoffs[0] are the shortlist; dsoftmax: the first ids of the frequency bands after the first
    cutoffs: list[int] = field(default_factory=list)
    div_value: float = 4.0  # adaptive: cluster i projects to size // div_value ** (i + 1)
    # uniform: like every other parameter (model.init_range); unigram: output biases start at the log unigram
    # distribution of the training text, so the untrained model predicts word frequencies and log Z starts near 0
    # (the bias-at-log-P_noise fix of NCE). The head gets the distribution either way: class and Huffman-tree heads
    # are built from it, sampled objectives draw noise from it.
    bias_init: str = "uniform"
    classes: int = 0  # class: number of classes (0 = round(sqrt(|V|)))
    # class: a trained run (or checkpoint) over the same vocabulary whose input embeddings are clustered into the
    # classes (empty: frequency bins)
    class_embeddings: str = ""
    # tree: huffman (codes of the training unigram) | clustered (top-down splits of tree_embeddings) |
    # huffman_clustered (Huffman path lengths, words placed by tree_embeddings) | balanced
    tree: str = "huffman"
    tree_embeddings: str = ""  # tree = (huffman_)clustered: a trained run (or checkpoint) over the same vocabulary
    # slim (the output layer; model.input_slim_* are the input embedding's): K sub-vectors per output vector (divides
    # the head's input size)
    slim_subvectors: int = 4
    slim_pool: int = 0  # slim: M shared sub-vectors in all, M/K per position (a multiple of K; required)
    # slim: a trained run (or checkpoint) over the same vocabulary whose output vectors (or input embeddings) are cut
    # into the K sub-vectors and clustered by k-means, M/K clusters per position: the pools start at the centroids and
    # each word takes its chunks' clusters (Li 2019, ch. 4); empty: a random balanced assignment
    slim_embeddings: str = ""
    # dsoftmax (Chen et al. 2016): output vector widths of the frequency bands (one per band, non-increasing); disjoint:
    # the bands read segments that partition the hidden state (widths add up to its size); nested: each band reads the
    # first `width` dimensions (the first band all of them)
    band_widths: list[int] = field(default_factory=list)
    band_layout: str = "disjoint"
    # charcnn (Labeau 2018, ch. 5): each output vector is a word vector (the head's input size less charcnn_size)
    # concatenated with a char-CNN vector of the word's spelling (charcnn_size: one max-pooled filter bank per
    # width, charcnn_size / len(widths) filters each, over the first charcnn_max_chars characters)
    charcnn_size: int = 100
    char_embedding_size: int = 16
    charcnn_widths: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 5])
    charcnn_max_chars: int = 20
    # cnnsoftmax (Jozefowicz et al. 2016): each output vector is the char-CNN's charcnn_size features projected to the
    # head's input size, plus a per-word correction vector of correction_size projected alike (0 = no correction)
    correction_size: int = 32
    # linear heads (full, slim, charcnn, dsoftmax, cnnsoftmax): scores are W h + b - log_z, NCE's normalising constant Z_c (Zoph et al. 2016 fix it to 9);
    # learn_log_z trains it from that start (Labeau & Allauzen 2018). Exact probabilities do not depend on it.
    log_z: float = 0.0
    learn_log_z: bool = False


@dataclass
class ObjectiveConfig:
    # cross_entropy | importance_sampling | nce | negative_sampling | blackout | beta_nce | target_sampling |
    # adaptive_importance_sampling
    type: str = "cross_entropy"
    selfnorm_alpha: float = 0.0  # weight of the alpha * (log Z)^2 penalty (Devlin et al. 2014)
    selfnorm_gamma: float = 1.0  # fraction of positions that pay the penalty, rescaled (Andreas et al. 2015)
    # sampled objectives: words drawn per step with replacement from Q, shared by the whole batch
    samples: int = 100
    noise_power: float = 1.0  # Q ∝ unigram ** noise_power (0.75 for negative sampling as in word2vec; 0 = uniform)
    noise_uniform: float = 0.0  # Q mixed with the uniform distribution: (1 - noise_uniform) Q + noise_uniform / |V|
    beta: float = 1.0  # beta_nce: the power of the divergence (1 = NCE)
    # importance_sampling: the target's logit in the sampled softmax, corrected by -log(expected count) like the
    # samples' (TensorFlow's sampled softmax) or exact: its own term of Z beside the samples' estimate of the rest,
    # an unbiased estimate of Z (see training/objectives/sampled.py)
    target_term: str = "corrected"
    # sampled objectives: the exact NLL behind the training perplexity is computed on every n-th position only
    nll_stride: int = 64
    # sampled objectives: that estimate on every n-th step only, the steps between counting its value per token; for
    # heads that compute their output vectors (charcnn, cnnsoftmax) it costs a CNN pass over the whole vocabulary
    nll_every: int = 1
    # adaptive_importance_sampling: each step moves the proposal this far towards the model's unigram distribution as
    # the step's importance weights estimate it (Bengio & Senecal 2008); 0 = a fixed proposal
    adapt_rate: float = 0.05


@dataclass
class OptimizerConfig:
    name: str = "sgd"  # sgd | adagrad | adam
    lr: float = 1.0
    momentum: float = 0.0
    weight_decay: float = 0.0


@dataclass
class ScheduleConfig:
    # fixed: lr * decay ** max(0, epoch - start_epoch) after each epoch (Zaremba et al.);
    # plateau: lr * decay when validation perplexity has not improved by `threshold` for `patience` epochs;
    # linear: lr until `start_tokens` training tokens, then down in a straight line, step by step, to lr * decay at
    # train.max_tokens (warmup-free "warmup-stable-decay": a run at a constant rate can be extended and annealed
    # later, `lm-train fit --resume RUN --set train.max_tokens=N --set schedule.type=linear ...`).
    type: str = "fixed"
    decay: float = 1.0
    start_epoch: int = 0
    patience: int = 0
    threshold: float = 0.0
    start_tokens: int = 0


@dataclass
class TrainConfig:
    seed: int = 1
    threads: int = 0  # 0 = PyTorch's default
    device: str = "cpu"  # "cpu", "cuda" or "cuda:N": where the model trains (checkpoints and bundles are the same)
    # streams (stream mode) or sentences (sentence mode) of one optimisation step, over all ranks and micro-batches:
    # the same config trains the same model on 1 process or under torchrun on W (batch_size divisible by W x accumulate)
    batch_size: int = 20
    bptt: int = 20
    eval_batch_size: int = 10
    epochs: int = 13
    max_tokens: int = 0  # stop after this many training tokens (0 = no budget)
    clip_norm: float = 5.0  # 0 = no clipping
    # sequence_sum: sum of token losses / number of sequences (Zaremba's scale: per-step batch means summed over
    # BPTT steps); token_mean: per-token mean.
    loss_reduction: str = "sequence_sum"
    # stop after this many epochs' evaluations without a better validation perplexity than the best so far (0 = off;
    # with lm-train fit --init-from the initial model's evaluation is the first best); `best` keeps the best one
    early_stop_patience: int = 0
    log_interval: int = 100  # batches between training-loss records
    accumulate: int = 1  # micro-batches per step and rank (gradient accumulation: large batches on few devices)
    precision: str = "fp32"  # fp32 | bf16 (autocast: matrix products in bfloat16, weights and optimiser in fp32)
    prefetch: int = 2  # steps of batches built ahead by a background thread (0 = none); pinned memory on a GPU
    # none: the eager step; compile: torch.compile of the forward and backward (CUDA graphs through mode
    # "reduce-overhead" on a GPU); cuda_graphs: forward, backward, clipping and Adam captured as CUDA graphs (a GPU
    # only); compile_graphs: the compiled loss inside cuda_graphs' captures (a GPU only). All score batches in static
    # shapes built on the CPU (training/fast_step.py says how and what they need).
    compile: str = "none"


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    vocab: VocabConfig = field(default_factory=VocabConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    head: HeadConfig = field(default_factory=HeadConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# objectives that train a linear head from a sample of words (training/objectives/sampled.py), and those heads
SAMPLED_OBJECTIVES = (
    "importance_sampling",
    "nce",
    "negative_sampling",
    "blackout",
    "beta_nce",
    "target_sampling",
    "adaptive_importance_sampling",
)
LINEAR_HEADS = ("full", "slim", "charcnn", "dsoftmax", "cnnsoftmax")

_CHOICES = {
    ("data", "mode"): ("stream", "sentence"),
    ("data", "direction"): ("forward", "backward"),
    ("vocab", "type"): ("word", "subword"),
    ("vocab", "subword_model"): ("unigram", "bpe"),
    ("head", "type"): ("full", "adaptive", "class", "tree", "slim", "charcnn", "dsoftmax", "cnnsoftmax"),
    ("head", "band_layout"): ("disjoint", "nested"),
    ("head", "bias_init"): ("uniform", "unigram"),
    ("head", "tree"): ("huffman", "clustered", "huffman_clustered", "balanced"),
    ("objective", "type"): ("cross_entropy", *SAMPLED_OBJECTIVES),
    ("objective", "target_term"): ("corrected", "exact"),
    ("optimizer", "name"): ("sgd", "adagrad", "adam"),
    ("schedule", "type"): ("fixed", "plateau", "linear"),
    ("train", "loss_reduction"): ("sequence_sum", "token_mean"),
    ("train", "precision"): ("fp32", "bf16"),
    ("train", "compile"): ("none", "compile", "cuda_graphs", "compile_graphs"),
}


# keys that have a new name: (section, old key) -> new key. The old key is still read (saved checkpoints and bundles
# hold it; a file or --set that gives it gets a warning), and a config is written with the new one.
RENAMED = {
    ("model", "slim_subvectors"): "input_slim_subvectors",
    ("model", "slim_pool"): "input_slim_pool",
}


def _renamed(section: str, key: str, source: str, warn: bool) -> str:
    """``key``'s current name in ``section``; with ``warn``, an old name says so on stderr."""
    new = RENAMED.get((section, key))
    if new is None:
        return key
    if warn:
        print(
            f"lm-train: warning: {source}: {section}.{key} is the old name of {section}.{new}; it is read as "
            f"{section}.{new}, but give that name: the old one will go",
            file=sys.stderr,
        )
    return new


def _with_current_names(raw: dict, source: str, warn: bool) -> dict:
    """``raw`` (a new dict) with every old key of :data:`RENAMED` under its new name; both names at once is an error."""
    raw = {section: dict(body) if isinstance(body, dict) else body for section, body in raw.items()}
    for (section, old), new in RENAMED.items():
        body = raw.get(section)
        if not isinstance(body, dict) or old not in body:
            continue
        if new in body:
            raise ConfigError(f"{source}: {section}.{old} is the old name of {section}.{new}: give one of them")
        body[_renamed(section, old, source, warn)] = body.pop(old)
    return raw


def config_from_dict(raw: dict, source: str = "<config>") -> Config:
    """Build a validated Config; unknown sections or keys and wrong types are errors that name them. Old key names
    (:data:`RENAMED`) are read under their new ones."""
    raw = _with_current_names(raw, source, warn=False)
    section_types = typing.get_type_hints(Config)
    check_keys(raw, section_types, source)
    sections = {}
    for name, body in raw.items():
        values = check_table(body, typing.get_type_hints(section_types[name]), source, name)
        for key, value in values.items():
            allowed = _CHOICES.get((name, key))
            if allowed and value not in allowed:
                raise ConfigError(f"{source}: {name}.{key} = {value!r}, expected one of {', '.join(allowed)}")
        sections[name] = section_types[name](**values)
    config = Config(**sections)
    _check_head_and_objective(config, source)
    _check_data_and_stopping(config, source)
    _check_compile(config, source)
    return config


def _check_head_and_objective(config: Config, source: str) -> None:
    """Combinations that cannot work, caught before a run starts."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", config.train.device):
        raise ConfigError(f"{source}: train.device = {config.train.device!r}, expected cpu, cuda or cuda:N")
    if config.train.accumulate < 1 or config.train.prefetch < 0 or config.train.batch_size < 1:
        raise ConfigError(f"{source}: train.batch_size and train.accumulate must be >= 1, train.prefetch >= 0")
    schedule, budget = config.schedule, config.train.max_tokens
    if schedule.type == "linear" and not budget > schedule.start_tokens >= 0:
        raise ConfigError(
            f"{source}: schedule.type = linear decays from schedule.start_tokens ({schedule.start_tokens:,}) to "
            f"train.max_tokens ({budget:,}): it needs train.max_tokens > schedule.start_tokens >= 0"
        )
    if config.data.direction == "backward" and config.vocab.type == "subword":
        raise ConfigError(
            f"{source}: data.direction = backward is for word vocabularies: a subword text read backwards reverses "
            "the pieces inside each word, which the scorer spells forwards"
        )
    head, objective = config.head, config.objective
    if objective.type in SAMPLED_OBJECTIVES and head.type not in LINEAR_HEADS:
        raise ConfigError(
            f"{source}: objective.type = {objective.type} scores a sample of words by dot products: it needs "
            f"head.type = {' or '.join(LINEAR_HEADS)}, got {head.type}"
        )
    if head.type == "dsoftmax" and not (head.cutoffs and head.band_widths):
        raise ConfigError(
            f"{source}: head.type = dsoftmax needs head.cutoffs (where the frequency bands start) and "
            "head.band_widths (one output width per band), e.g. cutoffs = [2000, 10000], band_widths = [128, 48, 24]"
        )
    if head.band_widths and head.type != "dsoftmax":
        raise ConfigError(f"{source}: head.band_widths is for head.type = dsoftmax, got {head.type}")
    if head.slim_embeddings and head.type != "slim":
        raise ConfigError(f"{source}: head.slim_embeddings is for head.type = slim, got {head.type}")
    if head.type == "cnnsoftmax" and head.correction_size < 0:
        raise ConfigError(f"{source}: head.correction_size = {head.correction_size}, expected >= 0 (0 = none)")
    if not 0.0 <= objective.adapt_rate <= 1.0:
        raise ConfigError(
            f"{source}: objective.adapt_rate = {objective.adapt_rate}, expected a step towards the model's unigram "
            "in [0, 1]"
        )


def _check_data_and_stopping(config: Config, source: str) -> None:
    data, patience = config.data, config.train.early_stop_patience
    if not 0.0 <= data.valid_fraction < 1.0:
        raise ConfigError(f"{source}: data.valid_fraction = {data.valid_fraction}, expected a share in [0, 1)")
    if data.valid_fraction and data.valid:
        raise ConfigError(
            f"{source}: data.valid_fraction = {data.valid_fraction} carves the validation text from data.train, "
            f"and data.valid = {data.valid!r} names one too: give one of them"
        )
    if patience < 0:
        raise ConfigError(f"{source}: train.early_stop_patience = {patience}, expected 0 (off) or more evaluations")


CAPTURED = ("cuda_graphs", "compile_graphs")  # the train.compile modes that capture the whole step (a GPU only)
COMPILED = ("compile", "compile_graphs")  # those that torch.compile the loss


def _check_compile(config: Config, source: str) -> None:
    """What the static-shape steps of training/fast_step.py support, checked before any data is read."""
    t, mode = config.train, config.train.compile
    if mode == "none":
        return
    where = f"{source}: train.compile = {mode}"
    if mode in CAPTURED and not t.device.startswith("cuda"):
        raise ConfigError(f"{where} captures CUDA graphs: it needs train.device = cuda or cuda:N, got {t.device!r}")
    if mode in CAPTURED and config.optimizer.name != "adam":
        raise ConfigError(
            f"{where} captures the update with the learning rate on the GPU: it needs optimizer.name = "
            f"adam, got {config.optimizer.name}"
        )
    if config.head.type not in ("full", "adaptive"):
        raise ConfigError(
            f"{where} scores batches in static shapes: it needs head.type = full or adaptive, got {config.head.type}"
        )
    if config.objective.type != "cross_entropy" or config.objective.selfnorm_alpha:
        raise ConfigError(f"{where} needs objective.type = cross_entropy and objective.selfnorm_alpha = 0")
    if config.model.dropout or t.accumulate != 1:
        raise ConfigError(
            f"{where} needs model.dropout = 0 and train.accumulate = 1, got {config.model.dropout} and {t.accumulate}"
        )


def data_dir() -> Path:
    """The shared data folder: ``$LMSERVE_DATA``, else ``../shared/data`` from the current directory."""
    return Path(os.environ.get(DATA_ENV) or CHECKOUT_DATA_DIR)


def expand_data_path(path: str) -> str:
    """Paths may say ``{data}`` for the shared data folder (:func:`data_dir`); an error when that folder is missing
    says how to name it."""
    if "{data}" not in path:
        return path
    folder = data_dir()
    if not folder.is_dir():
        where = f"${DATA_ENV} = {folder}" if os.environ.get(DATA_ENV) else f"{folder} (from {Path.cwd()})"
        raise ConfigError(
            f"{path}: {{data}} is the shared data folder, {where}, which does not exist: "
            f"set {DATA_ENV}=DIR or pass lm-train --data-dir DIR"
        )
    return path.replace("{data}", str(folder))


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    raw = read_config_file(path) if path is not None else {}
    return config_from_dict(apply_overrides(raw, overrides), str(path) if path else "<defaults>")


def read_config_file(path: str | Path) -> dict:
    """The TOML file as written, before defaults (old key names under their new ones): what ``--init-from`` needs to
    tell a key given from one left out."""
    return _with_current_names(read_toml(path), str(path), warn=True)


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """``raw`` with each ``--set section.key=value`` applied (a new dict; ``raw`` is left as it was)."""
    raw = {section: dict(body) if isinstance(body, dict) else body for section, body in raw.items()}
    for text in overrides:
        section, key, value = parse_override(text)
        raw.setdefault(section, {})[_renamed(section, key, f"--set {text!r}", warn=True)] = value
    return raw


# what `lm-train fit --resume RUN --set ...` may change: how long the run goes on and at which learning rate, never
# what the checkpoint's weights, optimiser state or data position mean
RESUME_SETTABLE = (
    "train.epochs",
    "train.max_tokens",
    "train.early_stop_patience",
    "train.log_interval",
    "train.threads",
    "train.prefetch",
    "schedule.*",
)


def resumed_config(saved: dict, overrides: list[str], source: str) -> Config:
    """The config a resumed run goes on with: the saved one (``source``) with ``overrides`` applied, which may only
    touch :data:`RESUME_SETTABLE` keys."""
    for text in overrides:
        section, key, _ = parse_override(text)
        name = f"{section}.{key}"
        if name not in RESUME_SETTABLE and f"{section}.*" not in RESUME_SETTABLE:
            raise ConfigError(
                f"--set {text!r}: a resumed run cannot change {name} (its checkpoint was trained with it); "
                f"--resume may change {', '.join(RESUME_SETTABLE)}"
            )
    return config_from_dict(apply_overrides(saved, overrides), source)
