from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Normalisation(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NORMALISATION_UNSPECIFIED: _ClassVar[Normalisation]
    NORMALISATION_EXACT: _ClassVar[Normalisation]
    NORMALISATION_SELF_NORMALISED: _ClassVar[Normalisation]
    NORMALISATION_UNNORMALISED: _ClassVar[Normalisation]
NORMALISATION_UNSPECIFIED: Normalisation
NORMALISATION_EXACT: Normalisation
NORMALISATION_SELF_NORMALISED: Normalisation
NORMALISATION_UNNORMALISED: Normalisation

class ScoreSentencesRequest(_message.Message):
    __slots__ = ("model", "sentences", "per_token")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SENTENCES_FIELD_NUMBER: _ClassVar[int]
    PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    model: str
    sentences: _containers.RepeatedScalarFieldContainer[str]
    per_token: bool
    def __init__(self, model: _Optional[str] = ..., sentences: _Optional[_Iterable[str]] = ..., per_token: _Optional[bool] = ...) -> None: ...

class ScoreSentencesResponse(_message.Message):
    __slots__ = ("model", "normalisation", "sentences")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NORMALISATION_FIELD_NUMBER: _ClassVar[int]
    SENTENCES_FIELD_NUMBER: _ClassVar[int]
    model: str
    normalisation: Normalisation
    sentences: _containers.RepeatedCompositeFieldContainer[SentenceScore]
    def __init__(self, model: _Optional[str] = ..., normalisation: _Optional[_Union[Normalisation, str]] = ..., sentences: _Optional[_Iterable[_Union[SentenceScore, _Mapping]]] = ...) -> None: ...

class Score(_message.Message):
    __slots__ = ("logprob", "log10prob", "token_logprobs", "token_log10probs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    LOG10PROB_FIELD_NUMBER: _ClassVar[int]
    TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_LOG10PROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    log10prob: float
    token_logprobs: _containers.RepeatedScalarFieldContainer[float]
    token_log10probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprob: _Optional[float] = ..., log10prob: _Optional[float] = ..., token_logprobs: _Optional[_Iterable[float]] = ..., token_log10probs: _Optional[_Iterable[float]] = ...) -> None: ...

class SentenceScore(_message.Message):
    __slots__ = ("neural", "ngram", "interpolated", "oov", "tokens", "ngram_own")
    NEURAL_FIELD_NUMBER: _ClassVar[int]
    NGRAM_FIELD_NUMBER: _ClassVar[int]
    INTERPOLATED_FIELD_NUMBER: _ClassVar[int]
    OOV_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    NGRAM_OWN_FIELD_NUMBER: _ClassVar[int]
    neural: Score
    ngram: Score
    interpolated: Score
    oov: int
    tokens: _containers.RepeatedScalarFieldContainer[str]
    ngram_own: float
    def __init__(self, neural: _Optional[_Union[Score, _Mapping]] = ..., ngram: _Optional[_Union[Score, _Mapping]] = ..., interpolated: _Optional[_Union[Score, _Mapping]] = ..., oov: _Optional[int] = ..., tokens: _Optional[_Iterable[str]] = ..., ngram_own: _Optional[float] = ...) -> None: ...

class Hypothesis(_message.Message):
    __slots__ = ("text", "features", "rank")
    class FeaturesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    text: str
    features: _containers.ScalarMap[str, float]
    rank: int
    def __init__(self, text: _Optional[str] = ..., features: _Optional[_Mapping[str, float]] = ..., rank: _Optional[int] = ...) -> None: ...

class HypothesisList(_message.Message):
    __slots__ = ("id", "hypotheses", "references", "source", "context")
    ID_FIELD_NUMBER: _ClassVar[int]
    HYPOTHESES_FIELD_NUMBER: _ClassVar[int]
    REFERENCES_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    id: str
    hypotheses: _containers.RepeatedCompositeFieldContainer[Hypothesis]
    references: _containers.RepeatedScalarFieldContainer[str]
    source: str
    context: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, id: _Optional[str] = ..., hypotheses: _Optional[_Iterable[_Union[Hypothesis, _Mapping]]] = ..., references: _Optional[_Iterable[str]] = ..., source: _Optional[str] = ..., context: _Optional[_Iterable[str]] = ...) -> None: ...

