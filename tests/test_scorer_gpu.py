"""Where the scorer runs (``Scorer(device=...)``, ``--device``, ``server.device``) and its IO-bound step.

The CUDA scorer's parity with the CPU scorer (and its fp16 sessions' bound) needs an NVIDIA GPU and onnxruntime-gpu
(``needs_gpu``: skipped, with the reason, where either is missing); the rest runs on the CPU: the error for a CUDA
device that this onnxruntime cannot give (the CPU build is the one installed here, so the error path is the real
one), and the IO-bound step's exact agreement with a plain ``session.run``.
"""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest
from conftest import make_sentences

from lmserve.rescoring.commands.cli import main as rescore_main
from lmserve.rescoring.nbest import Hypothesis, NBestEntry, NBestList, write_nbest
from lmserve.rescoring.precision import TOKEN_BOUND
from lmserve.rescoring.scorer import BOS, DeviceError, Scorer
from lmserve.server.cli import main as serve_main
from lmserve.server.config import ConfigError, load_config
from lmserve.server.models import ModelSet

HAS_CUDA_PROVIDER = "CUDAExecutionProvider" in ort.get_available_providers()


def needs_cuda_scorer(test):
    """A GPU test of the scorer: skipped where no GPU is visible (``needs_gpu``) or where this onnxruntime lacks the
    CUDA provider, saying how to get it."""
    reason = f"onnxruntime {ort.__version__} has no CUDAExecutionProvider: pip install 'lmserve[gpu]'"
    return pytest.mark.needs_gpu(pytest.mark.skipif(not HAS_CUDA_PROVIDER, reason=reason)(test))


