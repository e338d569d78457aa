"""Batch rescoring over many machines, end to end on generated lists with a real bundle, a real KenLM 3-gram and real
lm-serve processes on free loopback ports: ``nbest --shard K/N`` then ``merge`` writes one run's list byte for byte
and its report figure for figure; merge refuses what is not one run's shards; ``nbest --server A,B --concurrency C``
writes the offline list byte for byte, goes round a target that is down or goes away, and fails clearly at its
deadline when none answers."""

import json
import shutil
import socket
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import make_sentences
from test_rescore import corrupted_lists

from lmserve.rescoring.commands.cli import main as rescore_main
from lmserve.rescoring.commands.fleet import Fleet, FleetLanguageModels
from lmserve.rescoring.nbest import NBestList, read_nbest, write_nbest
from lmserve.rescoring.ngram import build_ngram
from lmserve.rescoring.rescore import report, report_from_stats, setup_from_record, utterance_stats
from lmserve.rescoring.tune import read_weights
from lmserve.server.process import ServerProcess


@pytest.fixture(scope="module")
def job(bundles, tmp_path_factory):
    """A test list of 30 utterances and a weights file of ``tune`` (am, neural, interp at λ 0.4, length) with
    weights that change choices (whatever the short search found), so that the ranking itself is compared."""
    root = tmp_path_factory.mktemp("job")
    build_ngram((s.split() for s in make_sentences(300, seed=1)), 3, root / "lm3", discount_fallback=True)
    bundle, ngram = bundles[("full", 0.0)][1], root / "lm3.bin"
    dev, test = root / "dev.jsonl", root / "test.jsonl"
    write_nbest(corrupted_lists(40, 41, "dev"), dev, "jsonl")
    write_nbest(corrupted_lists(30, 42, "test"), test, "jsonl")
    weights = root / "dev.weights.json"
    tune = ["tune", str(dev), "--lm", str(bundle), "--ngram", str(ngram), "--threads", "1", "--quiet"]
    tune += ["--metric", "wer", "--features", "am,neural,interp,length", "--fixed", "am", "--lambdas", "0.4"]
    assert rescore_main([*tune, "--restarts", "0", "--out", str(weights)]) == 0
    record = json.loads(weights.read_text())
    record["weights"] = {"am": 1.0, "neural": 0.5, "interp": 0.5, "length": 0.5}
    weights.write_text(json.dumps(record))
    return SimpleNamespace(root=root, test=test, weights=weights, bundle=bundle, ngram=ngram)


def nbest(job, folder: Path, *flags: str) -> int:
    """``lm-rescore nbest`` of the test list into ``folder``/out.jsonl and report.json."""
    folder.mkdir(parents=True, exist_ok=True)
    out = ["--out", str(folder / "out.jsonl"), "--report", str(folder / "report.json")]
    return rescore_main(
        ["nbest", str(job.test), "--weights", str(job.weights), *out, "--threads", "1", "--quiet", *flags]
    )


def figures(folder: Path) -> dict:
    """A report without what depends on the run's time (the leakage check's seconds)."""
    rep = json.loads((folder / "report.json").read_text())
    for key in ("seconds", "seconds_per_million_words"):
        rep.get("overlap", {}).pop(key, None)
    return rep


@pytest.fixture(scope="module")
def offline(job, tmp_path_factory):
    folder = tmp_path_factory.mktemp("offline")
    assert nbest(job, folder) == 0
    return folder


