"""MT lists through every path of the engine and the server: a generated WMT folder of system outputs
(features votes and sys_*) and a fairseq-generate file, tuned on list features alone (consensus_*, src_ratio, rank,
chars: no LM), reranked by one ``lm-rescore nbest`` run and by ``--shard K/N`` runs joined with ``lm-rescore merge``
(the same list and report, byte for byte), and by a real lm-serve's ``RescoreKBest`` (the same choices and BLEU),
through the Python client and ``lm-serve client rescore --kbest``."""

import json
import random
from pathlib import Path

import grpc
import pytest
from conftest import running_lm_serve

from lmserve.rescoring.client import LMServeClient, hypothesis_list
from lmserve.rescoring.commands.cli import main as rescore_main
from lmserve.rescoring.nbest import read_nbest
from lmserve.server.cli import main as serve_main

PREFIX = "newstest.de-en"
WORDS = "the a cat dog sat ran on under mat house big small red old".split()
SYSTEMS = {"A": 0.6, "B": 0.15, "C": 0.2, "D": 0.3, "E": 0.5}  # each system's share of garbled words; A is ranked 1st
WMT_FEATURES = "consensus_chrf,consensus_bleu,votes,src_ratio"
FAIRSEQ_FEATURES = "score,consensus_chrf@score,consensus_wer,src_ratio,rank,chars"


def garbled(rng: random.Random, text: str, p: float) -> str:
    words = [w if rng.random() > p else rng.choice(WORDS) for w in text.split()]
    return " ".join(words[:-1] if rng.random() < p else words)


def references(rng: random.Random, n: int) -> tuple[list[str], list[str]]:
    """n reference sentences and their 'sources'; one source line is empty (src_ratio counts it as one word)."""
    refs, sources = [], []
    for i in range(n):
        k = rng.randint(4, 9)
        refs.append(" ".join(rng.choice(WORDS) for _ in range(k)))
        sources.append("" if i == 5 else " ".join(f"s{rng.randint(0, 9)}" for _ in range(k)))
    return refs, sources


def lines(texts) -> str:
    return "".join(t + "\n" for t in texts)


def wmt_folder(root: Path, n: int = 16, seed: int = 3) -> Path:
    rng = random.Random(seed)
    refs, sources = references(rng, n)
    folder = root / PREFIX
    folder.mkdir(parents=True)
    (folder / f"{PREFIX}.src.de").write_text(lines(sources))
    (folder / f"{PREFIX}.ref.A.en").write_text(lines(refs))
    for system, p in SYSTEMS.items():
        (folder / f"{PREFIX}.hyp.{system}.en").write_text(lines(garbled(rng, r, p) for r in refs))
    return folder


def fairseq_file(path: Path, n: int = 14, k: int = 4, seed: int = 5) -> Path:
    """fairseq-generate output: log lines, sentences printed out of order, S/T/H/D/P lines, a noisy score."""
    rng = random.Random(seed)
    refs, sources = references(rng, n)
    out = ["2024-05-02 10:11:12 | INFO | fairseq_cli.generate | loading model(s) from checkpoint_best.pt"]
    for i in rng.sample(range(n), n):
        out += [f"S-{i}\t{sources[i]}", f"T-{i}\t{refs[i]}"]
        hyps = sorted((-rng.random() * 2 - p, garbled(rng, refs[i], p)) for p in (0.1, 0.3, 0.5, 0.7)[:k])[::-1]
        for score, text in hyps:
            out += [f"H-{i}\t{score}\t{text}", f"D-{i}\t{score}\t{text}", f"P-{i}\t" + " ".join(["-0.5"] * 3)]
    out.append("Generate test with beam=4: BLEU4 = 40.00, 70.0/50.0/30.0/20.0 (BP=1.000, ratio=1.000)")
    path.write_text(lines(out))
    return path


def tune_and_rerank(tmp_path: Path, listed: Path, features: str) -> dict:
    """tune on the list (no LM); one nbest run; two shard runs and merge: the same list and report."""
    weights = tmp_path / "w.json"
    tune = ["tune", str(listed), "--metric", "bleu", "--features", features, "--restarts", "1", "--quiet"]
    assert rescore_main([*tune, "--out", str(weights)]) == 0
    nbest = ["nbest", str(listed), "--weights", str(weights), "--quiet"]
    one, report, html = tmp_path / "one.jsonl", tmp_path / "one.json", tmp_path / "one.html"
    assert rescore_main([*nbest, "--out", str(one), "--report", str(report), "--html", str(html)]) == 0
    shards = []
    for k in (1, 2):
        out, rep = tmp_path / f"s{k}.jsonl", tmp_path / f"s{k}.json"
        assert rescore_main([*nbest, "--shard", f"{k}/2", "--out", str(out), "--report", str(rep)]) == 0
        shards.append(str(rep))
    merged, merged_report = tmp_path / "merged.jsonl", tmp_path / "merged.json"
    assert rescore_main(["merge", *shards, "--out", str(merged), "--report", str(merged_report)]) == 0
    assert merged.read_bytes() == one.read_bytes()
    assert json.loads(merged_report.read_text()) == json.loads(report.read_text())
    assert html.stat().st_size > 0 and not list(tmp_path.glob("*.lmscores.jsonl"))  # no LM: no score cache
    rep = json.loads(report.read_text())
    assert rep["rescored"]["bleu"] > rep["1best"]["bleu"] + 10  # the list features do rerank
    chosen = [e.hypotheses[0].text for e in read_nbest(one)]
    return {"weights": weights, "report": rep, "chosen": chosen, "ranked": read_nbest(one)}


