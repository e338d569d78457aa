"""The decoding benchmarks run end to end on a tiny bundle (seconds each, no files written): decode_synthetic reports
its four WERs, beam_step_load its ways of stepping, and state_cache_soak holds the cache's bound with no errors while
evicting abandoned states. (The decoders' LM scores against ``lm-rescore score``: tests/test_decoders.py.)"""

import pytest
from conftest import make_sentences

from lmserve.rescoring.ngram import build_ngram

pytest.importorskip(
    "pyctcdecode",
    reason="pyctcdecode is not installed (pip install --no-deps pyctcdecode==0.5.0; make test installs it)",
)

LABELS = " w0123456789"


@pytest.fixture(scope="module")
def setup(bundles, tmp_path_factory):
    root = tmp_path_factory.mktemp("decode_benchmarks")
    build_ngram((s.split() for s in make_sentences(300, seed=1)), 3, root / "train3", discount_fallback=True)
    (root / "texts.txt").write_text("\n".join(make_sentences(40, seed=9)) + "\n")
    common = ["--bundle", str(bundles[("full", 0.0)][1]), "--ngram", str(root / "train3.bin"), "--lam", "0.4"]
    return [*common, "--normalize", "", "--texts", str(root / "texts.txt"), "--no-write"]


def test_decode_synthetic(setup):
    from benchmarks.decode_synthetic import main

    args = ["--labels", LABELS, "--tune-utterances", "6", "--utterances", "8", "--beams", "32", "--alphas", "0.5"]
    result = main([*setup, *args, "--betas", "1.0", "--remote-beams", "32"])
    metrics = result["metrics"]
    assert all(0 <= metrics[k] <= 200 for k in ("wer_no_lm", "wer_kenlm", "wer_ours", "wer_ours_remote"))
    assert metrics["wer_ours_remote"] == metrics["wer_ours"]  # the same model, here or served
    assert "SYNTHETIC" in result["note"]


def test_beam_step_load(setup):
    from benchmarks.beam_step_load import MODES, main

    args = ["--decoders", "3", "--beam", "4", "--steps", "6", "--warmup", "1", "--solo-steps", "3"]
    result = main([*setup, *args, "--think-curve", "20"])
    assert set(result["modes"]) == {*MODES, "batched_one_decoder", "batched_think_20"}
    assert result["server_errors"] == 0 and result["server"]["device"] == "cpu"
    assert all(result["modes"][m]["steps"] == 18 for m in [*MODES, "batched_think_20"])
    assert result["metrics"]["p99_ms"] > 0 and result["metrics"]["one_decoder_p99_ms"] > 0
    # 6 steps, each followed by a pause of 0-40 ms (seeded: 0.10-0.17 s in all for each of the 3 decoders)
    assert result["modes"]["batched_think_20"]["seconds"] >= 0.06 and result["metrics"]["p99_ms_think_20"] > 0


def test_state_cache_soak(setup):
    from benchmarks.state_cache_soak import main

    args = ["--decoders", "6", "--beam", "4", "--seconds", "3", "--warmup", "1", "--max-mb", "0.05"]
    result = main([*setup, *args, "--abandon-every", "1", "--think-ms", "5"])
    assert result["metrics"]["errors"] == 0 and result["cache"]["bound_held"]
    assert result["cache"]["evicted"] > 0  # abandoned states made room for live ones


def test_decode_speed(setup):
    from benchmarks.decode_speed import main

    args = ["--labels", LABELS, "--utterances", "4", "--rounds", "1", "--server-steps", "2", "--alpha", "0.5"]
    result = main([*setup, *args])
    metrics, rows = result["metrics"], result["rows"]
    assert set(rows) == {f"pyctcdecode_{r}" for r in ("no_lm", "kenlm", "ours", "ours_remote")} | {
        "flashlight_kenlm",
        "flashlight_ours",
    }
    assert all(row["ms_per_utt"] > 0 and row["cpu_ms_per_utt"] > 0 and 0 <= row["wer"] <= 200 for row in rows.values())
    assert rows["pyctcdecode_ours_remote"]["wer"] == rows["pyctcdecode_ours"]["wer"]  # the same model, here or served
    assert metrics["max_abs_diff"] <= 1e-4 and metrics["server_cpu_ms_per_step"] > 0
    assert metrics["ours_vs_kenlm"] == metrics["ours_ms_per_utt"] / metrics["kenlm_ms_per_utt"]
