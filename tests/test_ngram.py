"""KenLM n-grams built with the real lmplz and build_binary (`make kenlm`) on a generated corpus, then queried."""

from __future__ import annotations

import gzip
import io
import math
import sys

import kenlm
import numpy as np
import pytest

from lmserve.rescoring import ngram
from lmserve.rescoring.commands.cli import main
from lmserve.rescoring.ngram import NgramError, NgramLM, build_ngram


def zipf_corpus(n: int, seed: int) -> list[list[str]]:
    """Zipf-distributed words: rare words and repeated frequent n-grams, so that lmplz can estimate its discounts
    (a small closed vocabulary cannot: every word then has many distinct left neighbours)."""
    rng = np.random.default_rng(seed)
    return [[f"w{z}" for z in rng.zipf(1.5, size=rng.integers(1, 16))] for _ in range(n)]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("ngram") / "lm3"
    info = build_ngram(zipf_corpus(1000, seed=1), order=3, out=out)
    return info, NgramLM(info["arpa"]), NgramLM(info["binary"])


@pytest.fixture(scope="module")
def test_sentences() -> list[list[str]]:
    return [*zipf_corpus(30, seed=2), [], ["w1", "neverseen", "w2", "alsounseen"]]


def test_build_writes_arpa_and_binary_and_nothing_else(built):
    info, arpa, binary = built
    assert info["order"] == 3 and info["sentences"] == 1000 and info["discount_fallback"] is False
    assert info["tokens"] == sum(len(s) for s in zipf_corpus(1000, seed=1))
    assert len(info["ngrams"]) == 3 and all(n > 0 for n in info["ngrams"])
    assert info["arpa"].endswith("lm3.arpa") and info["binary"].endswith("lm3.bin")
    assert sorted(p.name for p in arpa.path.parent.iterdir()) == ["lm3.arpa", "lm3.bin"]  # temporaries renamed
    assert arpa.order == binary.order == 3


def test_arpa_and_binary_give_the_same_scores(built, test_sentences):
    _, arpa, binary = built
    for words in test_sentences:
        assert binary.score(words) == pytest.approx(arpa.score(words), abs=1e-5)
        np.testing.assert_allclose(binary.token_logprobs(words), arpa.token_logprobs(words), atol=1e-5)


def test_scores_are_natural_logs_of_kenlm_log10_and_sum_the_tokens(built, test_sentences):
    _, arpa, _ = built
    model = kenlm.Model(str(arpa.path))
    for words in test_sentences:
        tokens = arpa.token_logprobs(words)
        assert tokens.shape == (len(words) + 1,) and np.all(tokens < 0)
        assert arpa.score(words) == pytest.approx(tokens.sum(), rel=1e-12)
        assert arpa.score(words) == pytest.approx(model.score(" ".join(words)) * math.log(10), rel=1e-5)


def test_stepping_word_by_word_then_end_of_sentence_equals_the_sentence_score(built, test_sentences):
    _, arpa, binary = built
    for lm in (arpa, binary):
        for words in test_sentences:
            state, total = lm.begin_state(), 0.0
            for word in [*words, "</s>"]:
                logprob, state = lm.step(state, word)
                total += logprob
            assert total == pytest.approx(lm.score(words), rel=1e-12, abs=1e-12)


def test_oov_counts_words_outside_the_vocabulary(built):
    _, arpa, binary = built
    for lm in (arpa, binary):
        assert lm.oov(["w1", "neverseen", "w2", "alsounseen", "neverseen"]) == 3
        assert lm.oov(["w1", "w2"]) == 0 and lm.oov([]) == 0


def test_a_state_survives_bytes_and_continues_identically(built, test_sentences):
    _, _, lm = built
    for words in test_sentences:
        state = lm.begin_state()
        for word in [*words, "</s>"]:
            data = lm.state_bytes(state)
            assert isinstance(data, bytes) and len(lm.context_words(state)) <= lm.order - 1
            restored = lm.state_from_bytes(data)
            assert restored.kenlm == state.kenlm and restored.context == state.context
            logprob, state = lm.step(state, word)
            assert lm.step(restored, word)[0] == logprob
    assert lm.state_from_context(["a", "b", "w1", "w2"]).context == ("w1", "w2")  # only order - 1 words matter
    assert lm.state_from_bytes(b"").context == ()  # no context at all: KenLM's null context
    with pytest.raises(ValueError, match="not valid UTF-8"):
        lm.state_from_bytes(b"\xff")


def test_steps_after_context_words_add_up_to_the_sentence_score_at_order_4(tmp_path, test_sentences):
    """A decoder state carries only its context words: scoring after them, with the KenLM state rebuilt from the words
    (a fresh model) or kept from the step before (the same model), gives the sentence score. At order 4 the third
    token's context is ``<s>`` and a word, shorter than order - 1: it must keep both."""
    info = build_ngram(zipf_corpus(1000, seed=1), order=4, out=tmp_path / "lm4")
    kept = NgramLM(info["binary"])
    assert kept.context_after(("<s>",), "w1") == ("<s>", "w1")
    for words in test_sentences:
        for fresh in (True, False):
            context, total = ("<s>",), 0.0
            for word in [*words, "</s>"]:
                lm = NgramLM(info["binary"]) if fresh else kept
                total += float(lm.next_word_logprobs_after([context], [[word]])[0])
                context = lm.context_after(context, word)
            assert total == pytest.approx(kept.score(words), rel=1e-6, abs=1e-6)


