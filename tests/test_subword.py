"""Open vocabulary (``vocab.type = "subword"``) end to end on a generated corpus of made-up words that sentencepiece
spells in several pieces: prepare (the pieces spell the text back, offsets count pieces, the model is in the manifest
with its sha256), fit on text files, export (format 3 with the model inside, per-word perplexity), the bundle's
per-word scores against PyTorch's pieces summed per word (1e-4), n-best prefix sharing, decoder steps with
multi-piece candidate words, per-word interpolation with a word n-gram, and serving."""

import json
import shutil

import grpc
import numpy as np
import pytest
import torch
from conftest import make_sentences, sentence_batch, tiny_config_text, write_corpus, write_splits

from lmserve.core.bundle import Bundle, BundleError
from lmserve.rescoring.client import LMServeClient
from lmserve.rescoring.interpolated import InterpolatedLM, Step
from lmserve.rescoring.ngram import NgramLM, build_ngram
from lmserve.rescoring.scorer import EOS, Scorer
from lmserve.server.process import ServerProcess
from lmserve.training.checkpoint import load_model_for_eval, resolve_checkpoint
from lmserve.training.cli import main
from lmserve.training.export import SentencesGraph
from lmserve.training.prepared import PreparedDataError, PreparedDataset, VocabSettings, prepare

STEMS = ["walk", "talk", "jump", "play", "read", "build", "paint", "sing", "print", "count"]
AFFIXES = [("", ""), ("re", "ing"), ("un", "ed"), ("", "ers"), ("over", "s")]
PIECES = 300  # 256 byte pieces, the specials, the letters and a few merges: most words take several pieces