class Combination(_message.Message):
    __slots__ = ("profile", "weights", "definitions", "interpolation_weight")
    class WeightsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    DEFINITIONS_FIELD_NUMBER: _ClassVar[int]
    INTERPOLATION_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    profile: str
    weights: _containers.ScalarMap[str, float]
    definitions: _containers.RepeatedScalarFieldContainer[str]
    interpolation_weight: float
    def __init__(self, profile: _Optional[str] = ..., weights: _Optional[_Mapping[str, float]] = ..., definitions: _Optional[_Iterable[str]] = ..., interpolation_weight: _Optional[float] = ...) -> None: ...

class RescoreNBestRequest(_message.Message):
    __slots__ = ("model", "combination", "lists", "bootstrap_samples")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    COMBINATION_FIELD_NUMBER: _ClassVar[int]
    LISTS_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    model: str
    combination: Combination
    lists: _containers.RepeatedCompositeFieldContainer[HypothesisList]
    bootstrap_samples: int
    def __init__(self, model: _Optional[str] = ..., combination: _Optional[_Union[Combination, _Mapping]] = ..., lists: _Optional[_Iterable[_Union[HypothesisList, _Mapping]]] = ..., bootstrap_samples: _Optional[int] = ...) -> None: ...

class RescoreNBestResponse(_message.Message):
    __slots__ = ("result",)
    RESULT_FIELD_NUMBER: _ClassVar[int]
    result: Rescored
    def __init__(self, result: _Optional[_Union[Rescored, _Mapping]] = ...) -> None: ...

class RescoreKBestRequest(_message.Message):
    __slots__ = ("model", "combination", "lists", "bootstrap_samples")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    COMBINATION_FIELD_NUMBER: _ClassVar[int]
    LISTS_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    model: str
    combination: Combination
    lists: _containers.RepeatedCompositeFieldContainer[HypothesisList]
    bootstrap_samples: int
    def __init__(self, model: _Optional[str] = ..., combination: _Optional[_Union[Combination, _Mapping]] = ..., lists: _Optional[_Iterable[_Union[HypothesisList, _Mapping]]] = ..., bootstrap_samples: _Optional[int] = ...) -> None: ...

class RescoreKBestResponse(_message.Message):
    __slots__ = ("result",)
    RESULT_FIELD_NUMBER: _ClassVar[int]
    result: Rescored
    def __init__(self, result: _Optional[_Union[Rescored, _Mapping]] = ...) -> None: ...

class Rescored(_message.Message):
    __slots__ = ("model", "profile", "weights", "interpolation_weight", "lists", "evaluation")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    INTERPOLATION_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    LISTS_FIELD_NUMBER: _ClassVar[int]
    EVALUATION_FIELD_NUMBER: _ClassVar[int]
    model: str
    profile: str
    weights: _containers.RepeatedCompositeFieldContainer[FeatureWeight]
    interpolation_weight: float
    lists: _containers.RepeatedCompositeFieldContainer[RankedList]
    evaluation: Evaluation
    def __init__(self, model: _Optional[str] = ..., profile: _Optional[str] = ..., weights: _Optional[_Iterable[_Union[FeatureWeight, _Mapping]]] = ..., interpolation_weight: _Optional[float] = ..., lists: _Optional[_Iterable[_Union[RankedList, _Mapping]]] = ..., evaluation: _Optional[_Union[Evaluation, _Mapping]] = ...) -> None: ...

class FeatureWeight(_message.Message):
    __slots__ = ("feature", "weight")
    FEATURE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    feature: str
    weight: float
    def __init__(self, feature: _Optional[str] = ..., weight: _Optional[float] = ...) -> None: ...

class RankedList(_message.Message):
    __slots__ = ("id", "hypotheses")
    ID_FIELD_NUMBER: _ClassVar[int]
    HYPOTHESES_FIELD_NUMBER: _ClassVar[int]
    id: str
    hypotheses: _containers.RepeatedCompositeFieldContainer[RankedHypothesis]
    def __init__(self, id: _Optional[str] = ..., hypotheses: _Optional[_Iterable[_Union[RankedHypothesis, _Mapping]]] = ...) -> None: ...

class RankedHypothesis(_message.Message):
    __slots__ = ("text", "features", "score", "original_rank")
    class FeaturesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    ORIGINAL_RANK_FIELD_NUMBER: _ClassVar[int]
    text: str
    features: _containers.ScalarMap[str, float]
    score: float
    original_rank: int
    def __init__(self, text: _Optional[str] = ..., features: _Optional[_Mapping[str, float]] = ..., score: _Optional[float] = ..., original_rank: _Optional[int] = ...) -> None: ...

