"""Options that cannot be honoured together are refused at parse time (``core.command.parse_args``), before any
file is read (``nbest --report R --html H --no-metrics`` once wrote neither, exit 0, without a word). The paths
below do not exist: a command that read anything would fail with another message."""

import pytest

from lmserve.core.command import parse_args
from lmserve.rescoring.commands.cli import build_parser as rescore_parser
from lmserve.rescoring.commands.cli import main as rescore_main
from lmserve.server.cli import main as serve_main

NBEST = ["nbest", "missing.jsonl", "--weights", "missing.json", "--out", "o.jsonl"]
TUNE = ["tune", "missing.jsonl", "--metric", "wer", "--features", "am", "--out", "t.json"]
REFUSED = [
    (rescore_main, [*NBEST, "--no-metrics", "--html", "h.html"], "--html with --no-metrics"),
    (rescore_main, [*NBEST, "--no-metrics", "--report", "r.json"], "--report with --no-metrics"),
    (rescore_main, [*NBEST, "--shard", "1/2"], "--shard without --report"),
    (rescore_main, [*NBEST, "--shard", "1/2", "--report", "r.json", "--html", "h.html"], "--html with --shard"),
    (rescore_main, [*NBEST, "--source", "src.txt"], "--source src.txt without --systems"),
    (rescore_main, [*TUNE, "--shard", "1/2", "--cv", "5"], "--shard with --cv"),
    (rescore_main, [*TUNE, "--shard", "1/2", "--html", "h.html"], "--shard with --html"),
    (
        rescore_main,
        ["nbest", "--systems", "a.txt", "--format", "wmt", "--weights", "w.json", "--out", "o.jsonl"],
        "--format wmt with --systems",
    ),
    (
        serve_main,
        ["client", "rescore", "missing.jsonl", "--profile", "dev", "--weights", "am=1"],
        "--profile with --weights",
    ),
    (
        serve_main,
        ["client", "rescore", "missing.jsonl", "--profile", "dev", "--lambda", "0.5"],
        "--profile with --lambda",
    ),
]


@pytest.mark.parametrize(("main", "argv", "message"), REFUSED, ids=[m for _, _, m in REFUSED])
def test_options_that_cannot_be_honoured_together_are_refused_at_parse_time(
    main, argv, message, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert f"error: {message}" in err and "missing" not in err.split("error:")[1], err
    assert not list(tmp_path.iterdir())  # nothing written


def test_a_shard_report_without_metrics_is_still_one_run_of_many():
    args = parse_args(rescore_parser(), [*NBEST, "--no-metrics", "--shard", "1/2", "--report", "r.json"])
    assert args.no_metrics and args.shard == "1/2"
