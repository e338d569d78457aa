"""lmserve's LMs inside real decoders: pyctcdecode and flashlight-text (torchaudio's decoder where it exists), each
with a local bundle and with lm-serve (batch calls, a stream, cached states), on synthetic emissions of tiny-model
sentences. The adapter's summed LM score of the decoded path equals ``lm-rescore score`` (the scorer) of the decoded
sentence, a beam step is one LM call, a word is scored at its boundary only (character and subword-piece decoders),
and the faults: a server stopped mid-decode is an error naming its address, or with a fallback n-gram a warning (once)
and a finished decode; a reload mid-decode keeps the states (same bundle) or refuses them (FAILED_PRECONDITION).

The decoders are optional (``pip install -e '.[decoders]'``, and pyctcdecode beside it with ``--no-deps``: the
extra's comment in pyproject.toml says why; ``make test`` installs both): their tests skip, saying so, where a package
is missing."""

import contextlib
import gc
import logging
import math
import weakref

import numpy as np
import pytest
from conftest import make_sentences

from benchmarks.synthetic_ctc import Channel, clean_emissions
from lmserve.rescoring.client import LMServeClient
from lmserve.rescoring.decoders.lm import DecoderLM, LMServeError, logaddexp
from lmserve.rescoring.interpolated import InterpolatedLM
from lmserve.rescoring.ngram import NgramLM, build_ngram
from lmserve.rescoring.scorer import Scorer
from lmserve.server.process import ServerProcess

pyctcdecode = pytest.importorskip(
    "pyctcdecode",
    reason="pyctcdecode is not installed (pip install --no-deps pyctcdecode==0.5.0; make test installs it)",
)
from lmserve.rescoring.decoders.pyctcdecode_lm import (  # noqa: E402
    BatchedBeamSearchDecoderCTC,
    LMServeLanguageModel,
    build_ctcdecoder,
)