class Evaluation(_message.Message):
    __slots__ = ("metric", "first_pass", "rescored", "oracle", "changed_choices", "bootstrap_delta", "bootstrap_p_value", "signature", "report_json")
    METRIC_FIELD_NUMBER: _ClassVar[int]
    FIRST_PASS_FIELD_NUMBER: _ClassVar[int]
    RESCORED_FIELD_NUMBER: _ClassVar[int]
    ORACLE_FIELD_NUMBER: _ClassVar[int]
    CHANGED_CHOICES_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_DELTA_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_P_VALUE_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    REPORT_JSON_FIELD_NUMBER: _ClassVar[int]
    metric: str
    first_pass: float
    rescored: float
    oracle: float
    changed_choices: int
    bootstrap_delta: float
    bootstrap_p_value: float
    signature: str
    report_json: str
    def __init__(self, metric: _Optional[str] = ..., first_pass: _Optional[float] = ..., rescored: _Optional[float] = ..., oracle: _Optional[float] = ..., changed_choices: _Optional[int] = ..., bootstrap_delta: _Optional[float] = ..., bootstrap_p_value: _Optional[float] = ..., signature: _Optional[str] = ..., report_json: _Optional[str] = ...) -> None: ...

class ScoreNextWordsRequest(_message.Message):
    __slots__ = ("model", "state", "candidates", "top_k", "all_words")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    ALL_WORDS_FIELD_NUMBER: _ClassVar[int]
    model: str
    state: bytes
    candidates: _containers.RepeatedScalarFieldContainer[str]
    top_k: int
    all_words: bool
    def __init__(self, model: _Optional[str] = ..., state: _Optional[bytes] = ..., candidates: _Optional[_Iterable[str]] = ..., top_k: _Optional[int] = ..., all_words: _Optional[bool] = ...) -> None: ...

class ScoreNextWordsResponse(_message.Message):
    __slots__ = ("model", "normalisation", "words")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NORMALISATION_FIELD_NUMBER: _ClassVar[int]
    WORDS_FIELD_NUMBER: _ClassVar[int]
    model: str
    normalisation: Normalisation
    words: _containers.RepeatedCompositeFieldContainer[NextWord]
    def __init__(self, model: _Optional[str] = ..., normalisation: _Optional[_Union[Normalisation, str]] = ..., words: _Optional[_Iterable[_Union[NextWord, _Mapping]]] = ...) -> None: ...

class NextWord(_message.Message):
    __slots__ = ("word", "logprob", "neural", "ngram", "interpolated", "oov", "state", "state_id")
    WORD_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    NEURAL_FIELD_NUMBER: _ClassVar[int]
    NGRAM_FIELD_NUMBER: _ClassVar[int]
    INTERPOLATED_FIELD_NUMBER: _ClassVar[int]
    OOV_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STATE_ID_FIELD_NUMBER: _ClassVar[int]
    word: str
    logprob: float
    neural: float
    ngram: float
    interpolated: float
    oov: bool
    state: bytes
    state_id: str
    def __init__(self, word: _Optional[str] = ..., logprob: _Optional[float] = ..., neural: _Optional[float] = ..., ngram: _Optional[float] = ..., interpolated: _Optional[float] = ..., oov: _Optional[bool] = ..., state: _Optional[bytes] = ..., state_id: _Optional[str] = ...) -> None: ...

class ScoreNextWordsBatchRequest(_message.Message):
    __slots__ = ("model", "items", "cache_states", "scores_only", "release_state_ids")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    CACHE_STATES_FIELD_NUMBER: _ClassVar[int]
    SCORES_ONLY_FIELD_NUMBER: _ClassVar[int]
    RELEASE_STATE_IDS_FIELD_NUMBER: _ClassVar[int]
    model: str
    items: _containers.RepeatedCompositeFieldContainer[NextWordsItem]
    cache_states: bool
    scores_only: bool
    release_state_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model: _Optional[str] = ..., items: _Optional[_Iterable[_Union[NextWordsItem, _Mapping]]] = ..., cache_states: _Optional[bool] = ..., scores_only: _Optional[bool] = ..., release_state_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class NextWordsItem(_message.Message):
    __slots__ = ("state", "state_id", "candidates")
    STATE_FIELD_NUMBER: _ClassVar[int]
    STATE_ID_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    state: bytes
    state_id: str
    candidates: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, state: _Optional[bytes] = ..., state_id: _Optional[str] = ..., candidates: _Optional[_Iterable[str]] = ...) -> None: ...

