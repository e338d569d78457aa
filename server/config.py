"""The server's TOML config: where to listen, what a request may ask for, and which models to hold under which names.

    [server]
    host = "127.0.0.1"            # loopback by default: expose the service on purpose
    port = 50051
    workers = 2                   # scorer calls at once (ONNX Runtime and KenLM release the GIL)
    engine = "threads"            # where they run: "threads" of the server process, or "processes" of their own (a
                                  # copy of the models each; no GIL shared with the gRPC side: more lists/s, more RAM)
    scorer_threads = 1            # ONNX Runtime intra-op threads per model
    device = "cpu"                # where the neural LMs run: "cpu" or "cuda" (onnxruntime-gpu: lmserve[gpu]); the
                                  # command line's --device wins
    default_model = "librispeech" # for requests that name no model; default: the first model below
    max_concurrent_calls = 64     # calls (a stream: one, while open) of the LM and Admin services beyond this are
                                  # refused with RESOURCE_EXHAUSTED and logged ("call refused"); health checks never
                                  # are, and health service "lmserve.v1.LMService" (readiness) is NOT_SERVING while
                                  # this many are in flight, "" (liveness) stays SERVING
    grace_seconds = 5.0           # on SIGTERM/SIGINT, how long in-flight calls may take to finish
    metrics_port = 9090           # Prometheus /metrics over HTTP on the same host; 0: any free port; -1 (default): off
    admin = false                 # the lmserve.v1.Admin service (ReloadModels) on the same port, unauthenticated
                                  # unless [tls] has client_ca: off by default; SIGHUP reloads either way

    [limits]                      # a request beyond one is refused with RESOURCE_EXHAUSTED naming the limit
    max_sentences = 1000          # ScoreSentences: sentences per request
    max_words = 200               # words per sentence or hypothesis (rescoring.nbest.checks.MAX_WORDS, the limit
                                  # lm-rescore applies offline too)
    max_lists = 500               # RescoreNBest/KBest: lists per request
    max_hypotheses = 20000        # RescoreNBest/KBest: hypotheses per request, all lists together
    max_candidates = 1000         # ScoreNextWords: candidates, or top_k; ScoreNextWordsBatch: candidates per item
    max_items = 1024              # ScoreNextWordsBatch and StreamNextWords: items (states) per request
    max_step_words = 16384        # ScoreNextWordsBatch and StreamNextWords: words to score per request, all items'
                                  # candidates together (items x candidates; 1024 x 1000 took 7 GB RSS): at most one
                                  # batch of [batching] max_batch_tokens
    max_message_bytes = 16777216  # any request or response; a step whose answer would be larger (state tokens are
                                  # most of it: a 2x256 LSTM's is 4 kB a word) is refused before it is scored
    steps_in_flight_mb = 64       # not a refusal: decoder steps of all calls together hold at most about this much
                                  # memory (answers, state tokens, states made; estimated) between being scored and
                                  # answered; steps beyond it wait their turn (one larger than it runs alone)

    [batching]                    # concurrent calls of one model merged into one scorer call (ScoreSentences, and the
    enabled = true                # LM scores of RescoreNBest/KBest); false: every call scores alone
    max_batch_tokens = 16384      # words + </s> of all sentences or hypotheses in one batch, or the candidate words
                                  # of decoder steps (a bigger call runs alone)
    max_wait_ms = 10.0            # how long a free worker waits for company while the model is busy (idle: no wait)

    [state_cache]                 # decoder states kept on the server for clients that ask (cache_states): ids, not
    max_mb = 64.0                 # tokens, travel; at most this many MB of states (least recently used evicted
    ttl_seconds = 60.0            # first), each dropped after this long unused; max_mb = 0: no cache. A step that
                                  # would keep more states than max_mb holds is refused (RESOURCE_EXHAUSTED)

    [tls]                         # optional; without it the port is plaintext (and on loopback by default)
    cert = "tls/server.pem"       # PEM certificate chain of the server
    key = "tls/server.key"        # its PEM private key
    client_ca = "tls/ca.pem"      # optional: require client certificates signed by this CA (mutual TLS)

    [models.librispeech]          # one table per model; the name is what requests use
    bundle = "bundles/gutenberg_rescore"   # paths are relative to this file
    ngram = "ngrams/gutenberg_4gram.bin"   # optional KenLM model on the bundle's tokens
    normalize = "librispeech"     # optional core.textnorm preset; default: the bundle's own text settings
    lambda = 0.5                  # optional per-word interpolation weight: ScoreSentences/ScoreNextWords add it
    open_vocab = false            # optional: score unknown words from their spelling (a bundle whose head spells,
                                  # charcnn or cnnsoftmax) in ScoreSentences and RescoreNBest/KBest, not as <unk>
    precision = "fp32"            # optional: "fp16" computes in float16 on device "cuda" (rescoring.precision)
    [models.librispeech.profiles] # weights files written by `lm-rescore tune`, by profile name
    dev_clean = "rescore/dev_clean.weights.json"

Unknown keys and wrong types are errors that name the key. A reload (SIGHUP, ``Admin.ReloadModels``) reads the file
again but applies only ``[models]`` and ``server.default_model``; the rest takes effect at a restart.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

from lmserve.core.tomlconfig import ConfigError, check_keys, check_table, read_section, read_toml
from lmserve.rescoring.nbest.checks import MAX_WORDS
from lmserve.rescoring.precision import PRECISIONS
from lmserve.rescoring.scorer import DEVICES

ENGINES = ("threads", "processes")  # server.engine
SECTIONS = ("server", "limits", "batching", "state_cache", "tls", "models")
# the keys of a [models.NAME] table and of [tls], and their TOML types (paths are strings, resolved against the file)
MODEL_KEYS = {
    "bundle": str,
    "ngram": str,
    "normalize": str,
    "lambda": float,
    "profiles": dict[str, str],
    "open_vocab": bool,
    "precision": str,
}
TLS_KEYS = {"cert": str, "key": str, "client_ca": str}


@dataclass
class Limits:
    max_sentences: int = 1000
    max_words: int = MAX_WORDS
    max_lists: int = 500
    max_hypotheses: int = 20000
    max_candidates: int = 1000
    max_items: int = 1024
    max_step_words: int = 16384
    max_message_bytes: int = 16 * 1024 * 1024
    steps_in_flight_mb: int = 64
    stream_idle_s: float = 300.0  # a stream with no step for this long is closed, its call slot freed


@dataclass
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 50051
    workers: int = 2
    engine: str = "threads"
    scorer_threads: int = 1
    device: str = "cpu"
    default_model: str = ""
    max_concurrent_calls: int = 64
    grace_seconds: float = 5.0
    metrics_port: int = -1
    admin: bool = False


@dataclass
class Batching:
    enabled: bool = True
    max_batch_tokens: int = 16384
    max_wait_ms: float = 10.0


@dataclass
class StateCacheSettings:
    max_mb: float = 64.0
    ttl_seconds: float = 60.0


@dataclass
class Tls:
    """Paths are resolved against the config file's folder; the files are read when the server starts."""

    cert: Path
    key: Path
    client_ca: Path | None = None


