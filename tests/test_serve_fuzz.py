"""Fuzzed requests against lm-serve: no crash, and every answer's status code one its kind of request may get.

Our own generator (it needs no hypothesis strategies for protobuf messages): each request is drawn from a family of
malformed or odd input with the status codes it may get. Families: empty lists and strings, huge requests (too many
sentences, words, lists, candidates, bytes), invalid UTF-8 and random bytes instead of a message, NaN and infinite
weights and features, unknown models, profiles and features, broken feature definitions, λ out of range, wrong
decoder state tokens (random, cut, bit-flipped, from another model's bundle fingerprint), bad candidates, and valid
requests with random Unicode text (control characters, emoji, right-to-left, very long words), which must be
answered. Requests go out from 4 concurrent callers to a server with a tiny bundle, its 3-gram and a tuned weights
profile, whose scoring runs in processes or in threads (``server.engine``); afterwards the server is still SERVING,
logged no error and no traceback, and stops cleanly.
"""

import asyncio
import random
from collections import Counter
from collections.abc import Callable

import grpc
import numpy as np
import pytest
from conftest import make_sentences, running_lm_serve

from lmserve.rescoring.client import LMServeClient, hypothesis_list
from lmserve.rescoring.nbest import Hypothesis, NBestEntry, NBestList
from lmserve.rescoring.ngram import build_ngram
from lmserve.rescoring.rescore import LanguageModels, Setup, setup_record, tune
from lmserve.rescoring.tune import write_weights
from lmserve.v1 import lmserve_pb2 as pb

pytestmark = pytest.mark.slow  # a server process and a thousand calls

REQUESTS = 600

OK, INVALID, EXHAUSTED, NOT_FOUND = "OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "NOT_FOUND"
LIMITS = {
    "max_sentences": 100,
    "max_words": 200,
    "max_lists": 50,
    "max_candidates": 100,
    "max_message_bytes": 1 << 20,
}
MODEL, PROFILE = "fuzzed", "dev"
ODD_TEXT = [
    "",
    " ",
    "\t\n",
    "\x00\x01\x7f",
    "naïve café",
    "日本語のテキスト",
    "שלום עולם",
    "🙂🙃 👍🏽",
    "a\u200bb\u200dc",
    "x" * 5000,
    "<s> </s> <unk>",
    "IT'S THE 1990S -- WELL...",
    "\ud7ff\ue000\ufffd",
]


