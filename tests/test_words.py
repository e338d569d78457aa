"""One definition of a word (``rescoring.words``): any run of Unicode whitespace separates words, for the LMs' tokens,
WER, BLEU, the oracle and the readers alike (issue 34: a Kaldi ``text`` file with tabs between words scored a
hypothesis identical to its reference as 100% WER, so the oracle was wrong and tune returned all-zero weights)."""

import pytest
from nbest_fuzz import FEATURES

from lmserve.rescoring import metrics
from lmserve.rescoring.nbest import FORMATS, Hypothesis, NBestEntry, NBestList, read_nbest, write_nbest
from lmserve.rescoring.rescore import Setup, report, tuning_set
from lmserve.rescoring.textnorm import PRESETS
from lmserve.rescoring.words import WORDS, spaced, words

SPACES = ["\t", "  ", "\u00a0", "\u3000", " \t "]  # tab, two spaces, no-break space, ideographic space, a mix
WRITTEN = {"jsonl": "l.jsonl", "hyporadise": "l.json", "moses": "l.kbest", "fairseq": "l.txt"}  # the others: folders
NO_REFERENCES = ("moses", "srilm", "fairseq")  # formats that carry no references: given as a file
NO_TABS = ("fairseq",)  # tab-separated fields: a tab cannot be inside its text


def odd_list(space: str, swap: bool = False, features=("score", "lm")) -> NBestList:
    """Three utterances whose first hypothesis has the words of the reference, separated by ``space`` (and the
    reference by single spaces; ``swap``: the other way round), the second hypothesis a word short; ``features``:
    their names, of the first hypothesis -1 each, of the second -2 (SRILM's ``num_words``: the words)."""
    entries = []
    for i in range(3):
        plain = f"the cat sat on mat{i}"
        odd = space.join(plain.split())
        hyp, ref = (plain, odd) if swap else (odd, plain)
        hyps = []
        for rank, text in enumerate([hyp, f"the cat sat mat{i}"], 1):
            values = {name: float(len(text.split()) if name == "num_words" else -rank) for name in features}
            hyps.append(Hypothesis(text, values, rank))
        entries.append(NBestEntry(str(i), hyps, [ref]))
    return NBestList(entries, "odd")


def test_a_word_is_what_str_split_gives():
    assert words("a\tb  c\u00a0d\u3000e\u2028f\n") == ["a", "b", "c", "d", "e", "f"]
    assert spaced(" a\t\tb\u00a0c ") == "a b c" and spaced("") == ""
    assert WORDS == "words:unicode-whitespace"


def test_signatures_say_what_a_word_is():
    assert WORDS in metrics.WER_SIGNATURE.split("|")
    assert WORDS in metrics.bleu_report([["a b c d"]], ["a b c d"])["signature"].split("|")


@pytest.mark.parametrize("space", SPACES)
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
    space = " \u00a0" if format in NO_TABS else "\t"
    nbest = odd_list(space, swap, FEATURES[format])
    path = tmp_path / WRITTEN.get(format, "dump")
    references = None
    if format in NO_REFERENCES:
        references = tmp_path / "refs.txt"
        references.write_text("".join(e.references[0] + "\n" for e in nbest), encoding="utf-8")
        nbest = NBestList([NBestEntry(e.id, e.hypotheses, [], e.source) for e in nbest], nbest.name)
    write_nbest(nbest, path, format)
    read = read_nbest(path, format, references)
    rep = report(read, [0] * len(read), "wer", bootstrap_samples=10)
    assert (rep["1best"]["wer"], rep["oracle"]["wer"]) == (0.0, 0.0), format
    assert rep["1best"]["hits"] == 5 * len(read)
    bleu = report(read, [0] * len(read), "bleu", bootstrap_samples=10)
    assert bleu["1best"]["bleu"] == pytest.approx(100.0)


def test_tuning_sees_the_hypothesis_that_is_right():
    nbest = odd_list("\t")
    data = tuning_set(nbest, Setup(["score", "lm"]), None, "wer")
    assert [int(s[0, 0]) for s in data.stats] == [0, 0, 0]  # no errors for the first hypotheses