@dataclass
class ModelConfig:
    bundle: Path
    ngram: Path | None = None
    normalize: str | None = None
    lam: float | None = None
    profiles: dict[str, Path] = field(default_factory=dict)
    open_vocab: bool = False
    precision: str = "fp32"


@dataclass
class Config:
    path: Path
    server: ServerSettings
    limits: Limits
    models: dict[str, ModelConfig]
    batching: Batching = field(default_factory=Batching)
    tls: Tls | None = None
    state_cache: StateCacheSettings = field(default_factory=StateCacheSettings)

    @property
    def default_model(self) -> str:
        return self.server.default_model or next(iter(self.models))


def load_config(path: str | Path) -> Config:
    path = Path(path)
    data = read_toml(path)
    check_keys(data, SECTIONS, path)
    server = read_section(ServerSettings, data.get("server", {}), path, "server")
    limits = read_section(Limits, data.get("limits", {}), path, "limits")
    batching = read_section(Batching, data.get("batching", {}), path, "batching")
    if batching.max_batch_tokens < 1 or batching.max_wait_ms < 0:
        raise ConfigError(
            f"{path}: batching.max_batch_tokens = {batching.max_batch_tokens}, batching.max_wait_ms = "
            f"{batching.max_wait_ms}: expected at least 1 token and a wait of 0 ms or more"
        )
    state_cache = read_section(StateCacheSettings, data.get("state_cache", {}), path, "state_cache")
    if state_cache.max_mb < 0 or state_cache.ttl_seconds <= 0:
        raise ConfigError(
            f"{path}: state_cache.max_mb = {state_cache.max_mb}, state_cache.ttl_seconds = {state_cache.ttl_seconds}: "
            "expected 0 MB (no cache) or more and a ttl above 0 s"
        )
    for name, least in (("workers", 1), ("scorer_threads", 1), ("max_concurrent_calls", 1), ("port", 0)):
        if getattr(server, name) < least:
            raise ConfigError(f"{path}: server.{name} = {getattr(server, name)}: expected at least {least}")
    if server.device not in DEVICES:
        raise ConfigError(f"{path}: server.device = {server.device!r}: expected one of {list(DEVICES)}")
    if server.engine not in ENGINES:
        raise ConfigError(f"{path}: server.engine = {server.engine!r}: expected one of {list(ENGINES)}")
    if server.metrics_port < -1:
        raise ConfigError(f"{path}: server.metrics_port = {server.metrics_port}: expected a port, 0 (any) or -1 (off)")
    for f in fields(Limits):
        if getattr(limits, f.name) < 1:
            raise ConfigError(f"{path}: limits.{f.name} must be at least 1")
    models_table = data.get("models")
    if not isinstance(models_table, dict) or not models_table:
        raise ConfigError(f"{path}: no models: add a [models.NAME] table with a bundle path")
    models = {name: _model(table, path, f"models.{name}") for name, table in models_table.items()}
    if server.default_model and server.default_model not in models:
        raise ConfigError(f"{path}: server.default_model = {server.default_model!r} is not one of {sorted(models)}")
    tls = None if "tls" not in data else _tls(data["tls"], path)
    return Config(path, server, limits, models, batching, tls, state_cache)