def test_missing_or_unreadable_model_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nothere\.arpa: no n-gram model"):
        NgramLM(tmp_path / "nothere.arpa")
    bad = tmp_path / "bad.arpa"
    bad.write_text("hello world\n")
    with pytest.raises(NgramError, match=r"bad\.arpa: not a readable ARPA or KenLM binary"):
        NgramLM(bad)


def test_missing_binaries_say_how_to_get_them(tmp_path, monkeypatch):
    monkeypatch.setenv("LMSERVE_KENLM_BIN", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"LMSERVE_KENLM_BIN = .*: no executable lmplz there .*install-tools"):
        build_ngram([["a", "b"]], order=2, out=tmp_path / "lm")
    monkeypatch.delenv("LMSERVE_KENLM_BIN")
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(ngram, "source_checkout", lambda: None)  # as an installed package: no .cache/kenlm/bin
    with pytest.raises(FileNotFoundError, match=r"lmplz is not on PATH .*`lm-rescore ngram install-tools --dest DIR`"):
        build_ngram([["a", "b"]], order=2, out=tmp_path / "lm")
    assert list(tmp_path.iterdir()) == []


def test_tiny_text_fails_with_lmplz_words_unless_discount_fallback(tmp_path):
    tiny = [["a", "b", "c"], ["a", "b", "d"], ["b", "c", "a"]]
    with pytest.raises(NgramError, match=r"(?s)BadDiscountException.*discount_fallback=True"):
        build_ngram(tiny, order=3, out=tmp_path / "tiny")
    assert list(tmp_path.iterdir()) == []  # no half-written model
    info = build_ngram(tiny, order=3, out=tmp_path / "tiny.arpa", binary=False, discount_fallback=True)
    assert info["binary"] is None and info["ngrams"][0] == 7  # a b c d <s> </s> <unk>
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.arpa"]


def test_pruning_drops_singleton_ngrams(tmp_path, built):
    info = build_ngram(zipf_corpus(1000, seed=1), order=3, out=tmp_path / "pruned", prune=[0, 1, 1], binary=False)
    full = built[0]["ngrams"]
    assert info["ngrams"][0] == full[0] and info["ngrams"][1] < full[1] and info["ngrams"][2] < full[2]
    with pytest.raises(ValueError, match="prune"):
        build_ngram([["a"]], order=2, out=tmp_path / "x", prune=[1, 1])


def test_cli_builds_from_gzipped_text_and_queries(tmp_path, monkeypatch, capsys):
    text = tmp_path / "train.txt.gz"
    lines = [" ".join(s).upper() for s in zipf_corpus(1000, seed=1)]
    text.write_bytes(gzip.compress(("\n".join(lines) + "\n\n").encode()))
    out = tmp_path / "cli"
    assert main(["ngram", "build", "--order", "3", "--text", str(text), "--out", str(out), "--normalize", "lower"]) == 0
    assert '"sentences": 1000' in capsys.readouterr().out  # the blank line is no sentence

    lm = NgramLM(out.with_suffix(".bin"))
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"W1 w2\nw1 neverseen\n")))
    assert main(["ngram", "query", "--lm", str(out.with_suffix(".bin")), "--normalize", "lower"]) == 0
    captured = capsys.readouterr()
    rows = [line.split("\t") for line in captured.out.splitlines()]
    assert [int(r[2]) for r in rows] == [0, 1]
    for row, words in zip(rows, (["w1", "w2"], ["w1", "neverseen"]), strict=True):
        assert float(row[0]) == pytest.approx(lm.score(words), abs=1e-6)
        assert float(row[1]) == pytest.approx(lm.score(words) / math.log(10), abs=1e-6)
    assert "2 sentences, 6 tokens (with </s>), 1 OOV" in captured.err

    assert main(["ngram", "query", "--lm", str(tmp_path / "missing.bin")]) == 2
    assert "missing.bin: no n-gram model" in capsys.readouterr().err


def test_a_failing_sentence_source_leaves_no_model(tmp_path):
    def sentences():
        yield ["a", "b"]
        raise ValueError("train.txt:2: not valid UTF-8")

    with pytest.raises(ValueError, match="train.txt:2"):
        build_ngram(sentences(), order=2, out=tmp_path / "lm")
    assert list(tmp_path.iterdir()) == []


def test_unk_in_the_text_is_trained_and_the_model_still_sums_to_one(tmp_path):
    """lmplz refuses <unk> in its input: it goes in under a stand-in and is merged back into <unk>."""
    sentences = zipf_corpus(1000, seed=1)
    for words in sentences[::3]:
        words[len(words) // 2] = "<unk>"
    info = build_ngram(sentences, order=3, out=tmp_path / "unk")
    assert info["unk_tokens"] == len(sentences[::3])
    arpa_text = (tmp_path / "unk.arpa").read_text()
    assert "\x01" not in arpa_text and "<unk> w" in arpa_text  # n-grams with <unk> in them
    unigrams = arpa_text.split("\\1-grams:\n")[1].split("\n\n")[0].splitlines()
    vocab = [line.split("\t")[1] for line in unigrams]
    assert len(vocab) == info["ngrams"][0] == len(set(vocab)) and "<unk>" in vocab

    lm = NgramLM(info["binary"])
    assert lm.token_logprobs(["<unk>"])[0] > math.log(0.01)  # ~1 in 24 tokens, not the unseen-word leftover
    state = lm.begin_state()
    for word in ["w1", "<unk>", "w2"]:
        total = sum(math.exp(lm.step(state, w)[0]) for w in vocab if w != "<s>")
        assert total == pytest.approx(1.0, abs=1e-5)
        state = lm.step(state, word)[1]
