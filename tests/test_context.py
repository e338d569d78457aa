"""Document context: a stream-trained bundle starts sentences with </s>, scores a document's utterances from the state
its earlier utterances left, and ``lm-rescore tune/nbest --context`` carry that state through lists."""

import json
import random

import grpc
import numpy as np
import pytest

from lmserve.core.bundle import Bundle
from lmserve.rescoring.client import LMServeClient
from lmserve.rescoring.commands.cli import main as rescore_main
from lmserve.rescoring.commands.shards import Shard
from lmserve.rescoring.context import document_keys, score_from_states, states_before
from lmserve.rescoring.nbest import Hypothesis, NBestEntry, NBestList, read_nbest
from lmserve.rescoring.scorer import EOS, Scorer
from lmserve.v1 import lmserve_pb2 as pb
from tests.conftest import fit_and_export, running_lm_serve, tiny_config_text, write_corpus

pytestmark = pytest.mark.slow  # trains a small stream model

TOPICS = [f"t{i}" for i in range(6)]


def topic_documents(n_docs: int, seed: int) -> list[list[str]]:
    """Documents whose sentences all start with the document's topic word: only the earlier sentences tell which."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n_docs):
        topic = rng.choice(TOPICS)
        docs.append([f"{topic} w{rng.randrange(4)}" for _ in range(rng.randint(4, 8))])
    return docs


@pytest.fixture(scope="module")
def stream_bundle(tmp_path_factory):
    root = tmp_path_factory.mktemp("context")
    corpus = {
        name: write_corpus(root / f"{name}.txt", [s for doc in topic_documents(n, seed) for s in doc])
        for name, n, seed in (("train", 300, 1), ("valid", 20, 2), ("test", 20, 3))
    }
    text = tiny_config_text(
        corpus,
        "stream",
        "full",
        model={"embedding_size": 24, "hidden_size": 32, "layers": 1, "dropout": 0.0},
        train={"epochs": 12, "batch_size": 8, "bptt": 12},
    )
    return fit_and_export(root, "stream", text)[1]


def test_a_stream_bundle_starts_sentences_with_the_end_of_the_one_before(stream_bundle):
    assert Bundle.load(stream_bundle).manifest["sentence_start"] == "</s>"
    assert Scorer(stream_bundle, threads=1).start_id == EOS


def test_scores_in_context_are_the_scores_of_the_document_read_as_one_stream(stream_bundle):
    """The sentences graph from the carried state gives what the step graph gives reading the whole document."""
    scorer = Scorer(stream_bundle, threads=1)
    doc = ["t3 w1", "t3 w0", "t3 w2"]
    h, c = states_before(scorer, [""] * len(doc), doc)
    in_context = score_from_states(scorer, [[s] for s in doc], h, c)
    h1, c1 = scorer.zero_state(1)
    prev = scorer.start_id
    for sentence, scored in zip(doc, in_context, strict=True):
        ids = [*scorer.encode(sentence)[1], EOS]
        stepped = []
        for token in ids:
            scores, h1, c1 = scorer.next_word_scores(np.array([prev]), h1, c1, np.array([[token]]))
            stepped.append(scores[0, 0])
            prev = token
        np.testing.assert_allclose(scored[0].token_logprobs, stepped, atol=1e-4)
    fresh = scorer.score([doc[-1]])[0].logprob
    assert in_context[-1][0].logprob != pytest.approx(fresh, abs=1e-3)  # the context changed the scores


def test_documents_by_id_and_by_order():
    entries = [NBestEntry(i, [Hypothesis("a")]) for i in ("84-121-0001", "84-121-0002", "85-7-0001")]
    assert document_keys(NBestList(entries), "id") == ["84-121", "84-121", "85-7"]
    assert document_keys(NBestList(entries), "order") == ["", "", ""]
    with pytest.raises(ValueError, match="no '-'"):
        document_keys(NBestList([NBestEntry("utt1", [Hypothesis("a")])]), "id")


def write_topic_list(path, docs: list[list[str]], seed: int) -> None:
    """JSONL lists whose 1-best names the wrong topic in every second utterance; the right one is second."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for d, doc in enumerate(docs):
            for u, sentence in enumerate(doc):
                words = sentence.split()
                wrong = " ".join([rng.choice([t for t in TOPICS if t != words[0]]), *words[1:]])
                hyps = [wrong, sentence] if u % 2 else [sentence, wrong]
                rows = [{"text": t, "features": {"score": -float(i)}} for i, t in enumerate(hyps)]
                f.write(json.dumps({"id": f"doc{d}-{u:03d}", "hypotheses": rows, "references": [sentence]}) + "\n")


