"""lm-rescore with bad input offline: each case is one line on stderr naming the file, line or flag and what was
expected, exit 2, its inputs as they were and no output written; and input that used to be read wrong without a word
(a byte-order mark, a system's file that is a broken link, a third of the lists in another text form) is read right
or refused. ``lm-train fit --init-from`` with a bad checkpoint: tests/test_adapt.py; cost features in ``tune``:
tests/test_tune.py."""

import gzip
import json
import os
from pathlib import Path

import pytest
from conftest import make_sentences
from nbest_fuzz import content, seed_files

from lmserve.core.command import clip
from lmserve.core.lines import file_lines
from lmserve.core.textnorm import PRESETS
from lmserve.rescoring.commands.cli import main
from lmserve.rescoring.nbest import (
    FORMATS,
    Hypothesis,
    NBestEntry,
    NBestFormatError,
    NBestList,
    read_nbest,
    read_systems,
    write_nbest,
)
from lmserve.rescoring.ngram import NgramLM
from lmserve.rescoring.rescore import LanguageModels

BOM = "\ufeff".encode()


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (links as where they point): what a refused command must leave as it was."""
    return {
        str(p.relative_to(root)): os.readlink(p).encode() if p.is_symlink() else p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_symlink() or p.is_file()
    }


def refused(capsys, argv: list[str], root: Path, *expected: str) -> str:
    """``lm-rescore argv`` exits 2 with one line naming each of ``expected``, and leaves ``root`` as it was."""
    capsys.readouterr()
    before = snapshot(root)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("lm-rescore: error: "), err
    assert "Traceback" not in err and "internal error" not in err, err
    for text in expected:
        assert text in err, (text, err)
    assert snapshot(root) == before
    return err


def cut_gzip(path: Path, lines: list[str]) -> Path:
    """A gzipped text file cut short in the middle of its compressed stream."""
    data = gzip.compress(("\n".join(lines) + "\n").encode())
    path.write_bytes(data[: len(data) // 2])
    return path


# -- values of 16 KB are echoed clipped ------------------------------------------------------------------------------


def test_clip_shows_the_start_of_a_long_value_and_its_length():
    assert clip("u1") == "'u1'" and clip("u1", quote=False) == "u1" and clip(3.5) == "3.5"
    long = "x" * 16384
    assert clip(long) == f"{'x' * 80!r}... (16,384 chars)"
    assert clip(long, quote=False) == "x" * 80 + "... (16,384 chars)"
    assert clip(["y" * 500]).endswith("... (504 chars)") and len(clip(["y" * 500])) < 110


@pytest.mark.parametrize(
    "case",
    ["repeated id", "missing feature", "moses token", "kaldi key"],
)
def test_values_of_16_kb_are_clipped_in_errors(tmp_path, case):
    big = "u" * 16384
    if case == "repeated id":
        path = tmp_path / "l.jsonl"
        line = json.dumps({"id": big, "hypotheses": [{"text": "a", "features": {"am": 1}}]})
        path.write_text(line + "\n" + line + "\n")
    elif case == "missing feature":
        path = tmp_path / "l.jsonl"
        hyps = [{"text": "a", "features": {big: 1.0}}, {"text": "b", "features": {}}]
        path.write_text(json.dumps({"id": "u1", "hypotheses": hyps}) + "\n")
    elif case == "moses token":
        path = tmp_path / "l.nbest"
        path.write_text(f"0 ||| a b ||| lm: {big} ||| -1\n")
    else:
        path = tmp_path / "kaldi"
        path.mkdir()
        (path / "text").write_text(f"{big} a b\n")
        (path / "ac_cost").write_text(f"{big} 1.0\n")
    with pytest.raises(NBestFormatError) as error:
        read_nbest(path)
    message = str(error.value)
    assert "... (16,384 chars)" in message and len(message) < 600, message[:300]


def test_a_value_of_16_kb_is_clipped_in_a_commands_error_line(tmp_path, capsys):
    big = "u" * 16384
    path = tmp_path / "big.jsonl"
    path.write_text(
        "".join(json.dumps({"id": big, "hypotheses": [{"text": "a", "features": {}}]}) + "\n" for _ in "ab")
    )
    err = refused(capsys, ["references", str(path), "--out", str(tmp_path / "r.txt")], tmp_path, "(16,384 chars)")
    assert len(err) < 1000, err[:300]


# -- damaged .gz files -----------------------------------------------------------------------------------------------


def test_a_cut_or_fake_gz_is_an_error_naming_the_file_and_flag(tmp_path, capsys):
    lines = make_sentences(400, seed=1)
    cut = cut_gzip(tmp_path / "cut.txt.gz", lines)
    fake = tmp_path / "fake.txt.gz"
    fake.write_text("w1 w2\n")
    refs = tmp_path / "refs.txt"
    refs.write_text("\n".join(lines[:5]) + "\n")
    for text, problem in ((cut, "cut short"), (fake, "not gzip-compressed")):
        argv = ["ngram", "build", "--order", "2", "--text", str(text), "--out", str(tmp_path / "m")]
        refused(capsys, argv, tmp_path, f"--text {text}", problem)
        argv = ["overlap", "--text", str(text), "--references", str(refs), "--json", str(tmp_path / "o.json")]
        refused(capsys, argv, tmp_path, str(text), problem)
        argv = ["overlap", "--text", str(refs), "--references", str(text), "--json", str(tmp_path / "o.json")]
        refused(capsys, argv, tmp_path, str(text), problem)
    # a list's references cut short: the error names them, not the list
    nbest = tmp_path / "l.jsonl"
    write_nbest(
        NBestList([NBestEntry(f"u{i}", [Hypothesis(s, {"am": -1.0})]) for i, s in enumerate(lines)]), nbest, "jsonl"
    )
    with pytest.raises(NBestFormatError, match=r"cut\.txt\.gz: cut short"):
        read_nbest(nbest, references=cut)
    wmt = tmp_path / "wmt"
    wmt.mkdir()
    (wmt / "t.hyp.a.en").write_text("\n".join(lines) + "\n")
    cut_gzip(wmt / "t.hyp.b.en.gz", lines)
    refused(capsys, ["references", str(wmt), "--out", str(tmp_path / "r.txt")], tmp_path, "t.hyp.b.en.gz: cut short")


def test_text_lines_name_a_binary_file_and_strip_a_byte_order_mark(tmp_path):
    text = tmp_path / "t.txt"
    text.write_bytes(BOM + b"w1 w2\nw3\n")
    assert list(file_lines(text)) == ["w1 w2", "w3"]
    packed = tmp_path / "t.txt.gz"
    packed.write_bytes(gzip.compress(BOM + b"w1 w2\n"))
    assert list(file_lines(packed, "--heldout")) == ["w1 w2"]
    binary = tmp_path / "m.bin"
    binary.write_bytes(b"mmap lm http://kheafield.com/code format version 5\n\0\0\0\x01")
    with pytest.raises(ValueError, match=r"--heldout .*m\.bin:2: a NUL byte at byte 0: a binary file, not text"):
        list(file_lines(binary, "--heldout"))


# -- byte-order marks ------------------------------------------------------------------------------------------------


def systems_folder(root: Path, bom: bool) -> Path:
    """A WMT folder of three systems that agree on segment 0, and one reference that equals it."""
    folder = root / ("bom" if bom else "plain") / "t.zh-en"
    folder.mkdir(parents=True)
    outputs = {"a": ["the cat sat", "a dog ran"], "b": ["the cat sat", "the dog ran"], "c": ["the cat sat", "a dog"]}
    for name, lines in outputs.items():
        data = ("\n".join(lines) + "\n").encode()
        (folder / f"t.zh-en.hyp.{name}.en").write_bytes(BOM + data if bom and name == "b" else data)
    reference = b"the cat sat\nthe dog ran\n"
    (folder / "t.zh-en.ref.A.en").write_bytes(BOM + reference if bom else reference)
    return folder


def test_a_byte_order_mark_neither_splits_segment_0_nor_changes_a_reference(tmp_path):
    plain, marked = systems_folder(tmp_path, False), systems_folder(tmp_path, True)
    assert read_nbest(marked).entries == read_nbest(plain).entries
    first = read_nbest(marked).entries[0]
    assert len(first.hypotheses) == 1 and first.hypotheses[0].features["votes"] == 3
    assert first.references == ["the cat sat"]
    files = sorted(p for p in marked.iterdir() if ".hyp." in p.name)
    separate = read_systems(files, references=marked / "t.zh-en.ref.A.en")
    assert (
        separate.entries
        == read_systems(
            sorted(p for p in plain.iterdir() if ".hyp." in p.name), references=[plain / "t.zh-en.ref.A.en"]
        ).entries
    )
    # the BLEU of the systems' consensus against the reference is what it is without the mark
    reports = []
    for folder in (plain, marked):
        weights = folder.parent / "w.json"
        record = {"format": "lmserve-weights", "format_version": 2, "features": ["votes"], "weights": {"votes": 1.0}}
        weights.write_text(json.dumps(record | {"metric": "bleu", "dev_set": "-", "date": "-", "setup": {}}))
        argv = ["nbest", str(folder), "--weights", str(weights), "--out", str(folder.parent / "o.jsonl")]
        assert main([*argv, "--report", str(folder.parent / "r.json"), "--quiet", "--no-overlap-check"]) == 0
        reports.append(json.loads((folder.parent / "r.json").read_text())["rescored"]["bleu"])
    assert reports[0] == reports[1]


@pytest.mark.parametrize("where", ["list", "references"])
@pytest.mark.parametrize("format", FORMATS)
def test_a_byte_order_mark_in_any_format_reads_as_the_same_list(tmp_path, format, where):
    """A mark before the text of each of a list's files, or of its references file: the list it is without."""
    plain, marked = seed_files(format, tmp_path / "plain"), seed_files(format, tmp_path / "marked")
    refs = {}
    if where == "references":
        lines = "".join(f"w{i} reference\n" for i in range(len(read_nbest(plain, format))))
        for name, mark in (("plain", b""), ("marked", BOM)):
            refs[name] = tmp_path / f"{name}.refs.txt"
            refs[name].write_bytes(mark + lines.encode())
    else:
        for file in [marked] if marked.is_file() else sorted(f for f in marked.rglob("*") if f.is_file()):
            file.write_bytes(BOM + file.read_bytes())
    with_mark = read_nbest(marked, format, refs.get("marked"))
    assert content(with_mark) == content(read_nbest(plain, format, refs.get("plain")))