class Fuzzer:
    """Draws ``(family, method, request bytes, expected codes)``."""

    def __init__(self, rng: random.Random, lists: list[pb.HypothesisList], state: bytes, vocab: list[str]):
        self.rng = rng
        self.lists = lists
        self.state = state
        self.vocab = vocab
        self.families: dict[str, Callable[[], tuple[str, bytes, set[str]]]] = {
            name.removeprefix("f_"): getattr(self, name) for name in dir(self) if name.startswith("f_")
        }

    def draw(self) -> tuple[str, str, bytes, set[str]]:
        family = self.rng.choice(sorted(self.families))
        return (family, *self.families[family]())

    # -- helpers -------------------------------------------------------------------------------------------------

    def text(self, words: int | None = None) -> str:
        if words is None:
            words = self.rng.randint(0, 40)
        parts = []
        for _ in range(words):
            kind = self.rng.random()
            if kind < 0.6:
                parts.append(self.rng.choice(self.vocab))
            elif kind < 0.8:
                parts.append(self.rng.choice(ODD_TEXT).strip() or "x")
            else:
                parts.append("".join(chr(self.rng.choice([self.rng.randint(32, 0x2FFF), 0x1F600])) for _ in range(5)))
        return " ".join(parts)

    def token(self) -> str:
        """One token as a decoder sends it: no whitespace, not <s> (a sentence starts from the empty state)."""
        words = self.text(1).split()
        return words[0] if words and words[0] != "<s>" else "x"

    def nbest(
        self, weights: dict | None = None, lists: list | None = None, profile: str = PROFILE, **fields
    ) -> pb.RescoreNBestRequest:
        request = pb.RescoreNBestRequest(model=MODEL, **fields)
        request.lists.extend(lists if lists is not None else self.rng.sample(self.lists, self.rng.randint(1, 3)))
        if weights is None:
            request.combination.profile = profile
        else:
            request.combination.weights.update(weights)
        return request

    def sentences(self, sentences: list[str], model: str = MODEL) -> bytes:
        return pb.ScoreSentencesRequest(model=model, sentences=sentences).SerializeToString()

    def step(self, state: bytes, candidates: list[str], **fields) -> bytes:
        return pb.ScoreNextWordsRequest(model=MODEL, state=state, candidates=candidates, **fields).SerializeToString()

    # -- families ------------------------------------------------------------------------------------------------

    def f_valid_odd_text(self):
        sentences = [self.text() for _ in range(self.rng.randint(1, 20))]
        return "ScoreSentences", self.sentences(sentences), {OK}

    def f_empty(self):
        return self.rng.choice(
            [
                ("ScoreSentences", self.sentences([]), {INVALID}),
                ("ScoreSentences", self.sentences([""]), {OK}),
                ("RescoreNBest", self.nbest(lists=[]).SerializeToString(), {INVALID}),
                ("RescoreNBest", self.nbest(lists=[pb.HypothesisList(id="e")]).SerializeToString(), {INVALID}),
                ("ScoreNextWords", self.step(b"", []), {INVALID}),
                ("ScoreSentences", b"", {INVALID}),
            ]
        )

    def f_huge(self):
        word = self.rng.choice(self.vocab)
        return self.rng.choice(
            [
                ("ScoreSentences", self.sentences([word] * (LIMITS["max_sentences"] + 1)), {EXHAUSTED}),
                ("ScoreSentences", self.sentences([" ".join([word] * self.rng.randint(LIMITS["max_words"] + 1, 5000))]), {EXHAUSTED}),
                ("ScoreSentences", self.sentences(["x" * (LIMITS["max_message_bytes"] + 1)]), {EXHAUSTED}),
                ("RescoreNBest", self.nbest(lists=self.lists[:1] * (LIMITS["max_lists"] + 1)).SerializeToString(),
                 {EXHAUSTED}),
                ("ScoreNextWords", self.step(b"", [word] * (LIMITS["max_candidates"] + 1)), {EXHAUSTED}),
                ("ScoreNextWords", self.step(b"", [], top_k=LIMITS["max_candidates"] + 1), {EXHAUSTED}),
                ("RescoreNBest", self.nbest({"score": 1.0}, bootstrap_samples=10**6).SerializeToString(), {EXHAUSTED}),
            ]
        )  # fmt: skip

    def f_invalid_utf8(self):
        junk = bytes(self.rng.choice([0xFF, 0xFE, 0xC0, 0x80, 0xED]) for _ in range(self.rng.randint(1, 8)))
        text = b"w" + junk
        field = bytes([0x12, len(text)]) + text  # field 2 (sentences / lists / state ...) as a string
        model = bytes([0x0A, len(text)]) + text  # field 1 (model)
        method = self.rng.choice(["ScoreSentences", "GetModelInfo", "ScoreNextWords"])
        return method, self.rng.choice([field, model]) if method == "ScoreSentences" else model, {INVALID}

    def f_random_bytes(self):
        method = self.rng.choice(["ScoreSentences", "RescoreNBest", "ScoreNextWords", "GetModelInfo", "ListModels"])
        data = self.rng.randbytes(self.rng.randint(1, 300))
        return method, data, {OK, INVALID, EXHAUSTED, NOT_FOUND}  # random bytes may even parse: anything but a crash

    def f_nan_weights(self):
        value = self.rng.choice([float("nan"), float("inf"), float("-inf")])
        name = self.rng.choice(["score", "neural", "ngram", "length"])
        return "RescoreNBest", self.nbest({"score": 1.0, name: value}).SerializeToString(), {INVALID}

    def f_nan_features(self):
        lists = [pb.HypothesisList() for _ in range(1)]
        lists[0].CopyFrom(self.rng.choice(self.lists))
        lists[0].hypotheses[self.rng.randrange(len(lists[0].hypotheses))].features["score"] = float("nan")
        return "RescoreNBest", self.nbest(lists=lists).SerializeToString(), {INVALID}

    def f_unknown_names(self):
        return self.rng.choice(
            [
                ("ScoreSentences", self.sentences(["w1"], model=self.text(2) or "x"), {NOT_FOUND}),
                ("GetModelInfo", pb.GetModelInfoRequest(model="nope").SerializeToString(), {NOT_FOUND}),
                ("RescoreNBest", self.nbest(profile="no_such_profile").SerializeToString(), {NOT_FOUND}),
                ("RescoreNBest", self.nbest({"score": 1.0, "acoustic": 1.0}).SerializeToString(), {INVALID}),
            ]
        )  # fmt: skip

    def f_bad_definitions(self):
        definition = self.rng.choice(
            ["x=", "=2*score", "x=2*", "x=2*score+", "x=score*score", "x=nan*score", "score=1*score"]
        )
        request = self.nbest({"score": 1.0, "x": 1.0})
        request.combination.definitions.append(definition)
        return "RescoreNBest", request.SerializeToString(), {INVALID}  # fmt: skip

    def f_lambda_out_of_range(self):
        request = self.nbest({"score": 1.0, "interp": 0.1})
        request.combination.interpolation_weight = self.rng.choice([1.0, 1.5, -0.5, float("nan")])
        return "RescoreNBest", request.SerializeToString(), {INVALID}

    def f_wrong_state(self):
        state = self.state
        token = self.rng.choice(
            [
                self.rng.randbytes(self.rng.randint(1, 200)),
                state[: self.rng.randrange(1, len(state))],
                bytearray(state),
                state[:1] + bytes(8) + state[9:],  # another bundle's fingerprint
            ]
        )
        if isinstance(token, bytearray):
            token[self.rng.randrange(len(token))] ^= 1 << self.rng.randrange(8)
            token = bytes(token)
        return "ScoreNextWords", self.step(token, [self.rng.choice(self.vocab)]), {INVALID}

    def f_bad_candidates(self):
        candidate = self.rng.choice(["", " ", "two words", "<s>", " THE", "THE\n"])
        return "ScoreNextWords", self.step(self.state, [candidate]), {INVALID}

    def f_valid_steps(self):
        candidates = [self.rng.choice(self.vocab) for _ in range(self.rng.randint(1, 8))] + [self.token()]
        return "ScoreNextWords", self.step(self.rng.choice([b"", self.state]), candidates), {OK}

    def f_valid_lists(self):
        lists = [pb.HypothesisList() for _ in range(2)]
        for target, source in zip(lists, self.rng.sample(self.lists, 2), strict=True):  # (ids are unique in a call)
            target.CopyFrom(source)
            target.hypotheses[0].text = self.text()
        weights = self.rng.choice([None, {"score": 1.0, "neural": self.rng.uniform(-1, 1), "length": -1.0}])
        return "RescoreNBest", self.nbest(weights, lists=lists).SerializeToString(), {OK}


