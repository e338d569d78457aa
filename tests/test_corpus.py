import gzip

import numpy as np
import pytest

from lmserve.training.corpus import CorpusError, encode_file, read_sentences
from lmserve.training.vocab import Vocabulary


def test_plain_and_gzip_read_the_same_whatever_the_name(tmp_path):
    text = "The cat\n\nsat  on the mat\n"
    (tmp_path / "a.txt").write_text(text)
    (tmp_path / "b.data").write_bytes(gzip.compress(text.encode()))  # gzip detected by content, not name
    plain = list(read_sentences(tmp_path / "a.txt"))
    assert plain == [["The", "cat"], [], ["sat", "on", "the", "mat"]]
    assert list(read_sentences(tmp_path / "b.data")) == plain
    assert list(read_sentences(tmp_path / "a.txt", lowercase=True))[0] == ["the", "cat"]


def test_invalid_utf8_names_file_and_line(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_bytes(b"fine line\nbad \xff byte\n")
    with pytest.raises(CorpusError, match=r"bad.txt:2: not valid UTF-8"):
        list(read_sentences(path))


def test_truncated_gzip_and_missing_file_are_clear_errors(tmp_path):
    path = tmp_path / "cut.gz"
    path.write_bytes(gzip.compress(b"a b c\n" * 1000)[:-30])
    with pytest.raises(CorpusError, match="cut.gz: unreadable"):
        list(read_sentences(path))
    with pytest.raises(CorpusError, match="file not found"):
        list(read_sentences(tmp_path / "nope.txt"))


def test_encode_counts_oov_including_the_data_own_unk(tmp_path):
    vocab = Vocabulary.build([["a", "b", "b"]])
    (tmp_path / "t.txt").write_text("a b zzz\n<unk> a\n\n")
    corpus = encode_file(tmp_path / "t.txt", vocab)
    assert corpus.num_sentences == 3 and corpus.num_words == 5
    assert corpus.oov == 2 and corpus.oov_rate == pytest.approx(0.4)
    np.testing.assert_array_equal(corpus.sentence(0), [vocab.index["a"], vocab.index["b"], vocab.unk_id])
    assert len(corpus.sentence(2)) == 0
