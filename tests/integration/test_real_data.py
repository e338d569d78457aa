"""The training side on the real data sets in ../shared/data (or $LMSERVE_DATA)."""

import json

import pytest

from lmserve.training.cli import main
from lmserve.training.corpus import encode_file, read_sentences
from lmserve.training.gutenberg import prepare_gutenberg
from lmserve.training.vocab import Vocabulary

pytestmark = pytest.mark.integration


def test_ptb_vocabulary_reuses_its_unk_and_is_closed(shared_data):
    vocab = Vocabulary.build(read_sentences(shared_data / "ptb" / "ptb.train.txt.gz"))
    assert len(vocab) == 10001  # 9,999 word types (with <unk>) + <s> + </s>
    assert vocab.tokens[:3] == ["<unk>", "<s>", "</s>"] and vocab.tokens[3] == "the"
    assert vocab.counts[0] == 45020  # the training text's own <unk> tokens
    valid = encode_file(shared_data / "ptb" / "ptb.valid.txt.gz", vocab)
    literal_unk = sum(s.count("<unk>") for s in read_sentences(shared_data / "ptb" / "ptb.valid.txt.gz"))
    assert valid.num_words == 70390 and valid.num_sentences == 3370
    assert valid.oov == literal_unk  # every other valid word is in the training vocabulary


def test_short_ptb_training_run_learns(shared_data, tmp_path, capsys):
    args = [
        "fit",
        "configs/demo_ptb.toml",
        "--out",
        str(tmp_path / "run"),
        "--set",
        "train.max_tokens=60000",
        "--set",
        "model.hidden_size=32",
        "--set",
        "model.embedding_size=32",
        "--set",
        "data.test=''",
    ]
    assert main(args) == 0
    results = json.loads(capsys.readouterr().out)
    assert results["valid"]["tokens"] == 70390 + 3370
    assert results["valid"]["ppl"] < 1000  # uniform over the vocabulary would be 10001
    assert results["valid_oov_rate"] == pytest.approx(0.0495, abs=1e-4)


def test_gutenberg_preparation_gives_a_large_vocabulary_corpus(shared_data, tmp_path):
    info = prepare_gutenberg(shared_data / "gutenberg", tmp_path)
    assert [len(info["splits"][s]["books"]) for s in ("train", "valid", "test")] == [91, 3, 3]
    assert info["splits"]["train"]["tokens"] > 4_000_000
    vocab = Vocabulary.build(read_sentences(tmp_path / "train.txt.gz"), max_size=50000)
    assert len(vocab) == 50000  # the >= 45k-word vocabulary the adaptive-softmax benchmark needs
    valid = encode_file(tmp_path / "valid.txt.gz", vocab)
    assert valid.oov_rate < 0.03
    text = " ".join(" ".join(s) for s in read_sentences(tmp_path / "test.txt.gz"))
    assert "GUTENBERG" not in text and "ELECTRONIC VERSION" not in text
