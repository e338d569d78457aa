"""The models a server holds, by name: each a neural LM bundle, an optional n-gram, a text normalisation and weights
profiles, loaded once at start-up and checked against each other so that a bad pairing fails there, not in a call."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lmserve.rescoring.interpolated import InterpolatedLM
from lmserve.rescoring.precision import PrecisionError
from lmserve.rescoring.rescore import LanguageModels, Setup, setup_from_record
from lmserve.rescoring.tune import read_weights
from lmserve.server.config import Config, ConfigError, ModelConfig
from lmserve.server.engine import resolve


class UnknownModel(LookupError):
    """A request named a model or profile the server does not hold; the message lists the ones it does."""


@dataclass
class Profile:
    name: str
    path: Path
    record: dict  # the weights file, as read_weights checked it
    setup: Setup


@dataclass
class ServedModel:
    name: str
    config: ModelConfig
    lms: LanguageModels  # what rescoring uses: scorer, n-gram, text normaliser
    lm: InterpolatedLM  # what sentence and next-word scoring use: the same scorer and n-gram

    profiles: dict[str, Profile]
    threads: int  # ONNX Runtime intra-op threads
    generation: int  # of the ModelSet that loaded it
    device: str = "cpu"  # where its neural LM runs (``Scorer``)

    @classmethod
    def load(
        cls, name: str, config: ModelConfig, threads: int, generation: int = 1, device: str = "cpu"
    ) -> ServedModel:
        try:
            lms = LanguageModels.load(
                config.bundle, config.ngram, config.normalize, threads, config.open_vocab, device, config.precision
            )
        except PrecisionError as e:  # fp16 in the config, the device cpu (perhaps from the command line)
            raise ConfigError(f"models.{name}.precision = {config.precision!r}: {e}") from e
        if config.lam is not None and lms.normalisation == "unnormalised":
            raise ConfigError(
                f"models.{name}.lambda: {config.bundle}'s scores are unnormalised (see its manifest's heldout log Z), "
                "so they cannot be interpolated with the n-gram word by word; leave out lambda"
            )
        lm = InterpolatedLM(lms.scorer, lms.ngram, config.lam)
        model = cls(name, config, lms, lm, {}, threads, generation, device)
        for profile_name, path in config.profiles.items():
            model.profiles[profile_name] = model._profile(profile_name, path)
        return model

    def _profile(self, name: str, path: Path) -> Profile:
        """A weights file fits this model when it was tuned on the same text normalisation and uses only the LMs this
        model has: otherwise its weights would combine features unlike the ones they were tuned on."""
        record = read_weights(path)
        setup = setup_from_record(record)
        where = f"models.{self.name}.profiles.{name} ({path})"
        tuned_with = record.get("setup", {}).get("normalize")
        if tuned_with != self.config.normalize:
            raise ConfigError(
                f"{where}: tuned with normalize = {tuned_with!r}, the model uses {self.config.normalize!r}; "
                "give the model the text normalisation its weights were tuned with"
            )
        used = set(setup.features) | {t for terms in setup.definitions.values() for t in terms}
        if self.lms.ngram is None and used & {"ngram", "interp"}:
            raise ConfigError(
                f"{where}: uses n-gram features {sorted(used & {'ngram', 'interp'})}; the model has no ngram"
            )
        if setup.uses_interp and self.lms.normalisation == "unnormalised":
            raise ConfigError(
                f"{where}: uses interp, but the model's neural scores are unnormalised (not probabilities)"
            )
        return Profile(name, path, record, setup)

    def ref(self) -> tuple:
        """What names this model in a scoring process (``server.engine.resolve`` loads it from that)."""
        return (self.name, self.config, self.threads, self.generation, self.device)

    def __reduce__(self):
        """Pickled (to a scoring process, ``server.engine``) as a reference the process resolves to its own copy."""
        return (resolve, self.ref())

    def profile(self, name: str) -> Profile:
        if name not in self.profiles:
            raise UnknownModel(
                f"model {self.name!r} has no weights profile {name!r}; it has {sorted(self.profiles) or 'none'}"
            )
        return self.profiles[name]


class ModelSet:
    """The served models by name, and the default one for requests that name none. A set is never changed: a reload
    loads a new one (``generation`` one higher) and the server swaps it in whole, so a call that resolved its model
    keeps it to the end while later calls get the new set."""

    def __init__(self, models: dict[str, ServedModel], default: str, generation: int = 1, device: str = "cpu"):
        self.models = models
        self.default = default
        self.generation = generation
        self.device = device

    @classmethod
    def load(cls, config: Config, generation: int = 1, device: str | None = None) -> ModelSet:
        """``device``: where the neural LMs run, by default ``server.device``. A reload passes the running set's:
        [server] settings change at a restart only, and the device may have come from the command line."""
        threads, device = config.server.scorer_threads, device or config.server.device
        models = {
            name: ServedModel.load(name, model, threads, generation, device) for name, model in config.models.items()
        }
        return cls(models, config.default_model, generation, device)

    def get(self, name: str) -> ServedModel:
        model = self.models.get(name or self.default)
        if model is None:
            raise UnknownModel(f"unknown model {name!r}; this server has {sorted(self.models)}")
        return model
