"""The leakage guard: n-word windows of references found in LM text, streamed; the command, and the automatic check
of ``tune``/``nbest`` against the training text a bundle's manifest names."""

import gzip
import json

import pytest
from conftest import make_sentences
from test_rescore import corrupted_lists

from lmserve.rescoring import overlap
from lmserve.rescoring.commands.cli import main as rescore_main
from lmserve.rescoring.nbest import write_nbest

REFS = [
    "the cat sat on the mat and then it slept for a while",  # 13 words: planted whole, across a line break
    "a completely different sentence that nobody ever wrote down anywhere",  # 10 words: absent
    "only the first eight words of this one are in the text",  # 12 words: first 8 planted
    "too short to count",  # 4 words: can never occur
]


def write_text(path, lines):
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return path


@pytest.fixture
def lm_text(tmp_path):
    filler = make_sentences(200, seed=7)
    lines = [
        *filler[:100],
        "THE CAT SAT ON THE MAT AND",  # case does not matter, and windows run across line ends
        "then it slept for a while",
        *filler[100:],
        "only the first eight words of this one",
        "too short to count",
    ]
    return write_text(tmp_path / "lm.txt.gz", lines)


def test_shares_offenders_and_where_they_were_found(lm_text):
    result = overlap.measure(REFS, [lm_text], ids=["a", "b", "c", "d"])
    assert result.references == 4 and result.short_references == 1
    assert result.matched_references == 2
    assert result.reference_words == 13 + 10 + 12 + 4
    assert result.covered_words == 13 + 8
    assert result.share_references == pytest.approx(0.5)
    assert [o.id for o in result.offenders] == ["a", "c"]  # fully covered first
    a, c = result.offenders
    assert (a.covered_words, a.words, a.windows_found) == (13, 13, 6)
    assert a.first_found == f"{lm_text}:101"
    assert (c.covered_words, c.windows_found) == (8, 1) and c.first_found == f"{lm_text}:203"
    assert result.text_words == sum(len(line.split()) for line in gzip.open(lm_text, "rt"))
    assert result.warning(0.4) and "50.0% of the references" in result.warning(0.4)
    assert result.warning(0.5) is None
    assert overlap.measure(REFS, [lm_text], n=14).matched_references == 0


def test_blocks_of_any_size_give_the_same_answer(lm_text, monkeypatch):
    whole = overlap.measure(REFS, [lm_text])
    monkeypatch.setattr(overlap, "_BLOCK_BYTES", 30)  # a block of one or two lines: windows cross block ends
    cut = overlap.measure(REFS, [lm_text])
    assert cut.matched_references == whole.matched_references and cut.covered_words == whole.covered_words
    assert [o.first_found for o in cut.offenders] == [o.first_found for o in whole.offenders]


def test_windows_do_not_run_across_files_and_bad_text_names_its_line(tmp_path):
    first = write_text(tmp_path / "a.txt", ["x the cat sat on the mat"])
    second = write_text(tmp_path / "b.txt", ["and then it slept for a while"])
    assert overlap.measure(REFS[:1], [first, second]).matched_references == 0
    assert (
        overlap.measure(
            REFS[:1], [write_text(tmp_path / "c.txt", ["the cat sat on the mat", "and then"])]
        ).covered_words
        == 8
    )
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"fine\nfine\n\xff\xfe broken\n")
    with pytest.raises(ValueError, match=r"bad.txt:3: not valid UTF-8"):
        overlap.measure(REFS, [bad])
    with pytest.raises(FileNotFoundError, match="no such LM text file"):
        overlap.measure(REFS, [tmp_path / "missing.txt"])


def test_training_texts_are_the_manifests_files_that_exist_unchanged(tmp_path):
    here = write_text(tmp_path / "train.txt", ["some text"])
    manifest = {
        "training": {
            "data": [
                {"path": str(here), "bytes": here.stat().st_size},
                {"path": str(tmp_path / "gone.txt"), "bytes": 3},
                {"path": str(here), "bytes": 1},  # the same path, another size: not the file it was trained on
            ]
        }
    }
    assert overlap.training_texts(manifest) == [here]
    assert overlap.training_texts({}) == []


def test_overlap_command_prints_warns_and_writes_json(lm_text, tmp_path, capsys):
    refs = write_text(tmp_path / "refs.txt", REFS)
    out = tmp_path / "overlap.json"
    args = ["overlap", "--text", str(lm_text), "--references", str(refs), "--json", str(out)]
    assert rescore_main([*args, "--threshold", "0.3"]) == 0
    captured = capsys.readouterr()
    assert "50.00% of 4 references" in captured.out and f"{refs}:1" in captured.out
    assert "possible test-set leak" in captured.err
    saved = json.loads(out.read_text())
    assert saved["matched_references"] == 2 and saved["warning"] and saved["offenders"][0]["id"] == f"{refs}:1"
    assert rescore_main([*args, "--threshold", "0.6"]) == 0
    assert "leak" not in capsys.readouterr().err
    assert rescore_main(["overlap", "--text", str(lm_text)]) == 2
    assert "give --list" in capsys.readouterr().err


def test_nbest_checks_the_bundles_training_text_and_reports_it(bundles, tmp_path, capsys):
    """The bundle fixture was trained on make_sentences(300, seed=1): lists built from those sentences leak."""
    bundle = bundles[("full", 0.0)][1]
    leaked, clean = tmp_path / "leaked.jsonl", tmp_path / "clean.jsonl"
    write_nbest(corrupted_lists(30, 1, "leaked"), leaked, "jsonl")
    write_nbest(corrupted_lists(30, 99, "clean"), clean, "jsonl")
    weights = tmp_path / "w.json"
    tune = ["tune", str(clean), "--lm", str(bundle), "--metric", "wer", "--features", "am,neural", "--restarts", "0"]
    assert rescore_main([*tune, "--out", str(weights), "--quiet"]) == 0
    assert "possible test-set leak" not in capsys.readouterr().err
    assert json.loads(weights.read_text())["overlap"]["warning"] is None
    report = tmp_path / "r.json"
    nbest = ["nbest", str(leaked), "--weights", str(weights), "--out", str(tmp_path / "o.jsonl"), "--quiet"]
    assert rescore_main([*nbest, "--report", str(report)]) == 0
    assert "possible test-set leak" in capsys.readouterr().err
    figure = json.loads(report.read_text())["overlap"]
    long_refs = figure["references"] - figure["short_references"]
    assert figure["matched_references"] == long_refs > 0 and figure["warning"]
    assert rescore_main([*nbest, "--report", str(report), "--no-overlap-check"]) == 0
    assert "overlap" not in json.loads(report.read_text())
