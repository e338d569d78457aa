import gzip
import hashlib
import json

import pytest

from lmserve.training.gutenberg import (
    book_sentences,
    holdout_split,
    normalize_librispeech,
    paragraphs,
    prepare_gutenberg,
    read_manifest,
    split_sentences,
    strip_boilerplate,
)

LICENSE = (
    "*** START: FULL LICENSE ***\n\nTHE FULL PROJECT GUTENBERG LICENSE\n"
    "PLEASE READ THIS BEFORE YOU DISTRIBUTE OR USE THIS WORK\n"
)


def modern_book(title: str, body: str) -> str:
    """A book in the modern layout, with CRLF line endings like 96 of the real files."""
    text = (
        f"The Project Gutenberg EBook of {title}\n\nThis eBook is for the use of anyone anywhere.\n\n"
        f"*** START OF THIS PROJECT GUTENBERG EBOOK {title.upper()} ***\n\n\n"
        "Produced by Some Volunteer and the Online Distributed\nProofreading Team\n\n\n"
        f"{body}\n\n\n"
        f"End of the Project Gutenberg EBook of {title}, by Someone\n\n"
        f"*** END OF THIS PROJECT GUTENBERG EBOOK {title.upper()} ***\n\n{LICENSE}"
    )
    return text.replace("\n", "\r\n")


OLD_STYLE = """This Etext file is presented by Project Gutenberg.

<<THIS ELECTRONIC VERSION OF THE COMPLETE WORKS OF WILLIAM
SHAKESPEARE IS COPYRIGHT 1990-1993 BY WORLD LIBRARY, INC.>>

***** SMALL PRINT! for COMPLETE SHAKESPEARE *****
1.  LICENSE  You may distribute this etext.
****   SMALL PRINT! FOR __ COMPLETE SHAKESPEARE ****
["Small Print" V.12.08.93]

<<THIS ELECTRONIC VERSION OF THE COMPLETE WORKS OF WILLIAM
SHAKESPEARE IS COPYRIGHT 1990-1993 BY WORLD LIBRARY, INC.>>

A MIDSUMMER NIGHT'S DREAM

  THESEUS. Now, fair Hippolyta, our nuptial hour
    Draws on apace.

<<THIS ELECTRONIC VERSION OF THE COMPLETE WORKS OF WILLIAM
SHAKESPEARE IS COPYRIGHT 1990-1993 BY WORLD LIBRARY, INC.>>

THE END

End of this Etext of The Complete Works of William Shakespeare
A Midsummer Night's Dream
"""


def test_strip_boilerplate_modern_drops_header_credits_footer_and_license():
    body = (
        "[Transcriber Note: This etext was produced from Worlds\nof Science. Extensive research did not\n"
        "uncover any evidence that the copyright was renewed.]\n\n"
        "[Illustration: A ship\nat sea]\n\nIt was a dark night.\nThe end."
    )
    out = strip_boilerplate(modern_book("Sea Tales", body))
    assert "\r" not in out
    assert "It was a dark night." in out and "The end." in out
    for leaked in ("Gutenberg", "GUTENBERG", "Produced", "LICENSE", "Illustration", "etext", "copyright", "END OF"):
        assert leaked not in out


def test_strip_boilerplate_handles_marker_wrapped_over_lines_without_space():
    text = (
        "header\r\n***START OF THE PROJECT GUTENBERG EBOOK THE BORDER BOYS ACROSS THE\r\n"
        "FRONTIER***\r\n\r\nBook text.\r\n\r\n"
        "***END OF THE PROJECT GUTENBERG EBOOK THE BORDER BOYS ACROSS THE\r\nFRONTIER***\r\nfooter"
    )
    assert strip_boilerplate(text).split() == ["Book", "text."]


def test_strip_boilerplate_old_small_print_style():
    out = strip_boilerplate(OLD_STYLE)
    assert "Now, fair Hippolyta" in out and "THE END" in out
    for leaked in ("ELECTRONIC", "COPYRIGHT", "Etext", "Small Print", "LICENSE", "<<", ">>"):
        assert leaked not in out


@pytest.mark.parametrize(
    "text, message",
    [
        ("Just some text.\nNo markers at all.\n", "no recognisable"),
        ("*** START OF THIS PROJECT GUTENBERG EBOOK X ***\nText, never ended.\n", "END marker"),
    ],
)
def test_strip_boilerplate_rejects_unknown_layouts(text, message):
    with pytest.raises(ValueError, match=message):
        strip_boilerplate(text)


def test_paragraphs_unwraps_hard_wrapped_lines():
    text = "  First line of a\r\nwrapped   paragraph.\r\n \r\nSecond\tparagraph.\r\n\r\n\r\n"
    assert paragraphs(text) == ["First line of a wrapped paragraph.", "Second paragraph."]


