import json

import pytest

from lmserve.core.textnorm import PRESETS, TextNormalizer
from lmserve.training.gutenberg import normalize_librispeech

PTB = PRESETS["ptb"]
GUTENBERG = PRESETS["gutenberg"]


def test_default_is_whitespace_split():
    assert TextNormalizer().normalize("  It's 5%,  OK ") == ["It's", "5%,", "OK"]
    assert PRESETS["none"] == TextNormalizer()


def test_case_keeps_markup_and_ptb_number_token():
    assert TextNormalizer(case="lower").normalize("The <UNK> N") == ["the", "<UNK>", "n"]
    assert TextNormalizer(case="lower", numbers="ptb").normalize("The <unk> N") == ["the", "<unk>", "N"]
    assert TextNormalizer(case="upper").normalize("it's <unk>") == ["IT'S", "<unk>"]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("hello, world.", ["hello", "world"]),
        ('"quoted" (words) ... !', ["quoted", "words"]),
        ("o'neil's well-known café", ["o'neil's", "well-known", "café"]),
        ("'tis the boys' -- rock'n'roll", ["tis", "the", "boys", "rock'n'roll"]),
        ("it’s", ["it's"]),  # curly apostrophe
        ("3.5 1,000 12:30 1/2 end.", ["3.5", "1,000", "12:30", "1/2", "end"]),
        ("-lrb- aside -rrb-", ["aside"]),
        ("snake_case", ["snake", "case"]),
        ("রবীন্দ্রনাথের জন্ম", ["রবীন্দ্রনাথের", "জন্ম"]),  # combining vowel signs stay in the word
    ],
)
def test_strip_punctuation(text, expected):
    assert TextNormalizer(punctuation="strip").normalize(text) == expected


def test_kept_symbols_stay_inside_words_and_split_at_edges():
    norm = TextNormalizer(punctuation="strip", keep_symbols="$&")
    assert norm.normalize("$5 at&t & co. $one") == ["$", "5", "at&t", "&", "co", "$", "one"]


def test_hyphens_split():
    assert TextNormalizer(hyphens="split").normalize("well-known - x-ray-") == ["well", "known", "-", "x", "ray-"]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("5 3.5 1,000 -2 .5 %", ["N"] * 6),
        ("1980s 30-year 13th ru-486", ["1980s", "30-year", "13th", "ru-486"]),
    ],
)
def test_ptb_numbers(text, expected):
    assert TextNormalizer(numbers="ptb").normalize(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("one of the nine", ["one", "of", "the", "nine"]),  # lone small numbers are words in WSJ text
        ("eleven or twenty five or eighty-six", ["N", "or", "N", "or", "N"]),
        ("nineteen eighty-seven", ["N"]),
        ("one point five million", ["N", "million"]),
        ("the point is one point", ["the", "point", "is", "one", "point"]),
        ("twenty point", ["N", "point"]),
        ("a hundred or two hundred", ["a", "hundred", "or", "N"]),
    ],
)
def test_spelled_numbers(text, expected):
    assert TextNormalizer(numbers="ptb", spelled_numbers=True).normalize(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("it's", ["it", "'s"]),
        ("don't can't won't ain't", ["do", "n't", "ca", "n't", "wo", "n't", "ai", "n't"]),
        ("we're i've i'm they'll he'd", ["we", "'re", "i", "'ve", "i", "'m", "they", "'ll", "he", "'d"]),
        ("cannot", ["can", "not"]),
        ("the boys' toys", ["the", "boys", "'", "toys"]),
        ("it 's already split", ["it", "'s", "already", "split"]),
        ("DON'T IT'S", ["DO", "N'T", "IT", "'S"]),
        ("o'clock rock'n'roll", ["o'clock", "rock'n'roll"]),
    ],
)
def test_split_clitics(text, expected):
    assert TextNormalizer(split_clitics=True).normalize(text) == expected


def test_replace_matches_after_case_and_punctuation():
    norm = TextNormalizer(case="lower", punctuation="strip", replace={"mister": "mr.", "mr": "mr."})
    assert norm.normalize("Mister Smith and Mr. Jones") == ["mr.", "smith", "and", "mr.", "jones"]


def test_ptb_preset_on_wsj_and_joshua_style_text():
    wsj = "mister smith's firm said it's worth $one point five million or fifteen percent, won't it"
    assert PTB.normalize(wsj) == (
        "mr. smith 's firm said it 's worth $ N million or N N wo n't it".split()  # "15 %" is "N N" in PTB
    )
    joshua = 'the u.s. " -lrb- at&t -rrb- " paid 1,200 dollars to rabindranath \'s family .'
    assert PTB.normalize(joshua) == "the u.s. at&t paid N dollars to rabindranath 's family".split()


def test_ptb_preset_leaves_ptb_text_alone():
    for line in (
        " the company 's shares fell $ N to $ N in u.s. trading on a N N drop ",
        " mr. <unk> said the investors ' at&t holdings are n't for sale ",
        " pierre <unk> N years old will join the board as a nonexecutive director ",
    ):
        assert PTB.normalize(line) == line.split()


def test_gutenberg_preset_matches_the_training_corpus_preparation():
    sentences = [
        "NOR IS MISTER QUILTER'S MANNER LESS INTERESTING THAN HIS MATTER",
        "'Tis a well-known fact--said Mr. O'Neil's friends' dog, \"isn't it?\"",
        "HAD A GOOD TURN O' SCOUTING YES SIR",
        "the rock'n'roll (so-called) era; 'quoted' words!",
    ]
    for s in sentences:
        assert GUTENBERG.normalize(s) == normalize_librispeech(s).split(), s
    assert PRESETS["librispeech"] == GUTENBERG


def test_old_manifest_shape():
    assert TextNormalizer.from_dict({"tokenizer": "whitespace", "lowercase": True}) == TextNormalizer(case="lower")
    assert TextNormalizer.from_dict({"tokenizer": "whitespace", "lowercase": False}) == TextNormalizer()
    assert TextNormalizer.from_dict({"tokenizer": "whitespace"}) == TextNormalizer()
    with pytest.raises(ValueError, match="lowercase"):
        TextNormalizer.from_dict({"tokenizer": "whitespace", "lowercase": True, "case": "upper"})


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_dict_round_trip_through_json(name):
    d = json.loads(json.dumps(PRESETS[name].to_dict()))
    assert TextNormalizer.from_dict(d) == PRESETS[name]


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"tokenizer": "spm"}, "tokenizer"),
        ({"tokenizer": "textnorm", "casing": "lower"}, "unknown field"),
        ({"tokenizer": "textnorm", "case": "title"}, "case must be one of"),
        ({"tokenizer": "textnorm", "spelled_numbers": True}, "spelled_numbers needs"),
    ],
)
def test_from_dict_rejects(bad, message):
    with pytest.raises(ValueError, match=message):
        TextNormalizer.from_dict(bad)


def test_a_memo_shared_by_texts_gives_the_same_tokens():
    normalizer = TextNormalizer(case="lower", punctuation="strip")
    texts = ["Hello, World! hello (world)", "«Bye» WORLD", ""]
    memo: dict = {}
    assert [normalizer.normalize(t, memo) for t in texts] == [normalizer.normalize(t) for t in texts]
    assert [["hello", "world", "hello", "world"], ["bye", "world"], []] == [normalizer.normalize(t) for t in texts]
    assert memo == {
        "Hello,": ("hello",),
        "World!": ("world",),
        "hello": ("hello",),
        "(world)": ("world",),
        "«Bye»": ("bye",),
        "WORLD": ("world",),
    }  # each word once