def test_wmt_folder_tune_nbest_shards_and_merge(tmp_path):
    folder = wmt_folder(tmp_path / "wmt")
    result = tune_and_rerank(tmp_path, folder, WMT_FEATURES)
    entry = result["ranked"].entries[5]
    assert entry.source == "" and {"votes", "sys_A", "consensus_chrf", "src_ratio"} <= set(entry.hypotheses[0].features)
    assert entry.hypotheses[0].features["src_ratio"] == len(entry.hypotheses[0].text.split())  # an empty source: 1


def test_fairseq_tune_nbest_shards_and_merge(tmp_path):
    path = fairseq_file(tmp_path / "generate-test.txt")
    result = tune_and_rerank(tmp_path, path, FAIRSEQ_FEATURES)
    assert [e.id for e in result["ranked"]] == [str(i) for i in range(14)]


# -- the same weights through lm-serve's RescoreKBest ----------------------------------------------------------


@pytest.fixture(scope="module")
def mt_lists(tmp_path_factory):
    """Both lists, tuned and reranked offline; their weights files are the server's profiles."""
    made = {}
    for name, make, features in (
        ("wmt", lambda root: wmt_folder(root / "wmt"), WMT_FEATURES),
        ("fairseq", lambda root: fairseq_file(root / "generate-test.txt"), FAIRSEQ_FEATURES),
    ):
        root = tmp_path_factory.mktemp(name)
        listed = make(root)
        made[name] = {"list": listed, **tune_and_rerank(root, listed, features)}
    return made


@pytest.fixture(scope="module")
def server(bundles, mt_lists, tmp_path_factory):
    """``lm-serve serve`` on a free port with the tiny bundle (a model is required) and the two weights files, which
    use no LM feature, as profiles."""
    root = tmp_path_factory.mktemp("mt-serve")
    profiles = "".join(f'{name} = "{made["weights"]}"\n' for name, made in mt_lists.items())
    config = (
        "[server]\nworkers = 1\nmetrics_port = 0\n\n"
        f'[models.tiny]\nbundle = "{bundles[("full", 0.0)][1]}"\n[models.tiny.profiles]\n{profiles}'
    )
    with running_lm_serve(root, config) as server:
        yield server.address


@pytest.mark.parametrize("name", ["wmt", "fairseq"])
def test_rescore_kbest_chooses_as_lm_rescore_nbest(server, mt_lists, name, tmp_path, capsys):
    made = mt_lists[name]
    nbest = read_nbest(made["list"])
    weights = json.loads(made["weights"].read_text())["weights"]
    with LMServeClient(server, timeout=30) as client:
        for combination in ({"profile": name}, {"weights": weights}):
            result = client.rescore_kbest(nbest.entries, "tiny", **combination)
            assert [ranked.hypotheses[0].text for ranked in result.lists] == made["chosen"], combination
            assert result.evaluation.metric == "bleu"
            assert result.evaluation.rescored == pytest.approx(made["report"]["rescored"]["bleu"])
            assert result.evaluation.first_pass == pytest.approx(made["report"]["1best"]["bleu"])
    offline = {e.id: e.hypotheses for e in made["ranked"]}
    for ranked in result.lists:  # every feature, the list features included, and the combined score as offline
        for got, want in zip(ranked.hypotheses, offline[ranked.id], strict=True):
            assert got.text == want.text and got.score == pytest.approx(want.features["rescore"])
            for feature in weights:
                assert got.features[feature] == pytest.approx(want.features[feature]), feature

    # a list whose ranks are not its order (lm-rescore nbest's output: reranked, each with its first-pass rank):
    # the feature rank is the rank the list says, on the wire as in lm-rescore, not the position
    with LMServeClient(server, timeout=30) as client:
        again = client.rescore_kbest(made["ranked"].entries, "tiny", profile=name)
        bad = hypothesis_list(made["ranked"].entries[0])
        bad.hypotheses[1].rank = 0
        with pytest.raises(grpc.RpcError) as info:
            client.rescore_kbest([bad], "tiny", profile=name)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "lists[0].hypotheses[1].rank = 0: expected a 1-based rank" in info.value.details()
    for ranked, entry in zip(again.lists, made["ranked"], strict=True):
        assert [(h.text, h.original_rank, h.features.get("rank")) for h in ranked.hypotheses] == [
            (h.text, h.rank, float(h.rank) if "rank" in weights else None) for h in entry.hypotheses
        ]

    out = tmp_path / "served.jsonl"
    inline = ",".join(f"{k}={v!r}" for k, v in weights.items())
    command = ["client", "--server", server, "rescore", str(made["list"]), "--kbest", "--model", "tiny"]
    assert serve_main([*command, "--weights", inline, "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["evaluation"]["rescored"] == pytest.approx(made["report"]["rescored"]["bleu"])
    assert [e.hypotheses[0].text for e in read_nbest(out)] == made["chosen"]
