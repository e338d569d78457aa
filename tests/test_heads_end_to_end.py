"""Differentiated softmax, CNN-softmax, clustered slim and the char-CNN head, target sampling and adaptive IS from
training to serving: each trains one epoch on the generated corpus and exports (held-out parity |ONNX - PyTorch|
<= 1e-4, checked by export itself); the torch-free scorer matches PyTorch on every graph; lm-serve serves every bundle
and ScoreNextWords steps add up to ScoreSentences; and a char-CNN bundle scores words outside its vocabulary from
their spelling, in the scorer, `lm-rescore score --open-vocab` and lm-serve's ScoreSentences and RescoreNBest
(``open_vocab = true``), matching PyTorch."""

import json

import numpy as np
import pytest
import torch
from conftest import (
    fit_and_export,
    head_overrides,
    running_lm_serve,
    sentence_batch,
    tiny_config_text,
    write_splits,
)

from lmserve.core.bundle import Bundle, BundleError, validate_manifest
from lmserve.rescoring.client import LMServeClient
from lmserve.rescoring.commands.cli import main as rescore_main
from lmserve.rescoring.nbest import Hypothesis, NBestEntry, NBestList
from lmserve.rescoring.rescore import LanguageModels, Setup, reranked
from lmserve.rescoring.scorer import Scorer
from lmserve.training.checkpoint import load_model_for_eval
from lmserve.training.cli import main
from lmserve.training.export import OpenSentencesGraph, SentencesGraph, StepGraph
from lmserve.training.heads.charcnn import PAD, spell