def free_port() -> int:
    """A loopback port nothing listens on (a replica that is down)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- shards and merge --------------------------------------------------------------------------------------------


def test_a_report_is_the_report_of_its_parts_summed():
    """Every figure of a report (WER counts, BLEU, oracle, changed choices, the bootstrap) from per-utterance
    statistics: two parts' statistics, concatenated, give the whole list's report exactly."""
    rng = np.random.default_rng(3)
    for metric in ("wer", "bleu"):
        lists = corrupted_lists(25, 7, "x")
        if metric == "bleu":
            for entry in lists:
                entry.references = [entry.references[0], entry.references[0] + " w1"]
        chosen = rng.integers(0, 5, size=len(lists))
        parts = [(NBestList(lists.entries[a:b], "x"), chosen[a:b]) for a, b in ((0, 9), (9, 25))]
        stats = np.concatenate([utterance_stats(part, picked, metric) for part, picked in parts])
        whole = report(lists, chosen, metric)
        assert report_from_stats("x", metric, stats, len(lists.entries[0].references)) == whole
        assert whole["changed_choices"] == int(np.count_nonzero(chosen))


def test_shards_merged_are_one_run_byte_for_byte(job, offline, tmp_path, capsys):
    reports = []
    for k in (1, 2, 3):
        assert nbest(job, tmp_path / f"s{k}", "--shard", f"{k}/3") == 0
        assert f"shard {k}/3: entries {(k - 1) * 10 + 1} to {k * 10} of 30" in capsys.readouterr().out
        reports.append(tmp_path / f"s{k}" / "report.json")
    merged = tmp_path / "merged"
    args = ["merge", *map(str, reversed(reports)), "--out", str(merged / "out.jsonl")]
    assert rescore_main([*args, "--report", str(merged / "report.json")]) == 0
    assert (merged / "out.jsonl").read_bytes() == (offline / "out.jsonl").read_bytes()
    whole, joined = figures(offline), figures(merged)
    assert joined == whole and list(joined) == list(whole)
    assert whole["overlap"]["references"] == 30  # the leakage check ran (the bundle's training text is here)
    assert whole["changed_choices"] > 0
    assert "rescored" in capsys.readouterr().out
    shard = json.loads(reports[1].read_text())["shard"]
    assert (shard["start"], shard["stop"], shard["output"]["path"]) == (10, 20, "out.jsonl")
    assert shard["identity"]["list"]["path"] == str(job.test) and len(shard["stats"]) == 10


def test_merge_refuses_what_is_not_one_runs_shards(job, tmp_path, capsys):
    for k in (1, 2):
        assert nbest(job, tmp_path / f"s{k}", "--shard", f"{k}/2") == 0
    assert nbest(job, tmp_path / "other", "--shard", "2/2", "--max-words", "150") == 0
    shutil.copytree(tmp_path / "s2", tmp_path / "cut")
    out = (tmp_path / "cut" / "out.jsonl").read_bytes()
    (tmp_path / "cut" / "out.jsonl").write_bytes(out[: len(out) // 2])
    (tmp_path / "broken.json").write_text('{"list": ')
    s1, s2 = (str(tmp_path / f"s{k}" / "report.json") for k in (1, 2))
    capsys.readouterr()
    for reports, message in (
        ([s1], "shard 2/2 missing (given: 1/2)"),
        ([s1, s2, s1], "shard 1/2 given twice"),
        ([s1, str(tmp_path / "other" / "report.json")], "field 'shard.identity.options.max_words' differs"),
        ([s1, str(tmp_path / "cut" / "report.json")], "truncated or written over since; run that shard again"),
        ([s1, str(tmp_path / "broken.json")], "not a JSON report"),
        ([s1, str(tmp_path / "nope.json")], "nope.json"),
    ):
        assert rescore_main(["merge", *reports, "--out", str(tmp_path / "m.jsonl")]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "m.jsonl").exists()
    whole = tmp_path / "whole"
    assert nbest(job, whole) == 0
    assert rescore_main(["merge", str(whole / "report.json"), "--out", str(tmp_path / "m.jsonl")]) == 2
    assert "no field 'shard': not the report of a shard" in capsys.readouterr().err
    for flags, message in (
        (["--shard", "0/3"], "--shard '0/3': expected K/N with 1 <= K <= N"),
        (["--shard", "4/3"], "expected K/N"),
        (["--shard", "two"], "expected K/N"),
        (["--shard", "31/31"], "31 shards for the 30 entries"),
    ):
        assert nbest(job, tmp_path / "bad", *flags) == 2
        assert message in capsys.readouterr().err
    args = ["nbest", str(job.test), "--weights", str(job.weights), "--out", str(tmp_path / "x.jsonl")]
    with pytest.raises(SystemExit):  # refused at parse time (command.parse_args)
        rescore_main([*args, "--shard", "1/3"])
    assert "--shard without --report" in capsys.readouterr().err


def test_tune_shards_score_into_the_cache_of_one_run(job, tmp_path, capsys):
    """``tune --shard K/N`` scores one range into a cache; ``merge --caches`` writes the cache one tune run writes,
    byte for byte, and tune reads it instead of running the models (the cache is not written again)."""
    tune = ["tune", str(job.root / "dev.jsonl"), "--lm", str(job.bundle), "--ngram", str(job.ngram), "--quiet"]
    tune += ["--threads", "1", "--metric", "wer", "--features", "am,neural,interp,length", "--fixed", "am"]
    tune += ["--lambdas", "0.4", "--restarts", "0"]
    whole, merged = tmp_path / "whole.lmscores.jsonl", tmp_path / "merged.lmscores.jsonl"
    assert rescore_main([*tune, "--out", str(tmp_path / "whole.json"), "--cache", str(whole)]) == 0
    caches = []
    for k in (1, 2):
        assert rescore_main([*tune, "--shard", f"{k}/2", "--out", str(tmp_path / "unused.json")]) == 0
        caches.append(str(tmp_path / f"dev.shard-{k}-of-2.lmscores.jsonl"))
    assert not (tmp_path / "unused.json").exists()
    capsys.readouterr()
    assert rescore_main(["merge", "--caches", caches[0], "--cache", str(merged)]) == 2
    assert "shard 2/2 missing" in capsys.readouterr().err
    assert rescore_main(["merge", "--caches", *reversed(caches), "--cache", str(merged)]) == 0
    assert merged.read_bytes() == whole.read_bytes()
    written = merged.stat().st_mtime_ns
    assert rescore_main([*tune, "--out", str(tmp_path / "merged.json"), "--cache", str(merged)]) == 0
    assert merged.stat().st_mtime_ns == written  # read, not computed again
    assert read_weights(tmp_path / "merged.json")["weights"] == read_weights(tmp_path / "whole.json")["weights"]
    lines = Path(caches[1]).read_text().splitlines()
    Path(caches[1]).write_text("\n".join(lines[:-1]) + "\n")
    capsys.readouterr()
    assert rescore_main(["merge", "--caches", *caches, "--cache", str(merged)]) == 2
    assert "truncated; run that shard again" in capsys.readouterr().err


# -- a fleet of lm-serve replicas --------------------------------------------------------------------------------


def serve_config(job, folder: Path) -> Path:
    config = folder / "serve.toml"
    config.write_text(f'[server]\nworkers = 1\n\n[models.m]\nbundle = "{job.bundle}"\nngram = "{job.ngram}"\n')
    return config


@pytest.fixture(scope="module")
def replicas(job, tmp_path_factory):
    folder = tmp_path_factory.mktemp("replicas")
    config = serve_config(job, folder)
    with ServerProcess(config, folder / "a.log") as a, ServerProcess(config, folder / "b.log") as b:
        yield [a, b]


def rescore_calls(server: ServerProcess) -> int:
    return sum(r.get("message") == "call" and r.get("method") == "RescoreNBest" for r in server.records)


def test_a_fleet_rescores_as_the_offline_run(job, offline, replicas, tmp_path):
    before = [rescore_calls(s) for s in replicas]
    targets = ",".join(f"127.0.0.1:{s.port}" for s in replicas)
    assert nbest(job, tmp_path, "--server", targets, "--concurrency", "4", "--lists-per-call", "2") == 0
    assert (tmp_path / "out.jsonl").read_bytes() == (offline / "out.jsonl").read_bytes()
    remote, local = figures(tmp_path), figures(offline)
    for key in ("utterances", "hypotheses", "changed_choices", "1best", "rescored", "oracle", "bootstrap", "weights"):
        assert remote[key] == local[key]
    assert remote["setup"]["server"] == targets and remote["setup"]["model"] == "m"
    calls = [rescore_calls(s) - b for s, b in zip(replicas, before, strict=True)]
    assert sum(calls) == 15 and min(calls) > 0  # 30 lists, 2 a call, over both replicas


def test_a_target_that_is_down_is_gone_round(job, offline, replicas, tmp_path):
    targets = f"127.0.0.1:{free_port()},127.0.0.1:{replicas[0].port}"
    assert nbest(job, tmp_path, "--server", targets, "--concurrency", "3") == 0
    assert (tmp_path / "out.jsonl").read_bytes() == (offline / "out.jsonl").read_bytes()


def test_calls_to_a_replica_that_went_away_go_to_another(job, replicas, tmp_path):
    """A replica that answered GetModelInfo and then stops: its calls get UNAVAILABLE and are sent again, to the
    replica that is left; the results are complete and the same."""
    lists = read_nbest(job.test)
    setup = setup_from_record(read_weights(job.weights))
    with ServerProcess(serve_config(job, tmp_path), tmp_path / "c.log") as leaving:
        fleet = Fleet([f"127.0.0.1:{leaving.port}", f"127.0.0.1:{replicas[0].port}"], concurrency=4, deadline=30)
        models = FleetLanguageModels(fleet, setup)
        want = models.scores(lists)
        deadline = time.monotonic() + 30
        while fleet.targets[0].state != "serving":  # until the replica that will go away has answered too
            assert time.monotonic() < deadline
            models.scores(NBestList(lists.entries[:1]))
    got = models.scores(lists)  # it has stopped
    fleet.close()
    assert fleet.targets[0].failures >= 1 and "UNAVAILABLE" in fleet.targets[0].last_error
    for a, b in zip(want, got, strict=True):
        np.testing.assert_array_equal(a.neural, b.neural)
        np.testing.assert_array_equal(a.interp, b.interp)


def test_no_target_up_fails_at_the_deadline(job, tmp_path, capsys):
    dead = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    start = time.monotonic()
    assert nbest(job, tmp_path, "--server", ",".join(dead), "--deadline", "1") == 2
    assert time.monotonic() - start < 10
    err = capsys.readouterr().err
    assert "no lm-serve target answered within --deadline 1 s" in err
    assert all(f"{d}: UNAVAILABLE" in err for d in dead)
    assert not (tmp_path / "out.jsonl").exists()
    for flags, message in ((["--concurrency", "0"], "--concurrency 0"), (["--deadline", "0"], "--deadline 0")):
        assert nbest(job, tmp_path, "--server", dead[0], *flags) == 2
        assert message in capsys.readouterr().err