async def fire(address: str, fuzzer: Fuzzer, count: int, callers: int) -> list[tuple[str, str, set[str]]]:
    """``count`` fuzzed calls from ``callers`` concurrent callers; (family, code, expected) of each."""
    results = []
    async with grpc.aio.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:

        async def caller() -> None:
            while len(results) < count:
                family, method, data, expected = fuzzer.draw()
                call = channel.unary_unary(f"/lmserve.v1.LMService/{method}")
                try:
                    await call(data, timeout=60)
                    code = OK
                except grpc.aio.AioRpcError as e:
                    code = e.code().name
                results.append((family, code, expected))

        await asyncio.gather(*(caller() for _ in range(callers)))
    return results


def scored_lists(n: int, seed: int) -> NBestList:
    """Each reference and 3 copies with one word replaced, under a noisy first-pass ``score``."""
    rng = np.random.default_rng(seed)
    entries = []
    for i, ref in enumerate(make_sentences(n, seed=seed)):
        texts = [ref]
        for _ in range(3):
            words = ref.split()
            words[int(rng.integers(len(words)))] = f"w{int(rng.integers(20, 40))}"
            texts.append(" ".join(words))
        entries.append(NBestEntry(f"u{i}", [Hypothesis(t, {"score": float(rng.normal())}) for t in texts], [ref]))
    return NBestList(entries, f"lists{seed}")


@pytest.fixture(scope="module")
def served(bundles, tmp_path_factory):
    """A config with the tiny full-softmax bundle, a 3-gram on its training text, λ and a weights profile."""
    root = tmp_path_factory.mktemp("fuzz")
    build_ngram((s.split() for s in make_sentences(300, seed=1)), 3, root / "train3", discount_fallback=True)
    bundle = bundles[("full", 0.0)][1]
    models = LanguageModels.load(bundle, root / "train3.bin", threads=1)
    dev = scored_lists(20, 11)
    setup = Setup.parse("score,neural,ngram,interp,length")
    tuned = tune(dev, setup, models.scores(dev), "wer", "score", (0.4,), restarts=1)
    write_weights(root / "dev.weights.json", tuned.result, setup_record(models, tuned.setup))
    limits = "".join(f"{k} = {v}\n" for k, v in LIMITS.items())
    model = f'[models.{MODEL}]\nbundle = "{bundle}"\nngram = "train3.bin"\nlambda = 0.4\n'
    profiles = f'[models.{MODEL}.profiles]\n{PROFILE} = "dev.weights.json"\n'
    return root, f"[limits]\n{limits}\n{model}{profiles}", scored_lists(40, 12)


@pytest.mark.parametrize("engine", ["processes", "threads"])
def test_fuzzed_requests_get_their_codes_and_the_server_stays_up(served, engine):
    root, models, nbest = served
    lists = [hypothesis_list(e) for e in nbest.entries]
    for message in lists:
        del message.references[:]
    vocab = sorted({w for e in nbest.entries for w in e.references[0].split()})
    config = f'[server]\nworkers = 2\nengine = "{engine}"\n\n{models}'
    with running_lm_serve(root, config, log=f"{engine}.log") as server:
        with LMServeClient(server.address, timeout=60) as client:
            state = client.score_next_words([vocab[0]], model=MODEL).words[0].state
            fuzzer = Fuzzer(random.Random(0), lists, state, vocab)
            results = asyncio.run(fire(server.address, fuzzer, REQUESTS, 4))
            assert client.health() == "SERVING" and server.proc.poll() is None
        raw = [r["message"] for r in server.records if r.get("level") == "raw"]
    unexpected = Counter(f"{family}: {code}" for family, code, expected in results if code not in expected)
    assert not unexpected, unexpected
    assert not raw, raw[:5]  # a traceback outside the JSON log
    assert len({family for family, _, _ in results}) == len(fuzzer.families)  # every family drawn