def test_split_sentences_respects_abbreviations_and_quotes():
    paragraph = (
        'Mr. and Mrs. Quilter met Dr. Brown at St. Paul\'s. "Who is J. M. Barrie?" she asked. '
        "He laughed! Then he went, i.e. left. No. It was I. Really? “Yes,” said he."
    )
    assert split_sentences(paragraph) == [
        "Mr. and Mrs. Quilter met Dr. Brown at St. Paul's.",
        '"Who is J. M. Barrie?" she asked.',
        "He laughed!",
        "Then he went, i.e. left.",
        "No.",
        "It was I.",
        "Really?",
        "“Yes,” said he.",
    ]


def test_split_sentences_needs_capital_or_opening_quote_after_the_stop():
    assert split_sentences("He said so. and then left.") == ["He said so. and then left."]
    assert split_sentences("Stop. _Now_ go.") == ["Stop.", "_Now_ go."]
    assert split_sentences("It was Quilter’s. Then it was Paul's. Then not.") == [
        "It was Quilter’s.",
        "Then it was Paul's.",
        "Then not.",
    ]
    assert split_sentences("") == []


@pytest.mark.parametrize(
    "sentence, expected",
    [
        ("“Don’t touch Quilter’s hat!” he said.", "DON'T TOUCH QUILTER'S HAT HE SAID"),
        ("'Twas the boys' book—or so they say-so.", "TWAS THE BOYS BOOK OR SO THEY SAY SO"),
        ("To-day, in the café, Cæsar said: ‘well’…", "TO DAY IN THE CAFE CAESAR SAID WELL"),
        ("ﬁne   _italic_ (words); [here]", "FINE ITALIC WORDS HERE"),
        ("Greek λόγος word", "GREEK WORD"),
        ("--- * * * ---", ""),
        ("He paid 5 shillings.", None),
        ("Chapter ½ or ²", None),
    ],
)
def test_normalize_librispeech(sentence, expected):
    assert normalize_librispeech(sentence) == expected


def test_book_sentences_counts_digit_sentences_and_drops_empty_ones():
    text = "It was 1851. The sea\nwas calm.\n\n* * *\n\nMr. Smith's boat sank!"
    assert book_sentences(text) == (["THE SEA WAS CALM", "MR SMITH'S BOAT SANK"], 1)


def test_holdout_split_is_deterministic_disjoint_and_order_independent():
    files = [f"pg{n}.txt.gz" for n in range(10, 30)]
    split = holdout_split(files, 3, 2)
    assert split == holdout_split(list(reversed(files)), 3, 2)
    assert len(split["valid"]) == 3 and len(split["test"]) == 2 and len(split["train"]) == 15
    assert sorted(split["train"] + split["valid"] + split["test"]) == sorted(files)
    ranked = sorted(files, key=lambda f: hashlib.sha256(f.encode()).hexdigest())
    assert split["valid"] == sorted(ranked[:3]) and split["test"] == sorted(ranked[3:5])


@pytest.mark.parametrize("valid, test", [(2, 1), (-1, 0)])
def test_holdout_split_rejects_impossible_requests(valid, test):
    with pytest.raises(ValueError):
        holdout_split(["a", "b", "c"], valid, test)