def _tls(table: object, path: Path) -> Tls:
    values = check_table(table, TLS_KEYS, path, "tls", required=("cert", "key"))
    base, client_ca = path.parent, values.get("client_ca")
    return Tls(base / values["cert"], base / values["key"], None if client_ca is None else base / client_ca)


def _model(table: object, path: Path, where: str) -> ModelConfig:
    values = check_table(table, MODEL_KEYS, path, where, required=("bundle",))
    ngram, lam = values.get("ngram"), values.get("lambda")
    if lam is not None and not 0.0 < lam < 1.0:
        raise ConfigError(f"{path}: {where}.lambda = {lam}: expected a value in (0, 1)")
    if lam is not None and ngram is None:
        raise ConfigError(f"{path}: {where}.lambda needs {where}.ngram (it interpolates the two models)")
    precision = values.get("precision") or "fp32"
    if precision not in PRECISIONS:
        raise ConfigError(f"{path}: {where}.precision = {precision!r}: expected one of {list(PRECISIONS)}")
    base = path.parent
    return ModelConfig(
        base / values["bundle"],
        None if ngram is None else base / ngram,
        values.get("normalize"),
        lam,
        {name: base / file for name, file in values.get("profiles", {}).items()},
        values.get("open_vocab", False),
        precision,
    )