class ScoreNextWordsBatchResponse(_message.Message):
    __slots__ = ("model", "normalisation", "items")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NORMALISATION_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    model: str
    normalisation: Normalisation
    items: _containers.RepeatedCompositeFieldContainer[NextWords]
    def __init__(self, model: _Optional[str] = ..., normalisation: _Optional[_Union[Normalisation, str]] = ..., items: _Optional[_Iterable[_Union[NextWords, _Mapping]]] = ...) -> None: ...

class NextWords(_message.Message):
    __slots__ = ("words",)
    WORDS_FIELD_NUMBER: _ClassVar[int]
    words: _containers.RepeatedCompositeFieldContainer[NextWord]
    def __init__(self, words: _Optional[_Iterable[_Union[NextWord, _Mapping]]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models", "default_model", "generation")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MODEL_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    default_model: str
    generation: int
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ..., default_model: _Optional[str] = ..., generation: _Optional[int] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: ModelInfo
    def __init__(self, model: _Optional[_Union[ModelInfo, _Mapping]] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "bundle", "fingerprint", "head", "normalisation", "vocab_size", "layers", "hidden_size", "heldout_perplexity", "logz_mean", "logz_std", "ngram", "ngram_order", "normalisation_settings_json", "interpolation_weight", "profiles", "manifest_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    HEAD_FIELD_NUMBER: _ClassVar[int]
    NORMALISATION_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    HELDOUT_PERPLEXITY_FIELD_NUMBER: _ClassVar[int]
    LOGZ_MEAN_FIELD_NUMBER: _ClassVar[int]
    LOGZ_STD_FIELD_NUMBER: _ClassVar[int]
    NGRAM_FIELD_NUMBER: _ClassVar[int]
    NGRAM_ORDER_FIELD_NUMBER: _ClassVar[int]
    NORMALISATION_SETTINGS_JSON_FIELD_NUMBER: _ClassVar[int]
    INTERPOLATION_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    PROFILES_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    bundle: str
    fingerprint: str
    head: str
    normalisation: Normalisation
    vocab_size: int
    layers: int
    hidden_size: int
    heldout_perplexity: float
    logz_mean: float
    logz_std: float
    ngram: str
    ngram_order: int
    normalisation_settings_json: str
    interpolation_weight: float
    profiles: _containers.RepeatedCompositeFieldContainer[Profile]
    manifest_json: str
    def __init__(self, name: _Optional[str] = ..., bundle: _Optional[str] = ..., fingerprint: _Optional[str] = ..., head: _Optional[str] = ..., normalisation: _Optional[_Union[Normalisation, str]] = ..., vocab_size: _Optional[int] = ..., layers: _Optional[int] = ..., hidden_size: _Optional[int] = ..., heldout_perplexity: _Optional[float] = ..., logz_mean: _Optional[float] = ..., logz_std: _Optional[float] = ..., ngram: _Optional[str] = ..., ngram_order: _Optional[int] = ..., normalisation_settings_json: _Optional[str] = ..., interpolation_weight: _Optional[float] = ..., profiles: _Optional[_Iterable[_Union[Profile, _Mapping]]] = ..., manifest_json: _Optional[str] = ...) -> None: ...

class Profile(_message.Message):
    __slots__ = ("name", "weights", "definitions", "interpolation_weight", "metric", "dev_set", "dev_metric")
    NAME_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    DEFINITIONS_FIELD_NUMBER: _ClassVar[int]
    INTERPOLATION_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    METRIC_FIELD_NUMBER: _ClassVar[int]
    DEV_SET_FIELD_NUMBER: _ClassVar[int]
    DEV_METRIC_FIELD_NUMBER: _ClassVar[int]
    name: str
    weights: _containers.RepeatedCompositeFieldContainer[FeatureWeight]
    definitions: _containers.RepeatedScalarFieldContainer[str]
    interpolation_weight: float
    metric: str
    dev_set: str
    dev_metric: float
    def __init__(self, name: _Optional[str] = ..., weights: _Optional[_Iterable[_Union[FeatureWeight, _Mapping]]] = ..., definitions: _Optional[_Iterable[str]] = ..., interpolation_weight: _Optional[float] = ..., metric: _Optional[str] = ..., dev_set: _Optional[str] = ..., dev_metric: _Optional[float] = ...) -> None: ...

class ReloadModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReloadModelsResponse(_message.Message):
    __slots__ = ("generation", "models", "default_model", "seconds")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MODEL_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    generation: int
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    default_model: str
    seconds: float
    def __init__(self, generation: _Optional[int] = ..., models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ..., default_model: _Optional[str] = ..., seconds: _Optional[float] = ...) -> None: ...