CHARS = {"charcnn_size": 8, "charcnn_widths": [1, 2]}
# name -> (head settings, objective settings, self-normalised); "{runs}" is this module's run folder
ROWS = {
    "full": ({"type": "full", "bias_init": "unigram"}, {}, False),
    "dsoftmax": (
        {"type": "dsoftmax", "cutoffs": [10, 25], "band_widths": [8, 5, 3], "bias_init": "unigram"},
        {},
        False,
    ),
    "dsoftmax-ts": (
        {
            "type": "dsoftmax",
            "cutoffs": [10, 25],
            "band_widths": [16, 6, 3],
            "band_layout": "nested",
            "bias_init": "unigram",
        },
        {"type": "target_sampling", "samples": 10},
        True,
    ),
    "full-ais": (
        {"type": "full", "bias_init": "unigram"},
        {"type": "adaptive_importance_sampling", "samples": 10, "adapt_rate": 0.1},
        True,
    ),
    "cnnsoftmax": ({"type": "cnnsoftmax", "correction_size": 4, **CHARS}, {}, False),
    "cnnsoftmax-is": (
        {"type": "cnnsoftmax", "correction_size": 4, "bias_init": "unigram", **CHARS},
        {"type": "importance_sampling", "samples": 10},
        True,
    ),
    "charcnn": ({"type": "charcnn", **CHARS}, {}, False),
    "slim-clustered": (
        {"type": "slim", "slim_subvectors": 4, "slim_pool": 32, "slim_embeddings": "{runs}/full"},
        {},
        False,
    ),
}
SPELLING = ("cnnsoftmax", "cnnsoftmax-is", "charcnn")
SENTENCES = ["w1 w2 w3", "", "w5 w77 w7 w7", "w0 w3 w1 w4 w2 w9 w11", "w12 zzz é w3 w99x"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("head_bundles")
    corpus = write_splits(root)
    made = {}
    for name, (head, objective, _) in ROWS.items():
        text = tiny_config_text(corpus, "sentence", head["type"], train={"epochs": 1}, objective=objective)
        made[name] = fit_and_export(root, name, text, head_overrides(head, root))
    return made


def torch_model(run):
    _, vocab, model = load_model_for_eval(run)
    model.eval()
    model.head = model.head.frozen()
    return vocab, model


@pytest.mark.parametrize("name", list(ROWS))
def test_export_parity_and_the_scorer_match_pytorch(exported, name):
    run, path = exported[name]
    head, _, self_normalised = ROWS[name]
    bundle = Bundle.load(path)
    assert bundle.manifest["head"] == head["type"] and bundle.normalised is (not self_normalised)
    assert bundle.spells is (name in SPELLING)
    assert bundle.manifest["heldout"]["max_abs_diff"] <= 1e-4
    vocab, model = torch_model(run)
    scorer = Scorer(bundle, threads=1)
    ids = [[vocab.index.get(w, 0) for w in s.split()] for s in SENTENCES]
    inputs, targets, lengths = sentence_batch(ids)
    with torch.no_grad():
        want = SentencesGraph(model, self_normalised)(*map(torch.from_numpy, (inputs, targets, lengths))).numpy()
    for row, got in enumerate(scorer.score(SENTENCES)):
        np.testing.assert_allclose(got.token_logprobs, want[row, : lengths[row]], atol=1e-4, rtol=0)
    # the decoder graphs: candidates and the whole vocabulary
    layers, hidden = bundle.manifest["model"]["layers"], bundle.manifest["model"]["hidden_size"]
    h = np.random.default_rng(0).normal(size=(layers, 3, hidden)).astype(np.float32)
    c = np.random.default_rng(1).normal(size=(layers, 3, hidden)).astype(np.float32)
    prev, candidates = np.array([1, 5, 9]), np.array([[3, 4], [2, 40], [0, 11]])
    step = scorer.next_word_scores(prev, h, c, candidates)
    full = scorer.next_word_scores(prev, h, c)
    with torch.no_grad():
        t = [torch.from_numpy(x) for x in (prev, h, c, candidates)]
        want_step = StepGraph(model, self_normalised, full=False)(*t)
        want_full = StepGraph(model, self_normalised, full=True)(*t[:3])
    for a, b in zip([*step, *full], [*want_step, *want_full], strict=True):
        np.testing.assert_allclose(a, b.numpy(), atol=1e-4, rtol=0)
    if not self_normalised:
        np.testing.assert_allclose(np.logaddexp.reduce(full[0], axis=1), 0, atol=1e-4)


@pytest.mark.parametrize("name", SPELLING)
def test_words_outside_the_vocabulary_are_scored_from_their_spelling(exported, name):
    run, path = exported[name]
    self_normalised = ROWS[name][2]
    vocab, model = torch_model(run)
    plain, scorer = Scorer(path, threads=1), Scorer(path, threads=1, open_vocab=True)
    speller = model.head.speller()
    width = speller.max_chars + 2
    ids = [[vocab.index.get(w, 0) for w in s.split()] for s in SENTENCES]
    inputs, targets, lengths = sentence_batch(ids)
    chars = np.full((*targets.shape, width), PAD, dtype=np.int64)
    for row, sentence in enumerate(SENTENCES):
        for t, word in enumerate(sentence.split()):
            if word not in vocab.index:
                spelled = spell(word, speller.inventory, speller.max_chars)
                chars[row, t, : len(spelled)] = spelled
                assert scorer.spell(word) == spelled  # the scorer spells as the head does, without torch
    with torch.no_grad():
        zeros = torch.zeros(model.lstm.num_layers, len(SENTENCES), model.lstm.hidden_size)
        arrays = (inputs, targets, lengths)
        want = OpenSentencesGraph(model, self_normalised)(
            *map(torch.from_numpy, arrays), zeros, zeros, torch.from_numpy(chars)
        )
    opened, closed = scorer.score(SENTENCES), plain.score(SENTENCES)
    for row, (got, unk) in enumerate(zip(opened, closed, strict=True)):
        np.testing.assert_allclose(got.token_logprobs, want.numpy()[row, : lengths[row]], atol=1e-4, rtol=0)
        unknown = [t for t, w in enumerate(got.words) if w not in vocab.index]
        assert got.oov == unk.oov == got.spelled == len(unknown)
        known = np.setdiff1d(np.arange(len(got.token_logprobs)), unknown)
        np.testing.assert_allclose(got.token_logprobs[known], unk.token_logprobs[known], atol=1e-5, rtol=0)
        assert np.all(got.token_logprobs[unknown] != unk.token_logprobs[unknown])
    # hypothesis lists: those with unknown words go through the open graph whole, the rest share prefixes
    lists = [["w1 w2 w3", "w1 w77 w3", "w1 zzz w3", "w1 w2"], ["w5 zzz w7", "w5 w7"], ["é"]]
    for by_list, hyps in zip(scorer.score_nbest(lists), lists, strict=True):
        for got, want_one in zip(by_list, scorer.score(hyps), strict=True):
            np.testing.assert_allclose(got.token_logprobs, want_one.token_logprobs, atol=1e-5, rtol=0)
            assert got.spelled == want_one.spelled


def test_a_sampled_model_exported_exact_scores_words_and_spellings_normalised(exported, tmp_path):
    run = exported["cnnsoftmax-is"][0]
    assert main(["export", "--checkpoint", str(run), "--out", str(tmp_path / "exact"), "--exact"]) == 0
    bundle = Bundle.load(tmp_path / "exact")
    held = bundle.manifest["heldout"]
    assert bundle.normalised and held["score_ppl"] == pytest.approx(held["ppl"], rel=1e-4)
    assert held["open_max_abs_diff"] <= 1e-4
    scorer = Scorer(bundle, threads=1, open_vocab=True)
    layers, hidden = bundle.manifest["model"]["layers"], bundle.manifest["model"]["hidden_size"]
    h, c = (np.zeros((layers, 1, hidden), dtype=np.float32),) * 2
    table = scorer.next_word_scores(np.array([1]), h, c)[0][0]
    got = scorer.score(["zzz"])[0].token_logprobs
    assert got[0] < 0 and np.logaddexp.reduce(table) == pytest.approx(0, abs=1e-4)  # a distribution, spelled or not


def test_open_vocab_needs_a_bundle_that_spells(exported):
    with pytest.raises(BundleError, match="open_vocab needs a bundle that spells words .* head is 'dsoftmax'"):
        Scorer(exported["dsoftmax"][1], threads=1, open_vocab=True)
    manifest = json.loads((exported["charcnn"][1] / "manifest.json").read_text())
    del manifest["spelling"]
    with pytest.raises(BundleError, match="'spelling' and graphs.sentences_open go together"):
        validate_manifest(manifest, "m.json")


def test_lm_rescore_score_with_open_vocab(exported, tmp_path, capsys):
    path = exported["cnnsoftmax"][1]
    text = tmp_path / "in.txt"
    text.write_text("\n".join(SENTENCES) + "\n")
    assert rescore_main(["score", "--lm", str(path), "--input", str(text), "--format", "jsonl", "--open-vocab"]) == 0
    out = capsys.readouterr()
    records = [json.loads(line) for line in out.out.splitlines()]
    want = Scorer(path, threads=1, open_vocab=True).score(SENTENCES)
    assert [r["logprob"] for r in records] == pytest.approx([s.logprob for s in want], abs=1e-4)
    assert [r["spelled"] for r in records] == [0, 0, 1, 0, 3] and "4 OOV words spelled" in out.err


# -- lm-serve ------------------------------------------------------------------------------------------------------

SERVED = ("dsoftmax", "dsoftmax-ts", "full-ais", "cnnsoftmax", "cnnsoftmax-is", "charcnn", "slim-clustered")


@pytest.fixture(scope="module")
def served(exported, tmp_path_factory):
    root = tmp_path_factory.mktemp("head_serve")
    tables = [f'[models.{name}]\nbundle = "{exported[name][1]}"\n' for name in SERVED]
    tables.append(f'[models.open]\nbundle = "{exported["cnnsoftmax"][1]}"\nopen_vocab = true\n')
    with running_lm_serve(root, "[server]\nworkers = 2\n\n" + "\n".join(tables)) as server:
        with LMServeClient(server.address, timeout=30) as client:
            yield client


@pytest.mark.parametrize("model", SERVED)
def test_served_next_word_steps_add_up_to_the_sentence_score(served, model):
    for sentence, text in zip(served.score_sentences(SENTENCES, model).sentences, SENTENCES, strict=True):
        state, total = b"", 0.0
        for word in [*text.split(), "</s>"]:
            (step,) = served.score_next_words([word], state, model).words
            total += step.neural
            state = step.state
        assert total == pytest.approx(sentence.neural.logprob, abs=1e-4)


def test_served_open_vocab_scores_and_rescores_with_spellings(served, exported):
    path = exported["cnnsoftmax"][1]
    want = Scorer(path, threads=1, open_vocab=True).score(SENTENCES)
    unk = Scorer(path, threads=1).score(SENTENCES)
    got = served.score_sentences(SENTENCES, "open").sentences
    closed = served.score_sentences(SENTENCES, "cnnsoftmax").sentences
    for g, c, w, u in zip(got, closed, want, unk, strict=True):
        assert g.neural.logprob == pytest.approx(w.logprob, abs=1e-4)
        assert c.neural.logprob == pytest.approx(u.logprob, abs=1e-4)
    assert got[4].neural.logprob != pytest.approx(closed[4].neural.logprob, abs=1e-3)
    entries = [
        NBestEntry(f"u{i}", [Hypothesis(t, {"am": -float(k)}) for k, t in enumerate(hyps)], [hyps[0]])
        for i, hyps in enumerate([["w1 w2 w3", "w1 w77 w3", "w1 zzz w3"], ["w5 zzz w7", "w5 w7", "w5 w7 w7"]])
    ]
    weights = {"am": 1.0, "neural": 0.5}
    result = served.rescore_nbest(entries, "open", weights=weights)
    lms = LanguageModels.load(path, None, open_vocab=True)
    setup = Setup.parse("am,neural")
    setup.weights = weights
    expected, _ = reranked(NBestList(entries), setup, lms.scores(NBestList(entries)))
    for got_list, want_list in zip(result.lists, expected, strict=True):
        assert [h.text for h in got_list.hypotheses] == [h.text for h in want_list.hypotheses]
        for h, e in zip(got_list.hypotheses, want_list.hypotheses, strict=True):
            assert h.features["neural"] == pytest.approx(e.features["neural"], abs=1e-4)
