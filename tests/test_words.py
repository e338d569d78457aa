"""One definition of a word (``core.words``): any run of Unicode whitespace separates words, for the LMs' tokens,
WER, BLEU, the oracle and the readers alike (once a Kaldi ``text`` file with tabs between words scored a
hypothesis identical to its reference as 100% WER, so the oracle was wrong and tune returned all-zero weights)."""

import pytest
from nbest_fuzz import FILE_NAMES, NO_REFERENCES, NO_TABS, SPACES, as_format, respaced, write_references

from lmserve.core.textnorm import PRESETS
from lmserve.core.words import WORDS, spaced, words
from lmserve.rescoring import metrics
from lmserve.rescoring.nbest import FORMATS, read_nbest, write_nbest
from lmserve.rescoring.rescore import Setup, report, tuning_set


def test_a_word_is_what_str_split_gives():
    assert words("a\tb  c\u00a0d\u3000e\u2028f\n") == ["a", "b", "c", "d", "e", "f"]
    assert spaced(" a\t\tb\u00a0c ") == "a b c" and spaced("") == ""
    assert WORDS == "words:unicode-whitespace"


def test_signatures_say_what_a_word_is():
    assert WORDS in metrics.WER_SIGNATURE.split("|")
    assert WORDS in metrics.bleu_report([["a b c d"]], ["a b c d"])["signature"].split("|")


@pytest.mark.parametrize("space", list(SPACES.values()), ids=list(SPACES))
def test_wer_bleu_and_the_oracle_split_words_as_the_lms_do(space):
    ref, hyp = "the cat sat on the mat", space.join("the cat sat on the mat".split())
    assert PRESETS["none"].normalize(hyp) == ref.split()  # the LMs' tokens
    assert metrics.wer_report([ref], [hyp])["wer"] == 0.0
    assert metrics.wer_report([hyp], [ref])["wer"] == 0.0
    assert metrics.bleu_report([[ref]], [hyp])["bleu"] == pytest.approx(100.0)
    assert metrics.bleu_report([[hyp]], [ref], tokenize="none")["bleu"] == pytest.approx(100.0)
    assert metrics.oracle_wer([ref], [["the cat", hyp]]).tolist() == [1]
    assert metrics.oracle_bleu([[ref]], [["the cat", hyp]]).tolist() == [1]


@pytest.mark.parametrize("format", list(FORMATS))
@pytest.mark.parametrize("swap", [False, True], ids=["odd hypothesis", "odd reference"])
def test_a_hypothesis_equal_to_its_reference_has_no_errors_in_every_format(tmp_path, format, swap):
    general = respaced(SPACES["mixed" if format not in NO_TABS else "no-break space"], swap)
    nbest = as_format(general, format)
    path = tmp_path / FILE_NAMES.get(format, "dump")
    write_nbest(nbest, path, format)
    references = write_references(general, tmp_path / "refs.txt") if format in NO_REFERENCES else None
    read = read_nbest(path, format, references)
    rep = report(read, [0] * len(read), "wer", bootstrap_samples=10)
    assert (rep["1best"]["wer"], rep["oracle"]["wer"]) == (0.0, 0.0), format
    assert rep["1best"]["hits"] == 5 * len(read)
    bleu = report(read, [0] * len(read), "bleu", bootstrap_samples=10)
    assert bleu["1best"]["bleu"] == pytest.approx(100.0)


def test_tuning_sees_the_hypothesis_that_is_right():
    nbest = as_format(respaced("\t"), "jsonl")
    data = tuning_set(nbest, Setup(["lm", "am"]), None, "wer")
    assert [int(s[0, 0]) for s in data.stats] == [0, 0, 0]  # no errors for the first hypotheses
