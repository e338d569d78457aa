"""The english-text preparation: each source's layout becomes sentences (LibriSpeech form or as written), documents
split whole."""

import gzip

import pytest

from lmserve.training.cli import main
from lmserve.training.english_text import (
    MAX_WORDS,
    chat_words,
    documents,
    join_stops,
    pieces,
    prepare_english_text,
    raw_sentences,
)


def test_chat_tokenisation_is_written_back():
    assert join_stops(chat_words("I do n't know it 's gon na rain .")) == "I don't know it's gonna rain."


def test_each_source_splits_by_its_layout():
    assert raw_sentences("sgd", ["Hi there. Can you book it?", "Sure!"]) == ["Hi there.", "Can you book it?", "Sure!"]
    assert raw_sentences("cabnc", ["0 .", "we have n't got it .", "xxx .", "yeah ."]) == ["we haven't got it.", "yeah."]
    talk = ["hello everyone. This is", "a talk"]
    assert raw_sentences("ted", talk) == ["hello everyone.", "This is a talk"]


def test_unpunctuated_runs_are_cut_before_normalisation():
    text = " ".join(["word"] * (MAX_WORDS + 3))
    assert [len(p.split()) for p in pieces(text)] == [MAX_WORDS, 3]


def test_documents_are_blank_line_separated():
    assert documents("a\nb\n\n\nc\n") == [["a", "b"], ["c"]]


def test_prepare_english_writes_three_splits(tmp_path):
    data = tmp_path / "english-text"
    data.mkdir()
    body = "\n\n".join(f"Talk number {'one' if i % 2 else 'two'} of many. It has 2 digits here." for i in range(300))
    for source in ("ted", "sgd", "cabnc", "reuters"):
        (data / f"{source}.txt.gz").write_bytes(gzip.compress(body.encode()))
    assert main(["prepare-english", "--data", str(data), "--out", str(tmp_path / "out")]) == 0
    train = gzip.decompress((tmp_path / "out" / "train.txt.gz").read_bytes()).decode().splitlines()
    assert train[0] in ("TALK NUMBER ONE OF MANY", "TALK NUMBER TWO OF MANY")  # the digit sentence is dropped
    assert all(line.isupper() for line in train)


def test_the_written_form_keeps_case_punctuation_and_digits_and_leaves_ted_out(tmp_path):
    data = tmp_path / "english-text"
    data.mkdir()
    for source in ("ted", "sgd", "cabnc", "reuters"):
        body = "\n\n".join(f"{source} says: It costs $2,750 ﬁne. Really?" for _ in range(300))
        (data / f"{source}.txt.gz").write_bytes(gzip.compress(body.encode()))
    assert main(["prepare-english", "--form", "written", "--data", str(data), "--out", str(tmp_path / "out")]) == 0
    train = gzip.decompress((tmp_path / "out" / "train.txt.gz").read_bytes()).decode().splitlines()
    assert {line.split()[0] for line in train} == {"sgd", "cabnc", "reuters", "Really?"}
    assert "sgd says: It costs $2,750 fine." in train  # NFKC folds the ligature; nothing else changes


def test_unknown_source_is_named(tmp_path):
    with pytest.raises(ValueError, match="unknown english-text source 'tv'"):
        prepare_english_text(tmp_path, tmp_path / "out", ("tv",))
    with pytest.raises(ValueError, match="unknown english-text form 'caps'"):
        prepare_english_text(tmp_path, tmp_path / "out", form="caps")
