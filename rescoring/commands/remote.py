"""``lm-rescore --server``: the rescoring job's LM scores from a running lm-serve instead of models loaded here.

The job asks its language models for one thing, per-token neural and n-gram scores of every hypothesis
(``rescoring.lmscores``), and ScoreSentences with ``per_token`` answers exactly that, through the served model's own
text normalisation and vocabulary. Features, tuning, reranking and reports then run here unchanged, and a weights file
tuned this way names the server and model it used.
"""

from __future__ import annotations

import grpc
import numpy as np
from tqdm import tqdm

from lmserve.rescoring.client import LMServeClient, normalisation_name, text_settings_json
from lmserve.rescoring.lmscores import HypothesisScores, load_or_compute, texts_fingerprint
from lmserve.rescoring.nbest import NBestList

SENTENCES_PER_CALL = 256  # halved while the server answers RESOURCE_EXHAUSTED (its max_sentences is lower)


class RemoteError(OSError):
    """The server could not be reached or refused a call; the message has its status code and details."""

    @classmethod
    def of(cls, target: str, error: grpc.RpcError) -> RemoteError:
        return cls(f"lm-serve at {target}: {error.code().name}: {error.details()}")


class RemoteLanguageModels:
    """Duck-types ``rescoring.rescore.LanguageModels`` (``available``, ``scores``, ``paths``, ``normalisation``) over
    one served model."""

    available = True

    def __init__(self, client: LMServeClient, model: str = ""):
        self.client = client
        try:
            self.info = client.model_info(model)  # an unknown model fails here, before any list is read
        except grpc.RpcError as error:
            raise RemoteError.of(client.target, error) from error
        self.model = self.info.name
        self.normalisation = normalisation_name(self.info.normalisation)
        self.per_call = SENTENCES_PER_CALL
        self.paths = {
            "server": client.target,
            "model": self.model,
            "lm": self.info.bundle,
            "ngram": self.info.ngram or None,
            "normalize": None,
        }

    def scores(self, nbest: NBestList, cache=None, progress: bool = False) -> list[list[HypothesisScores]]:
        return load_or_compute(cache, self.cache_key(nbest), nbest, lambda: self._compute(nbest, progress))

    def cache_key(self, nbest: NBestList) -> dict:
        return {
            "texts": texts_fingerprint(nbest),
            "server_model": self.model,
            "neural": self.info.fingerprint,  # the bundle's files, as the server loaded them
            "ngram": self.info.ngram or None,
            "normalizer": text_settings_json(self.info),
        }

    def _compute(self, nbest: NBestList, progress: bool) -> list[list[HypothesisScores]]:
        texts = [h.text for entry in nbest for h in entry.hypotheses]
        flat: list[HypothesisScores] = []
        with tqdm(total=len(texts), desc="LM scores (server)", unit="hyp", disable=not progress) as bar:
            while len(flat) < len(texts):
                chunk = texts[len(flat) : len(flat) + self.per_call]
                try:
                    response = self.client.score_sentences(chunk, self.model, per_token=True)
                except grpc.RpcError as error:
                    if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or len(chunk) == 1:
                        raise RemoteError.of(self.client.target, error) from error
                    self.per_call = len(chunk) // 2
                    continue
                flat.extend(_hypothesis_scores(s) for s in response.sentences)
                bar.update(len(chunk))
        out, start = [], 0
        for entry in nbest:
            out.append(flat[start : start + len(entry.hypotheses)])
            start += len(entry.hypotheses)
        return out


def _hypothesis_scores(sentence) -> HypothesisScores:
    return HypothesisScores(
        neural=np.array(sentence.neural.token_logprobs, dtype=np.float64),
        ngram=np.array(sentence.ngram.token_logprobs, dtype=np.float64) if sentence.HasField("ngram") else None,
        oov=sentence.oov,
        ngram_own=sentence.ngram_own if sentence.HasField("ngram_own") else None,
    )