LAMBDA = 0.4
LABELS = ["", " ", "w", *"0123456789"]
SENTENCES = ["w1 w2 w3", "w5 w7 w7", "w0 w3 w1 w4 w2 w9 w11", "w12"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("decoders")
    build_ngram((s.split() for s in make_sentences(300, seed=1)), 3, root / "train3", discount_fallback=True)
    return root


@pytest.fixture(scope="module")
def bundle(bundles):
    return bundles[("full", 0.0)][1]


@pytest.fixture(scope="module")
def local(bundle):
    return DecoderLM.local(bundle)


@pytest.fixture(scope="module")
def engine(bundle, root):
    return InterpolatedLM(Scorer(bundle, threads=1), NgramLM(root / "train3.bin"), LAMBDA)


def write_config(root, bundle, name="serve.toml"):
    path = root / name
    path.write_text(
        "[server]\nworkers = 1\nadmin = true\n[state_cache]\nmax_mb = 4.0\n"
        f'[models.exact]\nbundle = "{bundle}"\nngram = "train3.bin"\nlambda = {LAMBDA}\n'
        f'[models.plain]\nbundle = "{bundle}"\n'
    )
    return path


@pytest.fixture(scope="module")
def server(root, bundle):
    with ServerProcess(write_config(root, bundle), root / "server.log") as server:
        yield server
        assert server.stop() == 0


def sentence_logprob(engine: InterpolatedLM, text: str, interpolated: bool = False) -> float:
    (scores,) = engine.score([text])
    return float((scores.interpolated if interpolated else scores.neural).sum())


# -- pyctcdecode ------------------------------------------------------------------------------------------------


def decode_path(decoder, emissions, beam_width=16):
    """The best beam's text and its last LM state (pyctcdecode keeps it: the state after the last word and </s>)."""
    text, state, *_ = decoder.decode_beams(emissions, beam_width=beam_width)[0]
    return text, state


def test_pyctcdecode_decodes_with_a_local_bundle_and_its_lm_scores_add_up(local, engine):
    decoder = build_ctcdecoder(LABELS, local, alpha=0.5, beta=1.0)
    assert isinstance(decoder, BatchedBeamSearchDecoderCTC)
    for text in SENTENCES:
        got, state = decode_path(decoder, clean_emissions(text, LABELS))
        assert got == text and state.ended and state.words == len(text.split())
        assert state.neural == pytest.approx(sentence_logprob(engine, text), abs=1e-4)
        assert state.logprob == pytest.approx(state.neural, abs=1e-9)  # no n-gram: logprob is the neural score


@pytest.mark.parametrize("ngram", [False, True], ids=["neural", "interpolated"])
@pytest.mark.parametrize("hotwords", [None, ["w3 w12", "w7"]], ids=["no-hotwords", "hotwords"])
def test_a_beam_step_is_one_lm_call_and_decodes_as_pyctcdecode_alone(bundle, root, hotwords, ngram):
    """The batched decoder gives pyctcdecode's own answer with the same LM, in fewer calls, scoring fewer words: not
    those of beams that the step's pruning drops whatever their scores (with an n-gram, bounded by it). Hotwords
    count as in pyctcdecode (without them, the batched decoder skips their scorer, whose scores are all 0)."""
    rng = np.random.default_rng(3)
    channel = Channel(sub=0.15, dropped=0.05, ins=0.05)
    utterances = [channel.emissions(text, LABELS, rng) for text in SENTENCES]
    results, calls = {}, {}
    for name, make in (("batched", BatchedBeamSearchDecoderCTC), ("plain", pyctcdecode.BeamSearchDecoderCTC)):
        lm = DecoderLM.local(bundle, root / "train3.bin", LAMBDA) if ngram else DecoderLM.local(bundle)
        decoder = make(pyctcdecode.Alphabet.build_alphabet(LABELS), LMServeLanguageModel(lm, alpha=0.8, beta=0.5))
        results[name] = [decoder.decode_beams(e, beam_width=8, hotwords=hotwords)[:3] for e in utterances]
        calls[name] = (lm.calls, lm.pairs)
    for batched, plain in zip(results["batched"], results["plain"], strict=True):
        assert [b[0] for b in batched] == [p[0] for p in plain]
        assert [b[-1] for b in batched] == pytest.approx([p[-1] for p in plain], abs=1e-4)
    assert calls["batched"][1] < calls["plain"][1]  # fewer (state, word) pairs scored ...
    assert calls["batched"][0] < calls["plain"][0] / 2, calls  # ... in fewer LM calls
    assert calls["plain"][0] >= calls["plain"][1], calls  # (alone: a call per pair, two for a last word and </s>)


def test_the_lm_repairs_what_the_channel_broke(local):
    """w1 w2 w3 with every character's greedy choice wrong for a third of the text: the LM finds the words."""
    rng = np.random.default_rng(7)
    channel = Channel(sub=0.3, dropped=0.0, ins=0.0, peak=0.5, second=0.45)
    texts = make_sentences(12, seed=5)
    emissions = [channel.emissions(t, LABELS, rng) for t in texts]
    plain = build_ctcdecoder(LABELS)
    fused = build_ctcdecoder(LABELS, local, alpha=1.0, beta=2.0)

    def errors(decoder):
        return sum(decoder.decode(e, beam_width=16).split() != t.split() for e, t in zip(emissions, texts, strict=True))

    assert errors(fused) < errors(plain)


def test_partial_words_and_oov_words(local):
    lm = LMServeLanguageModel(local, alpha=1.0, beta=0.0, unk_score_offset=-10.0)
    assert lm.score_partial_token("w1") == 0.0 and lm.score_partial_token("") == 0.0
    assert lm.score_partial_token("x") == -10.0  # no vocabulary word starts so
    assert lm.score_partial_token("w1234567") == pytest.approx(-10.0 * 8 / 6)  # scaled past 6 characters, as KenLM's
    start = lm.get_start_state()
    known, _ = lm.score(start, "w1")
    unknown, state = lm.score(start, "w99")
    assert state.word_oov and unknown == pytest.approx(state.word_logprob - 10.0)  # scored as <unk>, plus the offset
    assert not lm.score(start, "w1")[1].word_oov and known == lm.score(start, "w1")[0]  # memoised


def test_a_word_not_spelled_as_written_is_out_of_the_vocabulary(bundle):
    """Normalisation that drops characters: the LM reads "'w1" as w1, but the transcript would keep the apostrophe,
    so the decoder pays the offset for it, as KenLM's decoder does for a word outside its unigrams."""
    from lmserve.core.textnorm import TextNormalizer

    local = DecoderLM.local(bundle)
    local.normalizer = TextNormalizer(hyphens="split", punctuation="strip")
    lm = LMServeLanguageModel(local, alpha=1.0, beta=0.5, unk_score_offset=-10.0)
    start = lm.get_start_state()
    written, plain = local.score(start, "'w1")[1], local.score(start, "w1")[1]
    assert written.word_logprob == plain.word_logprob and written.history() == ["w1"]  # the same LM score
    assert written.word_oov and not plain.word_oov
    assert lm.score(start, "'w1")[0] == pytest.approx(lm.score(start, "w1")[0] - 10.0)
    assert local.score(start, "w1-w2")[1].word_oov  # read as w1 w2; written with its hyphen
    punctuation = lm.score(start, "!!")
    assert punctuation[1].word_tokens == 0 and punctuation[0] == -10.0  # nothing read, no beta, the offset
    assert lm.score_partial_token("'w") == -10.0 and lm.score_partial_token("w") == 0.0  # prefixes as written


@contextlib.contextmanager
def words_asked(local):
    """The words ``local`` is asked to score inside the block, in order ("" for </s>)."""
    asked = []
    original = local.score_many

    def spy(pairs, keep=True):
        asked.extend(word for _, word, _ in pairs)
        return original(pairs, keep)

    local.score_many = spy
    try:
        yield asked
    finally:
        del local.score_many


def piece_emissions(pieces: list[str], labels: list[str]) -> np.ndarray:
    """CTC log-probabilities that spell ``pieces`` one a frame, each frame followed by a blank (label 0), at 0.98."""
    emissions = np.full((2 * len(pieces), len(labels)), np.log(0.02 / (len(labels) - 1)), dtype=np.float32)
    for k, piece in enumerate(pieces):
        emissions[2 * k, labels.index(piece)] = np.log(0.98)
        emissions[2 * k + 1, 0] = np.log(0.98)
    return emissions


def test_subword_piece_labels_are_scored_at_word_boundaries_only(local, engine):
    """A BPE-style alphabet ("▁" starts a word): the LM is asked for whole words and </s>, never for pieces."""
    labels = ["", "▁w", "▁w1", "0", "1", "2", "3", "4", "5", "6", "7", "8", "9"]
    text = "w12 w3 w1"
    pieces = " ".join(["▁w1 2", "▁w 3", "▁w1"]).split()  # as a BPE model might spell it
    with words_asked(local) as asked:
        decoder = build_ctcdecoder(labels, local, alpha=0.5, beta=1.0)
        got, state = decode_path(decoder, piece_emissions(pieces, labels))
    assert got == text
    assert set(asked) <= {*text.split(), "w1", "w", ""} and all(w.startswith("w") or w == "" for w in asked)
    assert state.neural == pytest.approx(sentence_logprob(engine, text), abs=1e-4)


def test_a_word_that_normalises_to_several_tokens_scores_their_sum(bundle):
    """With a normaliser that splits hyphenated words, 'w1-w2' is the tokens w1 and w2, read in turn."""
    from lmserve.core.textnorm import TextNormalizer

    lm = DecoderLM.local(bundle)
    lm.normalizer = TextNormalizer(hyphens="split", punctuation="strip")
    start = lm.start()
    joined, state = lm.score(start, "w1-w2", True)
    a, after = lm.score(start, "w1")
    b, _ = lm.score(after, "w2", True)
    assert joined == pytest.approx(a + b, abs=1e-5) and state.history() == ["w1", "w2"]
    assert state.word_tokens == 2 and lm.score(start, "!!")[0] == 0.0  # punctuation only: nothing read


# -- lm-serve behind the adapter --------------------------------------------------------------------------------


@pytest.mark.parametrize("full", [True, False], ids=["full-distributions", "step-graph"])
def test_local_states_score_as_lm_rescore_score_and_each_state_steps_once(bundle, root, engine, full):
    """A local word-level bundle keeps its states in arrays (LocalState: views of the step's output, the KenLM state
    after the path). With full distributions (a small vocabulary) each state is stepped once, through step_full, and
    every word asked after it later is a lookup: the graph's rows are the distinct states stepped. Either way the
    decoded path's scores equal lm-rescore score's, interpolated and neural."""
    local = DecoderLM.local(bundle, root / "train3.bin", LAMBDA)
    assert local.backend.full  # (the test bundle's vocabulary is small)
    local.backend.full = full
    scorer = local.backend.lm.scorer
    decoder = build_ctcdecoder(LABELS, local, alpha=0.8, beta=0.5)
    stepped, run = set(), scorer.next_word_scores

    def counting(prev, h, c, ids=None, **kwargs):
        numbers = np.concatenate([h, c], axis=2).transpose(1, 0, 2)
        stepped.update(zip(np.asarray(prev).tolist(), map(bytes, numbers), strict=True))  # the states read
        counting.rows += len(prev)
        return run(prev, h, c, ids, **kwargs)

    scorer.next_word_scores = counting
    for emissions in noisy(SENTENCES, seed=5):
        stepped.clear()
        counting.rows = 0
        text, state = decode_path(decoder, emissions, 12)
        assert state.logprob == pytest.approx(sentence_logprob(engine, text, interpolated=True), abs=1e-4)
        assert state.neural == pytest.approx(sentence_logprob(engine, text), abs=1e-4)
        if full:  # each state once
            assert counting.rows == len(stepped), (counting.rows, len(stepped))
        else:  # the step graph steps a state again for words asked after it in a later frame
            assert counting.rows >= len(stepped)


def test_a_state_asked_alone_steps_the_states_made_last_with_it(bundle, root):
    """flashlight asks one (state, word) at a time: the run that steps a state asked alone takes along the states
    made last and not stepped yet (STEP_AHEAD), so that asking after them later costs no run, and their scores are
    those of states stepped one by one (score_many, which never steps ahead)."""
    lm = DecoderLM.local(bundle, root / "train3.bin", LAMBDA)
    alone = DecoderLM.local(bundle, root / "train3.bin", LAMBDA)
    scorer, runs = lm.backend.lm.scorer, []
    run = scorer.next_word_scores

    def counting(prev, h, c, ids=None, **kwargs):
        runs.append(len(prev))
        return run(prev, h, c, ids, **kwargs)

    scorer.next_word_scores = counting
    words, start = ["w1", "w2", "w3"], lm.start()
    children = [lm.score(start, w)[1] for w in words]
    assert runs == [1]  # the start state
    first, _ = lm.score(children[0], "w2")
    assert runs == [1, 3]  # w1's state, and w2's and w3's along with it
    later = [lm.score(child, "w1")[0] for child in children[1:]]
    assert runs == [1, 3]
    start = alone.start()
    states = [state for _, state in alone.score_many([(start, w, False) for w in words])]
    expected = [alone.score_many([(s, w, False)])[0][0] for s, w in zip(states, ["w2", "w1", "w1"], strict=True)]
    assert [first, *later] == expected


def test_a_lookup_mixes_the_lms_as_numpy_does_to_the_bit():
    """A word read off a stepped state's distribution is interpolated in Python floats (``logaddexp``), the step
    graph's words in numpy arrays: the same formula and libm, so the same scores to the bit, ties and infinities
    included."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(-8, 4, 20000), rng.normal(-8, 4, 20000)
    y[:50] = x[:50]
    x[50], y[51] = -np.inf, -np.inf
    ours = np.array([logaddexp(a, b) for a, b in zip(x.tolist(), y.tolist(), strict=True)])
    assert np.array_equal(ours, np.logaddexp(x, y))


def test_the_lm_bound_lets_the_decoder_skip_words_of_beams_it_would_drop(bundle):
    """A beam whose best possible score (its word's LM score at most the model's highest: alpha · max_logprob +
    beta) is below the beam_width-th best score known is not scored; the decode is the plain decoder's."""
    lm = DecoderLM.local(bundle)
    assert lm.max_logprob is not None and lm.max_logprob >= 0
    fused = LMServeLanguageModel(lm, alpha=0.8, beta=0.5)
    assert fused.max_fused() == pytest.approx(0.8 * lm.max_logprob + 0.5)
    assert LMServeLanguageModel(lm, alpha=-1.0).max_fused() is None  # no bound: every word is scored
    lm.backend.max_logprob = None
    assert LMServeLanguageModel(lm).max_fused() is None  # a model whose scores are not log-probabilities


def test_a_words_bound_is_never_below_its_score_and_knows_its_oov(bundle, root):
    """``word_bound``: before any neural step, a local word-level LM bounds a word's score (with an n-gram, by the
    n-gram's share of the interpolation, well below max_logprob for most words) and says whether the word is out of
    its vocabulary; a remote or unnormalised LM says nothing."""
    lm = DecoderLM.local(bundle, root / "train3.bin", LAMBDA)
    words = ["w1", "w3", "w12", "zzz", "'w1", "<unk>"]
    states = [lm.start()]
    for word in ("w1", "w2", "zzz"):
        states.append(lm.score(states[-1], word)[1])
    tighter = 0
    for state in states:
        for word in words:
            top, oov = lm.word_bound(state, word)
            _, child = lm.score(state, word)
            assert child.word_logprob <= top <= lm.max_logprob and oov == child.word_oov, (word, top, child)
            tighter += top < math.log(0.9)
    assert tighter > len(states) * len(words) / 2
    assert lm.word_bound(states[0], "w1 w2") is None  # (two tokens)
    neural = DecoderLM.local(bundle)
    assert neural.word_bound(neural.start(), "w1") == (neural.max_logprob, False)
    neural.backend.max_logprob = None
    assert neural.word_bound(neural.start(), "w1") is None


def test_a_finished_search_is_freed_without_the_cycle_collector(bundle):
    """A state and its parent refer to each other through the parent's memo; at the end of a search the decoder
    empties the memos (``LMState.forget_children``), so that with the cycle collector off only the path of the
    state kept is left alive, and that path still reads as the decoded text."""
    lm = DecoderLM.local(bundle)
    made = []
    look_up = lm._look_up_words

    def watched(*args):
        children = look_up(*args)
        made.extend(weakref.ref(child) for child in children)
        return children

    lm._look_up_words = watched
    decoder = build_ctcdecoder(LABELS, lm, alpha=0.8, beta=0.5)
    gc.collect()
    gc.disable()
    try:
        text, state = decode_path(decoder, noisy(SENTENCES)[2], 12)
        alive = [ref() for ref in made if ref() is not None]
    finally:
        gc.enable()
    assert len(made) > 50 and state.history() == text.split()
    assert len(alive) <= len(text.split()), len(alive)  # the kept path (its words; </s> adds no token state)


def noisy(texts, seed=11):
    rng = np.random.default_rng(seed)
    channel = Channel(sub=0.15, dropped=0.05, ins=0.05)
    return [channel.emissions(t, LABELS, rng) for t in texts]


@pytest.mark.parametrize("how", ["stream", "batch", "stream-cache"])
def test_pyctcdecode_with_lm_serve_decodes_as_with_the_local_bundle(server, bundle, root, engine, how):
    local = DecoderLM.local(bundle, root / "train3.bin", LAMBDA)
    with DecoderLM.remote(server.address, "exact", stream=how != "batch", cache_states=how == "stream-cache") as remote:
        decoders = [build_ctcdecoder(LABELS, lm, alpha=0.8, beta=0.5) for lm in (local, remote)]
        unbounded = DecoderLM.local(bundle, root / "train3.bin", LAMBDA)
        unbounded.word_bound = lambda state, word: None  # max_logprob alone, as the remote LM's bound
        for emissions in noisy(SENTENCES):
            decode_path(build_ctcdecoder(LABELS, unbounded, alpha=0.8, beta=0.5), emissions, 12)
            (text, state), (remote_text, remote_state) = (decode_path(d, emissions, 12) for d in decoders)
            assert remote_text == text
            assert remote_state.logprob == pytest.approx(state.logprob, abs=1e-4)
            assert state.logprob == pytest.approx(sentence_logprob(engine, text, interpolated=True), abs=1e-4)
            assert remote_state.neural == pytest.approx(sentence_logprob(engine, text), abs=1e-4)
        assert remote.calls == unbounded.calls  # one request per beam step and token depth, as one local step
        # the local LM's n-gram bound prunes beams that the remote one's cannot (word_bound): fewer steps
        assert 0 < local.calls < remote.calls
        if how == "stream-cache":
            del decoders, state, remote_state
            import gc

            gc.collect()
            backend = remote.backend
            assert backend.released and not backend.holders  # every cached state of the search was dropped ...
            remote.score(remote.start(), "w1")
            assert not backend.released  # ... and released with the next request


def stop_at_call(lm: DecoderLM, call: int, action) -> None:
    """Run ``action`` just before the LM's ``call``-th backend call (mid-decode)."""
    step = lm._call

    def wrapped(items, keep):
        if lm.calls == call - 1:
            action()
        return step(items, keep)

    lm._call = wrapped


def test_a_server_stopped_mid_decode_is_an_error_naming_its_address(root, bundle):
    with (
        ServerProcess(write_config(root, bundle, "stop.toml"), root / "stop.log") as server,
        DecoderLM.remote(server.address, "exact") as lm,
    ):
        decoder = build_ctcdecoder(LABELS, lm)
        stop_at_call(lm, 5, server.stop)
        with pytest.raises(LMServeError, match=f"lm-serve at {server.address}: UNAVAILABLE"):
            decoder.decode(noisy(SENTENCES[:1])[0])


def test_a_server_stopped_mid_decode_falls_back_to_the_ngram_and_says_so_once(root, bundle, caplog):
    with (
        ServerProcess(write_config(root, bundle, "fallback.toml"), root / "fallback.log") as server,
        DecoderLM.remote(server.address, "exact", fallback_ngram=root / "train3.bin") as lm,
    ):
        decoder = build_ctcdecoder(LABELS, lm, alpha=0.8, beta=0.5)
        stop_at_call(lm, 5, server.stop)
        with caplog.at_level(logging.WARNING, logger="lmserve.decoders"):
            texts = [decoder.decode_beams(e, beam_width=8)[0] for e in noisy(SENTENCES)]
    warnings = [r.getMessage() for r in caplog.records if r.name == "lmserve.decoders"]
    assert len(warnings) == 1 and f"lm-serve at {server.address}: UNAVAILABLE" in warnings[0]
    assert "n-gram" in warnings[0] and lm.fell_back
    ngram = NgramLM(root / "train3.bin")
    text, state = texts[-1][0], texts[-1][1]  # a whole utterance after the fallback: the n-gram's own score
    assert np.isnan(state.neural) and state.logprob == pytest.approx(ngram.score(text.split()), abs=1e-6)


@pytest.mark.parametrize("changed", [False, True])
def test_a_reload_mid_decode_keeps_the_states_or_refuses_them(root, bundle, bundles, changed):
    config = write_config(root, bundle, f"reload{changed}.toml")
    with (
        ServerProcess(config, root / f"reload{changed}.log") as server,
        DecoderLM.remote(server.address, "plain") as first,
        DecoderLM.remote(server.address, "plain") as lm,
    ):
        emissions = noisy(SENTENCES[2:3])[0]
        expected = build_ctcdecoder(LABELS, first).decode_beams(emissions)[0]

        def reload():
            if changed:
                config.write_text(config.read_text().replace(str(bundle), str(bundles[("full", 0.5)][1])))
            with LMServeClient(server.address) as admin:
                admin.reload_models()

        stop_at_call(lm, 5, reload)
        decoder = build_ctcdecoder(LABELS, lm)
        if not changed:
            got = decoder.decode_beams(emissions)[0]
            assert got[0] == expected[0] and got[1].logprob == pytest.approx(expected[1].logprob, abs=1e-6)
        else:
            with pytest.raises(LMServeError, match="FAILED_PRECONDITION: .*before a reload.*restart the sentence"):
                decoder.decode_beams(emissions)
        assert server.stop() == 0


# -- flashlight-text --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def flashlight():
    return pytest.importorskip(
        "lmserve.rescoring.decoders.flashlight_lm",
        reason="flashlight-text is not installed (pip install -e '.[decoders]'; make test installs it)",
    )


FL_TOKENS = ["-", "|", "w", *"0123456789"]  # blank, silence (the word separator), characters
WORDS = [f"w{i}" for i in range(40)]


def fl_emissions(text: str, channel: Channel | None = None, seed: int = 0) -> np.ndarray:
    """Silence ("|") ends the utterance, as wav2letter-style lexicons (spellings end with "|") expect."""
    labels = ["", " ", *FL_TOKENS[2:]]  # the same indices, as the channel names them
    if channel is None:
        emissions = clean_emissions(text, labels)
    else:
        emissions = channel.emissions(text, labels, np.random.default_rng(seed))
    silence = np.full((1, len(labels)), np.log(0.02 / (len(labels) - 1)), dtype=np.float32)
    silence[0, 1] = np.log(0.98)
    return np.concatenate([emissions, silence])


@pytest.mark.parametrize("where", ["local", "remote"])
def test_flashlight_lexicon_decoder_with_our_lm(flashlight, local, server, engine, where):
    remote = contextlib.nullcontext(local) if where == "local" else DecoderLM.remote(server.address, "plain")
    with remote as lm:
        fl_lm = flashlight.LMServeFlashlightLM(lm, [*WORDS, "<unk>"])
        lexicon = {w: [[*w, "|"]] for w in WORDS}
        decoder = flashlight.lexicon_decoder(FL_TOKENS, lexicon, fl_lm, beam_size=16, lm_weight=0.5, word_score=0.5)
        for text in SENTENCES:
            (best,) = decoder.decode(fl_emissions(text))
            assert " ".join(best.words) == text
            assert best.lm_logprob == pytest.approx(sentence_logprob(engine, text), abs=1e-4)
            assert best.lm_score == pytest.approx(best.lm_logprob, abs=1e-3)  # flashlight's own sum agrees
        # noisy emissions: the LM is asked once per (state, word), however often flashlight asks
        asked = fl_lm.lm.pairs
        decoder.decode(fl_emissions(SENTENCES[2], Channel(sub=0.2), seed=3))
        assert fl_lm.lm.pairs - asked <= len(fl_lm.states)
        asked, root = fl_lm.lm.pairs, fl_lm.start()
        first = fl_lm.score(root, 3)
        assert fl_lm.score(root, 3) == first and first[0] is root.child(3)  # a repeat: the same answer, no LM work
        assert fl_lm.finish(first[0]) == fl_lm.finish(first[0]) and fl_lm.lm.pairs - asked == 2


def test_flashlight_with_subword_pieces_scores_whole_words(flashlight, local, engine):
    """Pieces spell the lexicon's words (no silence between words): the LM hears a word when its spelling ends."""
    tokens = ["-", "|", "▁w", "▁w1", *"0123456789"]
    lexicon = {w: [["▁w1", *w[2:]] if w.startswith("w1") else ["▁w", *w[1:]]] for w in WORDS}
    text = "w12 w3 w1"
    with words_asked(local) as asked:
        fl_lm = flashlight.LMServeFlashlightLM(local, [*WORDS, "<unk>"])
        decoder = flashlight.lexicon_decoder(tokens, lexicon, fl_lm, beam_size=16, lm_weight=0.5, sil_score=-100.0)
        (best,) = decoder.decode(piece_emissions(["▁w1", "2", "▁w", "3", "▁w1"], tokens))
    assert " ".join(best.words) == text
    assert set(asked) <= {*WORDS, ""}  # whole words (and "" for </s>), never a piece
    assert best.lm_logprob == pytest.approx(sentence_logprob(engine, text), abs=1e-4)


def test_torchaudio_ctc_decoder_takes_our_lm(flashlight, local, engine, tmp_path):
    """README's torchaudio snippet: ctc_decoder(lm=LMServeFlashlightLM(...)), where torchaudio ships the decoder."""
    decoders = pytest.importorskip(
        "torchaudio.models.decoder",
        reason="torchaudio with its CTC decoder is not installable beside torch 2.13 (no matching wheel; torchaudio "
        "2.9+ dropped the decoder): flashlight-text's decoder is tested directly above",
    )
    if not hasattr(decoders, "ctc_decoder"):
        pytest.skip("the installed torchaudio has no CTC decoder (torchaudio 2.9 removed it): flashlight-text direct")
    import torch

    lexicon = tmp_path / "lexicon.txt"
    lexicon.write_text("".join(f"{w} {' '.join(w)} |\n" for w in WORDS))
    lm = flashlight.LMServeFlashlightLM(local, [*WORDS, "<unk>"])  # the LM's words in the lexicon's order
    decoder = decoders.ctc_decoder(
        lexicon=str(lexicon), tokens=FL_TOKENS, lm=lm, beam_size=16, lm_weight=0.5, blank_token="-", sil_token="|"
    )
    for text in SENTENCES:
        (best, *_), *_ = decoder(torch.from_numpy(fl_emissions(text))[None])
        assert " ".join(best.words) == text
        path = lm.path([lm.words.index(w) for w in best.words])
        assert path.logprob == pytest.approx(sentence_logprob(engine, text), abs=1e-4)
