import pytest

from lmserve.training.vocab import VocabError, Vocabulary

SENTENCES = [s.split() for s in ["a b c a", "a b <unk>", "d a b", "e"]]


def test_ids_sorted_by_frequency_after_specials_and_unk_reused():
    v = Vocabulary.build(SENTENCES)
    assert v.tokens == ["<unk>", "<s>", "</s>", "a", "b", "c", "d", "e"]
    assert v.counts == [1, 4, 4, 4, 3, 1, 1, 1]
    assert (v.unk_id, v.bos_id, v.eos_id) == (0, 1, 2)


def test_min_count_and_max_size_fold_dropped_words_into_unk():
    v = Vocabulary.build(SENTENCES, min_count=2)
    assert v.tokens == ["<unk>", "<s>", "</s>", "a", "b"]
    assert v.counts[0] == 1 + 3  # the data's own <unk> plus c, d, e
    v = Vocabulary.build(SENTENCES, max_size=4)
    assert v.tokens == ["<unk>", "<s>", "</s>", "a"]
    assert v.counts[0] == 1 + 3 + 3
    with pytest.raises(VocabError, match="no room"):
        Vocabulary.build(SENTENCES, max_size=3)


def test_custom_unk_token():
    v = Vocabulary.build([["x", "UNK", "x"]], unk="UNK")
    assert v.tokens[:4] == ["UNK", "<s>", "</s>", "x"] and v.counts[0] == 1


def test_save_load_round_trip_keeps_counts(tmp_path):
    v = Vocabulary.build(SENTENCES)
    v.save(tmp_path / "vocab.tsv")
    w = Vocabulary.load(tmp_path / "vocab.tsv")
    assert w.tokens == v.tokens and w.counts == v.counts and w.index["c"] == 5


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("<unk>\t1\n", ":1: expected the header"),
        ("#lmserve-vocab v1\n<unk>\t1\n<s>\tmany\n", ":3: count 'many' is not an integer"),
        ("#lmserve-vocab v1\n<unk>\t1\n<s> 1\n", ":3: expected 'token<TAB>count'"),
        ("#lmserve-vocab v1\n<unk>\t1\n</s>\t1\n<s>\t1\n", "ids 1 and 2 must be"),
        ("#lmserve-vocab v1\n<unk>\t1\n<s>\t1\n</s>\t1\na\t1\na\t1\n", "token 'a' appears twice"),
        ("#lmserve-vocab v1\n<unk>\t1\n", "needs at least the 3 specials"),
    ],
)
def test_malformed_vocabulary_files_name_file_and_line(tmp_path, text, message):
    path = tmp_path / "vocab.tsv"
    path.write_text(text)
    with pytest.raises(VocabError) as info:
        Vocabulary.load(path)
    assert str(path) in str(info.value) and message in str(info.value)


def test_target_log_prior_is_a_smoothed_distribution_without_bos():
    import math

    v = Vocabulary.build(SENTENCES)
    prior = v.target_log_prior()
    assert sum(math.exp(p) for p in prior) == pytest.approx(1.0)
    assert prior[v.bos_id] == min(prior)  # <s> is never predicted
    assert prior[v.index["a"]] > prior[v.index["c"]]