def test_a_list_file_may_start_with_a_byte_order_mark(tmp_path):
    path = tmp_path / "l.jsonl"
    path.write_bytes(BOM + json.dumps({"id": "u1", "hypotheses": [{"text": "a b", "features": {}}]}).encode() + b"\n")
    assert read_nbest(path).entries[0].id == "u1"


# -- a WMT folder's system that cannot be read ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["broken link", "folder", "link to a folder"])
def test_a_system_file_that_is_a_broken_link_or_a_folder_is_an_error_naming_it(tmp_path, capsys, kind):
    folder = tmp_path / "t.zh-en"
    folder.mkdir()
    for name in "abc":
        (folder / f"t.zh-en.hyp.{name}.en").write_text("the cat sat\n")
    odd = folder / "t.zh-en.hyp.d.en"
    if kind == "folder":
        odd.mkdir()
    elif kind == "link to a folder":
        (tmp_path / "elsewhere").mkdir()
        odd.symlink_to(tmp_path / "elsewhere")
    else:
        odd.symlink_to(tmp_path / "gone.en")
    expected = "a symbolic link to" if kind == "broken link" else "a folder"
    with pytest.raises(NBestFormatError, match=rf"t\.zh-en\.hyp\.d\.en: is {expected}"):
        read_nbest(folder)
    out = tmp_path / "refs.txt"
    refused(capsys, ["references", str(folder), "--out", str(out)], tmp_path, "t.zh-en.hyp.d.en: is " + expected)
    with pytest.raises(NBestFormatError, match=rf"hyp\.d\.en: is {expected}"):
        read_systems([folder / "t.zh-en.hyp.a.en", odd])