def test_read_manifest_names_file_with_missing_columns(tmp_path):
    path = tmp_path / "MANIFEST.tsv"
    path.write_text("file\ttitle\npg1.txt.gz\tX\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"MANIFEST\.tsv.*gz_sha256"):
        read_manifest(path)


def write_corpus(data_dir, books):
    """Gzip each (ebook, title, text) into data_dir with a MANIFEST.tsv like the real one."""
    data_dir.mkdir()
    rows = ["file\tpg_ebook_no\ttitle\tauthor\tgz_sha256"]
    for ebook, title, text in books:
        data = gzip.compress(text.encode("utf-8"), mtime=0)
        (data_dir / f"pg{ebook}.txt.gz").write_bytes(data)
        rows.append(f"pg{ebook}.txt.gz\t{ebook}\t{title}\tAn Author\t{hashlib.sha256(data).hexdigest()}")
    (data_dir / "MANIFEST.tsv").write_text("\n".join(rows) + "\n", encoding="utf-8")


WORDS = ["ALPHA", "BRAVO", "CHARLIE", "DELTA", "ECHO", "FOXTROT"]


def fake_books():
    """Six books whose sentences all name the book's word, so each line's source book is known."""
    books = []
    for i, word in enumerate(WORDS):
        body = (
            f"Mr. {word.title()} walked\nto the quay. “Don’t go,” said\n{word.title()}’s wife!\n\n"
            f"In 1850 {word.lower()} was born.\n\n'{word.title()}' smiled—and left."
        )
        books.append((100 + i, f'"{word.title()}" Tales', modern_book(f"{word} Tales", body)))
    return books


def expected_lines(word):
    return [f"MR {word} WALKED TO THE QUAY", f"DON'T GO SAID {word}'S WIFE", f"{word} SMILED AND LEFT"]


def read_lines(path):
    return gzip.decompress(path.read_bytes()).decode("utf-8").splitlines()


def test_prepare_gutenberg_end_to_end(tmp_path):
    data_dir = tmp_path / "gutenberg"
    write_corpus(data_dir, fake_books())
    out = tmp_path / "out"
    info = prepare_gutenberg(data_dir, out, valid_books=2, test_books=1)

    assert sorted(p.name for p in out.iterdir()) == ["prepare.json", "test.txt.gz", "train.txt.gz", "valid.txt.gz"]
    assert json.loads((out / "prepare.json").read_text(encoding="utf-8")) == info

    expected = holdout_split([f"pg{100 + i}.txt.gz" for i in range(6)], 2, 1)
    for split in ("train", "valid", "test"):
        books = info["splits"][split]["books"]
        words = [WORDS[int(name[2:5]) - 100] for name in expected[split]]
        assert books == [
            {"file": name, "ebook": int(name[2:5]), "title": f'"{word.title()}" Tales', "sentences": 3, "tokens": 15}
            for name, word in zip(expected[split], words, strict=True)
        ]
        # Whole books only: the split holds exactly its books' sentences, in book order.
        assert read_lines(out / f"{split}.txt.gz") == [line for w in words for line in expected_lines(w)]
        assert info["splits"][split]["sentences"] == 3 * len(books)
        assert info["splits"][split]["tokens"] == 15 * len(books)

    assert info["dropped_digit_sentences"] == 6
    assert info["valid_books"] == 2 and info["test_books"] == 1
    assert info["data_dir"] == str(data_dir.resolve())
    assert set(info["input_sha256"]) == {"MANIFEST.tsv"} | {f"pg{100 + i}.txt.gz" for i in range(6)}
    for name, digest in info["input_sha256"].items():
        assert hashlib.sha256((data_dir / name).read_bytes()).hexdigest() == digest


def test_prepare_gutenberg_output_is_byte_identical_across_runs(tmp_path):
    data_dir = tmp_path / "gutenberg"
    write_corpus(data_dir, fake_books())
    prepare_gutenberg(data_dir, tmp_path / "a", valid_books=2, test_books=2)
    first = {p.name: p.read_bytes() for p in (tmp_path / "a").iterdir()}
    prepare_gutenberg(data_dir, tmp_path / "a", valid_books=2, test_books=2)
    prepare_gutenberg(data_dir, tmp_path / "b", valid_books=2, test_books=2)
    assert {p.name: p.read_bytes() for p in (tmp_path / "a").iterdir()} == first
    assert {p.name: p.read_bytes() for p in (tmp_path / "b").iterdir()} == first
    assert first["train.txt.gz"][4:8] == b"\0\0\0\0"  # gzip mtime field


def test_prepare_gutenberg_on_unchanged_books_does_nothing(tmp_path, capsys):
    data_dir, out = tmp_path / "gutenberg", tmp_path / "out"
    write_corpus(data_dir, fake_books())
    first = prepare_gutenberg(data_dir, out, valid_books=2, test_books=1)
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    capsys.readouterr()
    assert prepare_gutenberg(data_dir, out, valid_books=2, test_books=1) == first
    assert "up to date" in capsys.readouterr().err
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps  # not written again

    # other settings, or a lost output: made again
    assert prepare_gutenberg(data_dir, out, valid_books=1, test_books=1)["splits"]["valid"]["sentences"] == 3
    (out / "test.txt.gz").unlink()
    prepare_gutenberg(data_dir, out, valid_books=1, test_books=1)
    assert "up to date" not in capsys.readouterr().err and (out / "test.txt.gz").is_file()

    # a book that changed since (the manifest too old for it): read again, and refused
    (data_dir / "pg102.txt.gz").write_bytes(gzip.compress(b"changed", mtime=0))
    with pytest.raises(ValueError, match=r"pg102\.txt\.gz.*sha256"):
        prepare_gutenberg(data_dir, out, valid_books=1, test_books=1)


def test_prepare_gutenberg_errors_name_the_offending_path(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(ValueError, match="nowhere"):
        prepare_gutenberg(missing, tmp_path / "out")

    lost = tmp_path / "lost"  # a book of the manifest is not there: an error naming it, not a traceback
    write_corpus(lost, fake_books()[:3])
    (lost / "pg101.txt.gz").unlink()
    with pytest.raises(ValueError, match=r"pg101\.txt\.gz: cannot read this book"):
        prepare_gutenberg(lost, tmp_path / "out", valid_books=1, test_books=1)

    bad = tmp_path / "bad"
    write_corpus(bad, fake_books()[:3] + [(999, "Bare", "Just text.\r\nNo markers.\r\n")])
    with pytest.raises(ValueError, match=r"pg999\.txt\.gz.*no recognisable"):
        prepare_gutenberg(bad, tmp_path / "out", valid_books=1, test_books=1)

    tampered = tmp_path / "tampered"
    write_corpus(tampered, fake_books()[:3])
    (tampered / "pg101.txt.gz").write_bytes(gzip.compress(b"changed", mtime=0))
    with pytest.raises(ValueError, match=r"pg101\.txt\.gz.*sha256"):
        prepare_gutenberg(tampered, tmp_path / "out", valid_books=1, test_books=1)
    assert not (tmp_path / "out").exists()