def made_up(sentence: str) -> str:
    """conftest's w0..w39 as words built from shared stems and affixes, so that they share pieces."""
    words = []
    for w in sentence.split():
        i = int(w[1:])
        prefix, suffix = AFFIXES[i // len(STEMS) % len(AFFIXES)]
        words.append(prefix + STEMS[i % len(STEMS)] + suffix)
    return " ".join(words)


def corpus_of(n: int, seed: int) -> list[str]:
    return [made_up(s) for s in make_sentences(n, seed=seed)]


# a word no training text has (spelled from known letters), one with characters never seen (byte pieces), the data's
# own <unk> token, and the empty sentence
SENTENCES = ["rewalking talkers", "unjumped zzqx playing", "", "naïve 日本 <unk> countering read", "sing"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A subword model trained on text files (fit prepares RUN/data), exported; (root, run dir, bundle)."""
    root = tmp_path_factory.mktemp("subword")
    corpus = write_splits(root, corpus_of)
    config = root / "subword.toml"
    config.write_text(
        tiny_config_text(
            corpus,
            "sentence",
            "adaptive",
            train={"epochs": 1},
            vocab={"type": "subword", "pieces": PIECES, "subword_model": "bpe"},
        )
    )
    assert main(["fit", str(config), "--out", str(root / "run")]) == 0
    assert main(["export", "--checkpoint", str(root / "run"), "--out", str(root / "bundle")]) == 0
    return root, root / "run", root / "bundle"


@pytest.fixture(scope="module")
def scorer(run):
    return Scorer(run[2], threads=1)


def test_prepare_spells_every_word_in_pieces_and_records_the_model(tmp_path):
    train = write_corpus(tmp_path / "train.txt", [*corpus_of(200, 1), "walk <unk> talk"])
    valid = write_corpus(tmp_path / "valid.txt", ["rewalking naïve", "", "<unk>"])
    settings = VocabSettings(type="subword", pieces=PIECES, subword_model="unigram")
    manifest = prepare({"train": [train], "valid": [valid]}, tmp_path / "data", settings, workers=0, block_bytes=512)
    dataset = PreparedDataset(tmp_path / "data")
    model = manifest["vocab"]["subword"]
    assert manifest["vocab"]["type"] == "subword" and (tmp_path / "data" / model["file"]).is_file()
    assert dataset.vocab.tokens[:3] == ["<unk>", "<s>", "</s>"] and len(dataset.vocab) == model["pieces"]
    counts = dataset.vocab.counts[3:]
    assert counts == sorted(counts, reverse=True)  # pieces by descending training count, as words are
    valid_split = dataset.split("valid")
    spelled = [[dataset.vocab.tokens[i] for i in valid_split.sentence(k)] for k in range(valid_split.num_sentences)]
    # a word's pieces concatenate to "▁" + the word; unseen characters as UTF-8 bytes; the text's <unk> stays <unk>
    assert "".join(spelled[0]).startswith("▁rewalking▁") and "<0xC3>" in spelled[0]
    assert spelled[1] == [] and spelled[2] == ["<unk>"]
    assert manifest["splits"]["valid"]["words"] == 3 and manifest["splits"]["valid"]["pieces"] == len(valid_split.ids)
    assert valid_split.text_words == 3 and valid_split.oov == 1  # only the text's own <unk>
    train_split = dataset.split("train")
    first = "".join(dataset.vocab.tokens[i] for i in train_split.sentence(0))
    assert first == "▁" + corpus_of(200, 1)[0].replace(" ", "▁")
    # again: nothing to do; a replaced model is caught by its sha256
    again = prepare({"train": [train], "valid": [valid]}, tmp_path / "data", settings, workers=0)
    assert again == manifest
    (tmp_path / "data" / model["file"]).write_bytes(b"not a model")
    with pytest.raises(PreparedDataError, match="subword.model: sha256"):
        PreparedDataset(tmp_path / "data")


def test_prepare_refuses_a_vocabulary_file_with_subwords(tmp_path):
    train = write_corpus(tmp_path / "train.txt", corpus_of(20, 1))
    with pytest.raises(ValueError, match="no vocabulary file"):
        prepare({"train": [train]}, tmp_path / "d", VocabSettings(file=str(train), type="subword"), workers=0)


def test_export_ships_the_model_and_reports_perplexity_per_word(run, capsys):
    root, run_dir, path = run
    bundle = Bundle.load(path)
    assert bundle.manifest["format_version"] == 3 and bundle.subword_model.name == "subword.model"
    assert bundle.manifest["vocab"]["type"] == "subword" and "subword.model" in bundle.manifest["files"]
    held = bundle.manifest["heldout"]
    assert held["max_abs_diff"] <= 1e-4
    # the same log-probability over fewer events: words and </s> instead of pieces and </s>
    assert held["words"] < held["tokens"] and held["ppl_per_word"] > held["ppl"]
    assert np.log(held["ppl_per_word"]) * held["words"] == pytest.approx(np.log(held["ppl"]) * held["tokens"])
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(run_dir), "--file", str(root / "valid.txt"), "--mode", "sentence"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["ppl_per_word"] == pytest.approx(held["ppl_per_word"], rel=1e-5)


def test_a_checkpoint_copied_out_of_its_run_carries_its_sentencepiece_model(run, tmp_path, capsys):
    """Out of its run, nothing leads to the prepared dataset (RUN/data) the pieces were learnt into."""
    root, run_dir, path = run
    ckpt = tmp_path / "ckpt"
    shutil.copytree(resolve_checkpoint(run_dir), ckpt)
    valid = str(root / "valid.txt")
    assert main(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "bundle"), "--heldout", valid]) == 0
    assert (tmp_path / "bundle" / "subword.model").read_bytes() == (path / "subword.model").read_bytes()
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(ckpt), "--file", valid, "--mode", "sentence"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["ppl_per_word"] > 1
    (ckpt / "subword.model").unlink()
    assert main(["eval", "--checkpoint", str(ckpt), "--file", valid, "--mode", "sentence"]) == 2
    assert "without its sentencepiece model subword.model" in capsys.readouterr().err


def test_bundle_validation_names_the_subword_fields(run, tmp_path):
    import shutil

    copy = tmp_path / "bundle"
    shutil.copytree(run[2], copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    del manifest["vocab"]["subword_model"]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="subword_model"):
        Bundle.load(copy)
    manifest["vocab"]["subword_model"] = "subword.model"
    manifest["format_version"] = 2
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="format_version 2"):
        Bundle.load(copy)


def pytorch_word_scores(run_dir, scorer: Scorer, texts: list[str]) -> list[np.ndarray]:
    """PyTorch's piece scores of each sentence, summed per word as the subword model defines a word's score."""
    _, _, model = load_model_for_eval(run_dir)
    model.eval()
    encoded = [scorer.encode(t) for t in texts]
    inputs, targets, lengths = sentence_batch([ids for _, ids, _ in encoded])
    with torch.no_grad():
        pieces = SentencesGraph(model, False)(*map(torch.from_numpy, (inputs, targets, lengths))).numpy()
    out = []
    for row, (words, ids, _) in enumerate(encoded):
        starts = np.cumsum([0] + [len(scorer.pieces.spell(w)) for w in words])
        per_word = [pieces[row, starts[w] : starts[w + 1]].sum(dtype=np.float64) for w in range(len(words))]
        out.append(np.array([*per_word, pieces[row, len(ids)]]))
    return out


def test_per_word_scores_match_pytorch(run, scorer):
    got = scorer.score(SENTENCES)
    want = pytorch_word_scores(run[1], scorer, SENTENCES)
    for text, score, expected in zip(SENTENCES, got, want, strict=True):
        assert score.words == text.split() and len(score.token_logprobs) == len(score.words) + 1
        np.testing.assert_allclose(score.token_logprobs, expected, atol=1e-4, rtol=0)
    assert [s.oov for s in got] == [0, 0, 0, 1, 0]  # only the text's own <unk>
    assert len(scorer.encode("unjumped zzqx")[1]) > 2  # several pieces per word: the test tests something


@pytest.mark.parametrize("tails", [False, True])
def test_nbest_prefix_sharing_gives_the_same_per_word_scores(run, tails):
    """Stepped through the shared prefix trees, and with each hypothesis' own tail through the sentences graph."""
    scorer = Scorer(run[2], threads=1)
    if tails:
        scorer.tails_min_batches = 0  # tails however few lists there are
    lists = [["rewalking talkers", "rewalking talker", "rewalking", "rewalk talkers"], ["sing", "singing", ""]]
    shared = scorer.score_nbest(lists)
    for hyps, scores in zip(lists, shared, strict=True):
        for alone, score in zip(scorer.score(hyps), scores, strict=True):
            assert score.words == alone.words
            np.testing.assert_allclose(score.token_logprobs, alone.token_logprobs, atol=1e-4)


@pytest.fixture(scope="module")
def ngram(run):
    root = run[0]
    build_ngram((s.split() for s in corpus_of(300, 1)), 3, root / "words3", discount_fallback=True)
    return NgramLM(root / "words3.bin")


def test_next_words_with_multi_piece_candidates_add_up_to_the_sentence(scorer, ngram):
    lm = InterpolatedLM(scorer, ngram, 0.4)
    for text, whole in zip(SENTENCES, lm.score(SENTENCES), strict=True):
        state, neural, interpolated = b"", 0.0, 0.0
        for word in [*text.split(), "</s>"]:
            # the word among candidates that share its first pieces, and a candidate of bytes only
            candidates = [word, word + "ing", "日", "</s>"] if word != "</s>" else [word, "walk"]
            steps = lm.next_words(state, candidates)
            assert [s.word for s in steps] == candidates and not any(s.oov for s in steps)
            step = steps[0]
            neural += step.neural
            interpolated += step.interpolated
            state = step.state
        assert neural == pytest.approx(float(whole.neural.sum()), abs=1e-4)
        assert interpolated == pytest.approx(float(whole.interpolated.sum()), abs=1e-4)
        # the n-gram sees the words themselves (an open vocabulary has no <unk> to map them to)
        assert whole.ngram.tolist() == pytest.approx(ngram.token_logprobs(text.split()).tolist())
    with pytest.raises(ValueError, match="open-vocabulary"):
        lm.next_words(b"")


def test_candidate_scores_are_the_step_graph_piece_by_piece(scorer):
    """One candidate word's score is its pieces' step scores from the state, each piece read in turn."""
    pieces = scorer.pieces.spell("unjumped")
    assert len(pieces) >= 3
    h, c = scorer.zero_state(1)
    prev, want = 1, 0.0
    for piece in pieces:
        scores, h, c = scorer.next_word_scores(np.array([prev]), h, c, np.array([[piece]]))
        want += float(scores[0, 0])
        prev = piece
    total, last, _, _ = scorer.score_continuations(1, *(x[:, 0] for x in scorer.zero_state(1)), [pieces, (EOS,)])
    assert total[0] == pytest.approx(want, abs=1e-5) and last.tolist() == [pieces[-1], EOS]


def test_batched_steps_score_multi_piece_words_as_single_steps(scorer, ngram):
    """next_words_batch: the prefix trees of several states advance together, one step run per piece depth."""
    lm = InterpolatedLM(scorer, ngram, 0.4)
    first = lm.next_words(b"", ["rewalking", "sing"])
    items = [(b"", ["unjumped", "unjumping", "</s>"]), (first[0].state, ["talkers"]), (first[1].state, ["日", "sing"])]
    batched = lm.next_words_batch([Step(state, words) for state, words in items])
    for (state, words), got in zip(items, batched, strict=True):
        for a, b in zip(got, lm.next_words(state, words), strict=True):
            assert a.word == b.word and a.neural == pytest.approx(b.neural, abs=1e-5)
            assert a.interpolated == pytest.approx(b.interpolated, abs=1e-5)
            after_a, after_b = (lm.next_words(x.state, ["</s>"])[0].neural for x in (a, b))
            assert after_a == pytest.approx(after_b, abs=1e-5)


def test_serving_a_subword_model(run, ngram):
    root, _, bundle = run
    config = root / "serve.toml"
    config.write_text(
        f'[server]\nworkers = 1\nmetrics_port = -1\n\n[models.sub]\nbundle = "{bundle}"\n'
        f'ngram = "words3.bin"\nlambda = 0.4\n'
    )
    local = InterpolatedLM(Scorer(bundle, threads=1), ngram, 0.4)
    with ServerProcess(config, root / "serve.log") as server, LMServeClient(server.address, timeout=30) as client:
        served = client.score_sentences(SENTENCES, "sub", per_token=True).sentences
        for text, got, want in zip(SENTENCES, served, local.score(SENTENCES), strict=True):
            assert list(got.tokens) == [*text.split(), "</s>"]
            assert got.neural.logprob == pytest.approx(float(want.neural.sum()), abs=1e-4)
            assert list(got.neural.token_logprobs) == pytest.approx(want.neural.tolist(), abs=1e-4)
            assert got.interpolated.logprob == pytest.approx(float(want.interpolated.sum()), abs=1e-4)
        state, total = b"", 0.0
        for word in ["unjumped", "zzqx", "</s>"]:
            steps = client.score_next_words([word, "overprinting"], state, "sub").words
            assert steps[0].word == word and not steps[0].oov
            total, state = total + steps[0].neural, steps[0].state
        (alone,) = client.score_sentences(["unjumped zzqx"], "sub").sentences
        assert total == pytest.approx(alone.neural.logprob, abs=1e-4)
        with pytest.raises(grpc.RpcError) as info:  # no word list to rank: candidates are needed
            client.score_next_words([], b"", "sub", top_k=3)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "open-vocabulary" in info.value.details()


def test_fit_on_a_prepared_subword_dataset_reads_text_splits_in_pieces(tmp_path, capsys):
    """data.train a prepared subword dataset, data.valid a text file: the text is spelled with the dataset's model
    (as eval and export spell it), not looked up as words among the pieces."""
    train = write_corpus(tmp_path / "train.txt", corpus_of(200, 1))
    valid = write_corpus(tmp_path / "valid.txt", corpus_of(30, 2))
    prepare({"train": [train]}, tmp_path / "data", VocabSettings(type="subword", pieces=PIECES), workers=0)
    corpus = {"train": tmp_path / "data", "valid": valid, "test": valid}
    config = tmp_path / "c.toml"
    config.write_text(
        tiny_config_text(corpus, "sentence", "full", train={"epochs": 1}, vocab={"type": "subword", "pieces": PIECES})
    )
    assert main(["fit", str(config), "--out", str(tmp_path / "run")]) == 0
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["valid_oov_rate"] == 0.0
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(tmp_path / "run"), "--file", str(valid), "--mode", "sentence"]) == 0
    evaluated = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert evaluated["tokens"] == results["valid"]["tokens"]
    assert evaluated["ppl"] == pytest.approx(results["valid"]["ppl"], rel=1e-5)
    assert evaluated["words"] == 30 + sum(len(s.split()) for s in corpus_of(30, 2))