# -- the leakage guard without references ----------------------------------------------------------------------------


def test_overlap_of_a_list_without_references_is_an_error_not_0_percent_of_0(tmp_path, capsys):
    text = tmp_path / "lm.txt"
    text.write_text("\n".join(make_sentences(50, seed=2)) + "\n")
    nbest = tmp_path / "l.jsonl"
    write_nbest(NBestList([NBestEntry("u1", [Hypothesis("w1 w2", {"am": -1.0})])]), nbest, "jsonl")
    out = tmp_path / "o.json"
    argv = ["overlap", "--text", str(text), "--list", str(nbest), "--json", str(out)]
    refused(capsys, argv, tmp_path, f"--list {nbest}", "no references to check")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    argv = ["overlap", "--text", str(text), "--references", str(empty), "--json", str(out)]
    refused(capsys, argv, tmp_path, f"--references {empty}", "no references to check")
    marked = tmp_path / "refs.txt"
    marked.write_bytes(BOM + (make_sentences(50, seed=2)[0] + "\n").encode())
    assert main(["overlap", "--text", str(text), "--references", str(marked), "-n", "2", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["matched_references"] == 1  # its first word is a word of the text


# -- n-grams of other text forms mixed --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def styled_models(tmp_path_factory) -> Path:
    """Lower-case text and two trigrams: ``low`` of it, ``up`` of its upper-case copy, ``norm`` of that copy read
    ``--normalize lower`` (the same words as ``low``, but another form recorded)."""
    root = tmp_path_factory.mktemp("styled")
    lines = make_sentences(600, seed=4)
    (root / "low.txt").write_text("\n".join(lines) + "\n")
    (root / "up.txt").write_text("\n".join(lines).upper() + "\n")
    for name, text, extra in (
        ("low", "low.txt", []),
        ("up", "up.txt", []),
        ("norm", "up.txt", ["--normalize", "lower"]),
    ):
        argv = ["ngram", "build", "--order", "3", "--text", str(root / text), "--out", str(root / name)]
        assert main([*argv, "--discount-fallback", *extra]) == 0
    (root / "held.txt").write_text("\n".join(make_sentences(60, seed=5)) + "\n")
    return root


def test_ngram_mix_refuses_models_of_other_text_forms_and_a_model_as_heldout_text(styled_models, capsys):
    root = styled_models
    assert json.loads((root / "norm.text.json").read_text())["normalize"] == "lower"
    out = root / "mix.json"
    mix = ["ngram", "mix", "--heldout", str(root / "held.txt"), "--out", str(out)]
    # recorded: built with --normalize none and --normalize lower
    refused(capsys, [*mix, "--ngram", f"{root / 'low.bin'},{root / 'norm.bin'}"], root, "norm.bin", "--normalize lower")
    # not recorded (a model from elsewhere): its words are unknown in the held-out text's form
    (root / "up.text.json").rename(root / "up.record")
    try:
        refused(capsys, [*mix, "--ngram", f"{root / 'low.bin'},{root / 'up.bin'}"], root, "--ngram", "up.bin", "100%")
    finally:
        (root / "up.record").rename(root / "up.text.json")
    # the held-out text read in another form than the models were built from
    argv = [*mix, "--ngram", f"{root / 'low.bin'},{root / 'low.arpa'}", "--normalize", "lower"]
    refused(capsys, argv, root, "--heldout", "--normalize lower", "--normalize none")
    # a model where the held-out text belongs
    for model, kind in (("low.bin", "a KenLM binary model"), ("low.arpa", "an ARPA model")):
        argv = ["ngram", "mix", "--heldout", str(root / model), "--out", str(out)]
        refused(
            capsys,
            [*argv, "--ngram", f"{root / 'low.bin'},{root / 'low.arpa'}"],
            root,
            f"--heldout {root / model}",
            kind,
        )
    assert main([*mix, "--ngram", f"{root / 'low.bin'},{root / 'low.arpa'}"]) == 0 and out.exists()


# -- lists in another text form, a third of them ----------------------------------------------------------------------


def test_a_third_of_the_lists_in_another_text_form_is_refused_list_by_list(styled_models, tmp_path, capsys):
    lines = [line for line in make_sentences(100, seed=6) if len(line.split()) >= 3][:30]
    entries = []
    for i, line in enumerate(lines):
        text = line.upper() if i % 3 == 0 else line
        entries.append(
            NBestEntry(f"u{i}", [Hypothesis(text, {"am": -1.0}), Hypothesis(text + " w1", {"am": -2.0})], [line])
        )
    nbest = NBestList(entries, "third")
    models = LanguageModels(None, NgramLM(styled_models / "low.bin"), PRESETS["none"], {"ngram": "low.bin"})
    with pytest.raises(ValueError, match=r"third: 10 of its 30 lists .* \(e\.g\. 'u0', 'u3', 'u6'\) have most of"):
        models.check_vocabulary(nbest)
    path = tmp_path / "third.jsonl"
    write_nbest(nbest, path, "jsonl")
    out = tmp_path / "w.json"
    argv = ["tune", str(path), "--ngram", str(styled_models / "low.bin"), "--metric", "wer", "--features", "am,ngram"]
    refused(capsys, [*argv, "--out", str(out)], tmp_path, "10 of its", "unknown to the n-gram")
    lower = NBestList([NBestEntry(e.id, e.hypotheses, e.references) for e in entries[1:3]], "two")
    assert models.check_vocabulary(lower) == 0.0
