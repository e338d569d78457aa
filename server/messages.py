"""Translation between the wire messages (``lmserve.v1``) and the engine's objects (``rescoring``) for the servicer;
the client's side of it lives with the client (``rescoring.client``). Validation that needs the whole request lives in
``server.service``."""

from __future__ import annotations

import json
import math

import numpy as np

from lmserve.rescoring.client import NORMALISATIONS
from lmserve.rescoring.interpolated import NextWord, TokenScores
from lmserve.rescoring.nbest import Hypothesis, NBestEntry
from lmserve.rescoring.rescore import RESCORE_FEATURE, Setup
from lmserve.rescoring.scorer import LN10
from lmserve.server.errors import invalid
from lmserve.server.models import Profile, ServedModel
from lmserve.v1 import lmserve_pb2 as pb

EOS_TOKEN = "</s>"


def normalisation(model: ServedModel) -> int:
    """The bundle's measured label (``core.bundle``) as the wire enum."""
    return NORMALISATIONS[model.lm.scorer.normalisation]


# -- ScoreSentences ---------------------------------------------------------------------------------------------


def score(token_logprobs: np.ndarray, per_token: bool) -> pb.Score:
    total = float(token_logprobs.sum())
    message = pb.Score(logprob=total, log10prob=total / LN10)
    if per_token:
        message.token_logprobs.extend(token_logprobs.tolist())
        message.token_log10probs.extend((token_logprobs / LN10).tolist())
    return message


def sentence_score(scores: TokenScores, per_token: bool) -> pb.SentenceScore:
    message = pb.SentenceScore(neural=score(scores.neural, per_token), oov=scores.oov)
    if scores.ngram is not None:
        message.ngram.CopyFrom(score(scores.ngram, per_token))
    if scores.interpolated is not None:
        message.interpolated.CopyFrom(score(scores.interpolated, per_token))
    if scores.ngram_own is not None:
        message.ngram_own = scores.ngram_own
    if per_token:
        message.tokens.extend([*scores.words, EOS_TOKEN])
    return message


# -- ScoreNextWords ---------------------------------------------------------------------------------------------


def add_next_word(add, word: NextWord) -> pb.NextWord:
    """``word`` added to a repeated NextWord field by the field's ``add``: made in place, since a message made first
    is copied into the field, state token and all (a beam step answers hundreds of words). None leaves a field
    unset."""
    return add(
        word=word.word,
        logprob=word.logprob,
        neural=word.neural,
        ngram=word.ngram,
        interpolated=word.interpolated,
        oov=word.oov,
        state=word.state,
    )


# -- RescoreNBest / RescoreKBest --------------------------------------------------------------------------------


def nbest_entry(message: pb.HypothesisList, where: str) -> NBestEntry:
    """A received list; every feature must be a finite number (a NaN would silently poison the ranking), a rank
    1-based."""
    hypotheses = []
    for k, h in enumerate(message.hypotheses):
        features = dict(h.features)  # (one read of the map: reading it is most of what this function costs)
        if not all(map(math.isfinite, features.values())):
            name, value = next((n, v) for n, v in features.items() if not math.isfinite(v))
            raise invalid(f"{where}.hypotheses[{k}].features[{name!r}] = {value}: expected a finite number")
        rank = h.rank if h.HasField("rank") else None  # None: its position (feature rank, original_rank)
        if rank is not None and rank < 1:
            raise invalid(f"{where}.hypotheses[{k}].rank = {rank}: expected a 1-based rank, or none")
        hypotheses.append(Hypothesis(h.text, features, rank))
    source = message.source if message.HasField("source") else None  # "" is a source (src_ratio: one word)
    return NBestEntry(message.id, hypotheses, list(message.references), source)


def ranked_list(entry: NBestEntry) -> pb.RankedList:
    """An entry of ``rescoring.rescore.reranked``: sorted, with every feature and the combined score. (Hypotheses are
    added in place: building each message first and handing the list over copies them, 1.7x the time.)"""
    message = pb.RankedList(id=entry.id)
    add = message.hypotheses.add
    for h in entry.hypotheses:
        add(text=h.text, features=h.features, score=h.features[RESCORE_FEATURE], original_rank=h.rank)
    return message


def feature_weights(setup: Setup) -> list[pb.FeatureWeight]:
    return [pb.FeatureWeight(feature=f, weight=setup.weights[f]) for f in setup.features]


def definition_text(name: str, terms: dict[str, float]) -> str:
    """``am=0.6*decoder+0.4*ctc``: the form ``rescoring.features.parse_definition`` reads."""
    parts = [f"{'-' if c < 0 else '+'}{abs(c):g}*{term}" for term, c in terms.items()]
    return f"{name}={''.join(parts).removeprefix('+')}"


def evaluation(report: dict) -> pb.Evaluation:
    """``rescoring.rescore.report`` as a message; the whole report rides along as JSON."""
    metric = report["metric"]
    bootstrap = report["bootstrap"]
    return pb.Evaluation(
        metric=metric,
        first_pass=report["1best"][metric],
        rescored=report["rescored"][metric],
        oracle=report["oracle"][metric],
        changed_choices=report["changed_choices"],
        bootstrap_delta=bootstrap["delta"],
        bootstrap_p_value=bootstrap["p_value"],
        signature=bootstrap["signature"],
        report_json=json.dumps(report, default=float),
    )


# -- ListModels / GetModelInfo ----------------------------------------------------------------------------------


def profile(p: Profile) -> pb.Profile:
    return pb.Profile(
        name=p.name,
        weights=feature_weights(p.setup),
        definitions=[definition_text(n, t) for n, t in p.setup.definitions.items()],
        interpolation_weight=p.setup.lam or 0.0,
        metric=p.record["metric"],
        dev_set=str(p.record["dev_set"]),
        dev_metric=float(p.record.get("dev_metric") or 0.0),
    )


def model_info(model: ServedModel, with_manifest: bool) -> pb.ModelInfo:
    scorer, ngram = model.lm.scorer, model.lm.ngram
    manifest = scorer.bundle.manifest
    heldout = manifest["heldout"]
    info = pb.ModelInfo(
        name=model.name,
        bundle=str(model.config.bundle),
        fingerprint=scorer.fingerprint,
        head=manifest["head"],
        normalisation=normalisation(model),
        vocab_size=len(scorer.bundle.tokens),
        layers=scorer.layers,
        hidden_size=scorer.state_size,
        heldout_perplexity=float(heldout.get("ppl") or 0.0),
        logz_mean=float(heldout.get("logz_mean") or 0.0),
        logz_std=float(heldout.get("logz_std") or 0.0),
        ngram="" if ngram is None else str(model.config.ngram),
        ngram_order=0 if ngram is None else ngram.order,
        normalisation_settings_json=json.dumps(scorer.normalizer.to_dict(), sort_keys=True),
        interpolation_weight=model.lm.lam or 0.0,
        profiles=[profile(p) for p in model.profiles.values()],
    )
    if with_manifest:
        info.manifest_json = json.dumps(manifest, sort_keys=True)
    return info
