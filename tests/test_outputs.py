"""Outputs checked against each other and against every input before any work (``core.outputs``; once
``nbest in.jsonl --out in.jsonl`` replaced its input, ``--out x --report x`` lost the reranked list, ``merge --out``
could overwrite a shard's output). For every command that writes, each pair of paths that may clash
(tests/output_clashes.py): the command ends with an error naming both flags, and no file is written, changed or
removed."""

import os

import pytest
from output_clashes import CASES, run_case, snapshot, write_inputs

from lmserve.core.outputs import OutputClash, check_outputs


@pytest.mark.parametrize("case", list(CASES))
def test_a_clash_is_an_error_naming_both_flags_and_nothing_is_written(tmp_path, case):
    argv, first, second = CASES[case]
    write_inputs(tmp_path)
    before = snapshot(tmp_path)
    code, err = run_case(argv, tmp_path)
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    message = err.split("error: ", 1)[1]
    assert first in message and second in message, err
    assert snapshot(tmp_path) == before  # the inputs untouched, no output begun


def test_the_helper_compares_resolved_paths_links_and_folders(tmp_path):
    (tmp_path / "in").mkdir()
    data = tmp_path / "in" / "data.jsonl"
    data.write_text("x\n")
    (tmp_path / "link.jsonl").symlink_to(data)
    (tmp_path / "link").symlink_to(tmp_path / "in")
    os.link(data, tmp_path / "hard.jsonl")
    for out, read in [("link.jsonl", data), ("hard.jsonl", data), ("in/../in/data.jsonl", data), ("in", data)]:
        with pytest.raises(OutputClash, match=r"--out .* LIST .*which this command reads"):
            check_outputs({"--out": tmp_path / out}, {"LIST": read}, folders={"--out"} if out == "in" else ())
    with pytest.raises(OutputClash, match=r"--out .*new\.jsonl is inside LIST .*in, which this command reads"):
        check_outputs({"--out": tmp_path / "link" / "new.jsonl"}, {"LIST": tmp_path / "in"})  # (through a link)
    check_outputs({"--out": tmp_path / "in" / "new.jsonl"}, {"LIST": data})  # beside an input file: fine
    with pytest.raises(OutputClash, match=r"--out .*o holds --report .*r\.json: each output needs a path of its own"):
        check_outputs({"--out": tmp_path / "o", "--report": tmp_path / "o" / "r.json"}, folders={"--out"})
    with pytest.raises(OutputClash, match=r"--a .*is the same path as --b"):
        check_outputs({"--a": [tmp_path / "x", tmp_path / "y"], "--b": tmp_path / "y"})
    check_outputs(  # apart: fine, and what is not given (None, "-") is no path
        {"--out": tmp_path / "o.jsonl", "--report": tmp_path / "o.report.json", "--html": None},
        {"LIST": [data, "-"], "--references": None},
    )