def test_tune_and_nbest_carry_the_context_through_documents(stream_bundle, tmp_path, capsys):
    dev, test = tmp_path / "dev.jsonl", tmp_path / "test.jsonl"
    write_topic_list(dev, topic_documents(12, 5), 7)
    write_topic_list(test, topic_documents(12, 6), 8)
    for context, name in ((["--context", "id"], "ctx"), ([], "plain")):
        weights = tmp_path / f"{name}.weights.json"
        common = ["--features", "score,neural", "--fixed", "score"]
        assert (
            rescore_main(
                [
                    "tune",
                    str(dev),
                    "--metric",
                    "wer",
                    "--lm",
                    str(stream_bundle),
                    *common,
                    *context,
                    "--out",
                    str(weights),
                ]
            )
            == 0
        )
        assert (json.loads(weights.read_text())["setup"].get("context") == "id") == bool(context)
        report = tmp_path / f"{name}.report.json"
        assert (
            rescore_main(
                [
                    "nbest",
                    str(test),
                    "--weights",
                    str(weights),
                    "--out",
                    str(tmp_path / f"{name}.jsonl"),
                    "--report",
                    str(report),
                ]
            )
            == 0
        )
    capsys.readouterr()
    wer = {n: json.loads((tmp_path / f"{n}.report.json").read_text())["rescored"]["wer"] for n in ("ctx", "plain")}
    assert wer["ctx"] < wer["plain"], wer


def test_sharded_runs_in_context_cut_at_documents_and_merge_into_one_runs_list(stream_bundle, tmp_path, capsys):
    """Documents from a JSON Lines field; shards cut at their boundaries score exactly what one run scores."""
    listed, weights = tmp_path / "l.jsonl", tmp_path / "w.json"
    write_topic_list(listed, topic_documents(7, 4), 2)
    rows = [json.loads(line) for line in listed.read_text().splitlines()]
    listed.write_text("".join(json.dumps(r | {"document": r["id"].split("-")[0]}) + "\n" for r in rows))
    common = ["--features", "score,neural", "--fixed", "score", "--context", "document"]
    tune = ["tune", str(listed), "--metric", "wer", "--lm", str(stream_bundle), *common]
    assert rescore_main([*tune, "--out", str(weights)]) == 0
    assert rescore_main(["nbest", str(listed), "--weights", str(weights), "--out", str(tmp_path / "one.jsonl")]) == 0
    reports = []
    for k in (1, 2, 3):
        reports.append(tmp_path / f"r{k}.json")
        out = ["--out", str(tmp_path / f"s{k}.jsonl"), "--report", str(reports[-1])]
        assert rescore_main(["nbest", str(listed), "--weights", str(weights), "--shard", f"{k}/3", *out]) == 0
        shard = json.loads(reports[-1].read_text())["shard"]
        assert shard["start"] == 0 or rows[shard["start"]]["id"].endswith("-000")  # a document's first utterance
    assert rescore_main(["merge", *map(str, reports), "--out", str(tmp_path / "merged.jsonl")]) == 0
    assert (tmp_path / "merged.jsonl").read_bytes() == (tmp_path / "one.jsonl").read_bytes()
    assert '"document": "doc3"' in (tmp_path / "one.jsonl").read_text()
    capsys.readouterr()
    one_document = [*tune[:-2], "--context", "order", "--shard", "1/2", "--out", str(tmp_path / "c.json")]
    assert rescore_main(one_document) == 2  # the whole list is one document: it cannot be cut
    assert "1 documents cannot make 2 shards" in capsys.readouterr().err