def step_inputs(scorer: Scorer, rows: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Previous words, a state and 3 candidates per row, drawn from the vocabulary (never <s> as a candidate)."""
    rng = np.random.default_rng(seed)
    vocab = len(scorer.bundle.tokens)
    shape = (scorer.layers, rows, scorer.state_size)
    h, c = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    prev = rng.integers(BOS, vocab, rows)
    return prev, h, c, rng.integers(BOS + 1, vocab, (rows, 3))


def test_io_bound_step_equals_session_run_on_the_cpu(bundles):
    """``next_word_scores`` through an IOBinding (states kept on the device) gives the same numbers, bit for bit, as
    ``session.run`` of the same graph (what it runs on the CPU when numpy states are to come back), with candidates
    and without, from a strided view of a state (what ``_step_level`` passes), and from states kept as OrtValues by
    the step before."""
    scorer = Scorer(bundles[("adaptive", 0.0)][1], threads=1)
    prev, h, c, candidates = step_inputs(scorer, 8, seed=0)
    h, c = h[:, ::2], c[:, ::2]  # not contiguous
    prev, candidates = prev[::2], candidates[::2]
    for graph, given in (("step", candidates), ("step_full", None)):
        feed = {"prev_ids": prev, "h": h, "c": c} | ({} if given is None else {"candidates": given})
        want = scorer.sessions[graph].run(None, feed)
        for device_states in (False, True):
            got = scorer.next_word_scores(prev, h, c, given, device_states=device_states)
            for w, g in zip(want, got, strict=True):
                np.testing.assert_array_equal(g.numpy() if isinstance(g, ort.OrtValue) else g, w)

    scores, h1, c1 = scorer.next_word_scores(prev, h, c, candidates, device_states=True)
    assert isinstance(h1, ort.OrtValue) and h1.device_name() == "cpu" and isinstance(scores, np.ndarray)
    next_prev = candidates[:, 0]
    want = scorer.sessions["step"].run(
        None, {"prev_ids": next_prev, "h": h1.numpy(), "c": c1.numpy(), "candidates": candidates}
    )
    for w, g in zip(want, scorer.next_word_scores(next_prev, h1, c1, candidates), strict=True):
        np.testing.assert_array_equal(g, w)


def test_an_unknown_device_is_refused():
    with pytest.raises(DeviceError, match=r"device 'gpu': expected one of \['cpu', 'cuda'\]"):
        Scorer("no bundle read", device="gpu")


@pytest.mark.skipif(HAS_CUDA_PROVIDER, reason="this onnxruntime has the CUDA provider, so its absence cannot be shown")
def test_cuda_without_the_cuda_provider_fails_before_any_work(tmp_path, capsys):
    """The Scorer refuses before it reads the bundle (none is there), and the command lines as they parse (exit 2,
    nothing read: neither the list nor the bundle nor the config exists); each message names the option, the
    installed onnxruntime and its providers, and the fix."""
    with pytest.raises(DeviceError) as refused:
        Scorer(tmp_path / "no bundle here", device="cuda")
    message = str(refused.value)
    for part in ("device 'cuda'", "CUDAExecutionProvider", f"onnxruntime {ort.__version__}", "CPUExecutionProvider"):
        assert part in message
    assert "pip install 'lmserve[gpu]'" in message and "onnxruntime-gpu replaces onnxruntime" in message

    missing = str(tmp_path / "missing")
    commands = [
        (rescore_main, ["score", "--lm", missing, "--input", missing, "--device", "cuda"]),
        (rescore_main, ["tune", missing, "--lm", missing, "--metric", "wer", "--features", "neural", "--out", missing,
                        "--device", "cuda"]),
        (serve_main, ["serve", "--config", missing, "--device", "cuda"]),
    ]  # fmt: skip
    for main, argv in commands:
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert "argument --device: device 'cuda' needs onnxruntime's CUDAExecutionProvider" in err, argv
        assert f"onnxruntime {ort.__version__}" in err and "pip install 'lmserve[gpu]'" in err


def test_server_device_reaches_the_scorers(bundles, tmp_path):
    """``server.device`` is checked with the rest of the config; the model set loads its scorers there, and a
    reload (which passes the running set's device) keeps it."""
    bundle = bundles[("full", 0.0)][1]
    config = tmp_path / "serve.toml"
    config.write_text(f'[server]\ndevice = "gpu"\n[models.m]\nbundle = "{bundle}"\n')
    with pytest.raises(ConfigError, match=r"server\.device = 'gpu': expected one of \['cpu', 'cuda'\]"):
        load_config(config)
    config.write_text(f'[server]\ndevice = "cpu"\n[models.m]\nbundle = "{bundle}"\n')
    models = ModelSet.load(load_config(config))
    assert models.device == "cpu" and models.get("m").lm.scorer.device == "cpu"
    assert models.get("m").ref()[-1] == "cpu"  # what a scoring process loads its own copy with


@needs_cuda_scorer
@pytest.mark.parametrize("head", ["full", "adaptive"])
def test_cuda_scorer_matches_the_cpu_scorer(bundles, head):
    """Sentences, n-best lists (read whole on the GPU, prefix-shared on the CPU) and decoder steps, with states kept
    on the GPU between steps: within 1e-4 of the CPU scorer."""
    bundle = bundles[(head, 0.0)][1]
    cpu, gpu = Scorer(bundle, threads=1), Scorer(bundle, threads=1, device="cuda")
    assert all(s.get_providers()[0] == "CUDAExecutionProvider" for s in gpu.sessions.values())
    sentences = make_sentences(40, seed=7)
    for want, got in zip(cpu.score(sentences), gpu.score(sentences), strict=True):
        np.testing.assert_allclose(got.token_logprobs, want.token_logprobs, atol=TOKEN_BOUND["fp32"])
    lists = [sentences[i : i + 10] for i in range(0, 40, 10)]
    for want_list, got_list in zip(cpu.score_nbest(lists), gpu.score_nbest(lists), strict=True):
        for want, got in zip(want_list, got_list, strict=True):
            np.testing.assert_allclose(got.token_logprobs, want.token_logprobs, atol=TOKEN_BOUND["fp32"])

    prev, h, c, candidates = step_inputs(cpu, 32, seed=1)
    np.testing.assert_allclose(
        gpu.next_word_scores(prev, h, c)[0], cpu.next_word_scores(prev, h, c)[0], atol=TOKEN_BOUND["fp32"]
    )
    gpu_h, gpu_c = h, c
    for _ in range(3):  # the GPU's states stay there; the CPU's come back as numpy
        want, h, c = cpu.next_word_scores(prev, h, c, candidates)
        got, gpu_h, gpu_c = gpu.next_word_scores(prev, gpu_h, gpu_c, candidates, device_states=True)
        assert gpu_h.device_name() == "cuda"
        np.testing.assert_allclose(got, want, atol=TOKEN_BOUND["fp32"])
        prev = candidates[:, 0]
    np.testing.assert_allclose(gpu_h.numpy(), h, atol=1e-4)  # the states too


def test_gpu_benchmark_runs_on_the_cpu(bundles, tmp_path):
    """benchmarks/gpu_scorer end to end with ``--device cpu`` on a tiny bundle: what a GPU machine runs, but the
    GPU; the result file goes where ``--results`` says."""
    from benchmarks.gpu_scorer import main

    sentences = make_sentences(60, seed=5)
    lists = [NBestEntry(str(i), [Hypothesis(s) for s in sentences[i : i + 30]]) for i in range(0, 60, 15)]
    write_nbest(NBestList(lists), tmp_path / "lists.jsonl", "jsonl")
    argv = ["--device", "cpu", "--bundle", str(bundles[("adaptive", 0.0)][1]), "--list", str(tmp_path / "lists.jsonl")]
    argv += ["--normalize", "", "--lists-per-call", "2", "--rounds", "1", "--threads", "1", "--decoders", "2"]
    result = main([*argv, "--beam", "4", "--steps", "5", "--warmup", "1", "--results", str(tmp_path / "results")])
    written = json.loads((tmp_path / "results" / "gpu_scorer.json").read_text())
    assert written["metrics"] == result["metrics"] and result["lists"] == 4 and result["step"]["rows"] == 8
    assert result["metrics"]["gpu_token_max_abs_diff"] == 0  # the CPU scorer against itself
    assert result["parity"]["cpu"]["lm_best_agreement"] == 1 and result["precision"] == {"cpu": "fp32"}
    assert all(v > 0 for k, v in result["metrics"].items() if not k.endswith("_abs_diff"))
    assert all(way["n"] == 5 for way in result["step"]["ways"].values())
    ops = result["op_profile"]  # the CPU scorer steps through these short lists' prefixes and tails
    assert ops["graphs"]["step"]["runs"] > 0 and ops["providers"] == ["CPUExecutionProvider"]
    assert 0 < ops["node_ms"] <= ops["run_ms"] and {k["graph"] for k in ops["top"]} <= set(ops["graphs"])
    assert sum(k["share"] for k in ops["top"]) == pytest.approx(1) or len(ops["top"]) == 12
    assert result["unknown_share"] < 0.2
    with pytest.raises(ValueError, match=r"100% of the words of 105 hypotheses are unknown to the neural LM"):
        main([*argv[:6], "--normalize", "librispeech", "--results", str(tmp_path / "upper")])  # W1 for w1


@needs_cuda_scorer
@pytest.mark.parametrize("head", ["full", "adaptive"])
def test_fp16_cuda_scorer_is_within_its_bound_of_the_cpu_scorer(bundles, head):
    """``precision="fp16"``: float16 sessions on the GPU, float32 states and scores, every token score of sentences,
    n-best lists and decoder steps within fp16's ``TOKEN_BOUND`` (rescoring/precision.py)."""
    bundle = bundles[(head, 0.0)][1]
    cpu, half = Scorer(bundle, threads=1), Scorer(bundle, threads=1, device="cuda", precision="fp16")
    assert all(s.get_providers()[0] == "CUDAExecutionProvider" for s in half.sessions.values())
    sentences = make_sentences(40, seed=7)
    lists = [sentences[i : i + 10] for i in range(0, 40, 10)]
    pairs = [*zip(cpu.score(sentences), half.score(sentences), strict=True)]
    for want_list, got_list in zip(cpu.score_nbest(lists), half.score_nbest(lists), strict=True):
        pairs += zip(want_list, got_list, strict=True)
    diff = max(np.abs(got.token_logprobs - want.token_logprobs).max() for want, got in pairs)
    assert 0 < diff <= TOKEN_BOUND["fp16"]
    prev, h, c, candidates = step_inputs(cpu, 32, seed=1)
    half_h, half_c = h, c
    for _ in range(3):
        want, h, c = cpu.next_word_scores(prev, h, c, candidates)
        got, half_h, half_c = half.next_word_scores(prev, half_h, half_c, candidates, device_states=True)
        assert got.dtype == np.float32 and half_h.data_type() == "tensor(float)"
        np.testing.assert_allclose(got, want, atol=TOKEN_BOUND["fp16"])
        prev = candidates[:, 0]