def test_evaluate_with_context_measures_what_the_context_adds(stream_bundle, tmp_path, capsys):
    listed = tmp_path / "topics.jsonl"
    write_topic_list(listed, topic_documents(24, 9), 3)
    wer = {}
    for name, context in (("sentence", []), ("context", ["--context", "id"])):
        out = tmp_path / f"{name}.json"
        args = ["evaluate", str(listed), "--metric", "wer", "--features", "score,neural", "--fixed", "score"]
        assert rescore_main([*args, "--lm", str(stream_bundle), "--cv", "3", *context, "--out", str(out)]) == 0
        wer[name] = json.loads(out.read_text())["cross_validation"]["lists"]["topics"]["systems"]["recipe"]["wer"]
    capsys.readouterr()
    assert wer["context"] < wer["sentence"], wer


def test_shards_cut_at_the_document_start_nearest_to_an_even_cut():
    documents = ["a"] * 5 + ["b"] * 2 + ["c"] * 4 + ["d"]  # starts 0, 5, 7, 11 of 12
    assert [Shard(k, 3).at_documents(documents).bounds(12) for k in (1, 2, 3)] == [(0, 5), (5, 7), (7, 12)]
    assert Shard(2, 2).bounds(12) == (6, 12)  # without documents: anywhere
    with pytest.raises(ValueError, match="document 'a' is not contiguous"):
        Shard(1, 2).at_documents(["a", "b", "a"])
    with pytest.raises(ValueError, match="2 documents cannot make 3 shards"):
        Shard(1, 3).at_documents(["a", "a", "b"])


def test_documents_from_the_document_field(tmp_path):
    listed = tmp_path / "l.jsonl"
    rows = [
        {"id": "u1", "hypotheses": [{"text": "a"}], "document": "talk-1"},
        {"id": "u2", "hypotheses": [{"text": "b"}]},
    ]
    listed.write_text("".join(json.dumps(r) + "\n" for r in rows))
    nbest = read_nbest(listed)
    assert nbest.entries[0].document == "talk-1"
    with pytest.raises(ValueError, match=r"l\.jsonl:2: no field 'document'"):
        document_keys(nbest, "document")


def test_lm_serve_rescores_a_list_in_the_document_context_the_request_sends(stream_bundle, tmp_path):
    """RescoreNBest with ``context``: the list scored from the state its earlier utterances leave, as offline."""
    doc, wrong = ["t3 w1", "t3 w0", "t3 w2"], "t1 w2"
    scorer = Scorer(stream_bundle, threads=1)
    h, c = states_before(scorer, [""] * len(doc), doc)
    offline = score_from_states(scorer, [[wrong, doc[-1]]], h[:, -1:], c[:, -1:])[0]
    config = f'[server]\nworkers = 1\n\n[models.topics]\nbundle = "{stream_bundle}"\n'
    with running_lm_serve(tmp_path, config) as server:
        client = LMServeClient(server.address)
        hyps = [pb.Hypothesis(text=wrong), pb.Hypothesis(text=doc[-1])]
        in_context = pb.HypothesisList(id="u3", hypotheses=hyps, context=doc[:-1])
        alone = pb.HypothesisList(id="u0", hypotheses=hyps)
        result = client.rescore_nbest([in_context, alone], weights={"neural": 1.0})
        with pytest.raises(grpc.RpcError) as refused:
            client.rescore_nbest([pb.HypothesisList(id="u", hypotheses=hyps, context=["w"] * 1001)], weights={"x": 1})
    got = {h.text: h.features["neural"] for h in result.lists[0].hypotheses}
    for text, want in zip([wrong, doc[-1]], offline, strict=True):
        assert got[text] == pytest.approx(want.logprob, abs=1e-4)
    fresh = {h.text: h.features["neural"] for h in result.lists[1].hypotheses}
    assert fresh[doc[-1]] == pytest.approx(scorer.score([doc[-1]])[0].logprob, abs=1e-4)
    assert got[doc[-1]] - got[wrong] > fresh[doc[-1]] - fresh[wrong]  # the context told which topic
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "context sentences (all lists): 1001" in refused.value.details()
