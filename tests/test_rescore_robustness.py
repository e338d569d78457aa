"""lm-rescore with bad input and crashes: every way it once failed on them has a test here (the server's
in test_server.py, Gutenberg's in test_gutenberg.py): no silent wrong answers, no partial outputs, no tracebacks, and
errors before any model runs."""

import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from conftest import ROOT

from lmserve.core.bundle import Bundle, BundleError, sha256_file
from lmserve.rescoring.commands.cli import main as rescore_main
from lmserve.rescoring.nbest import Hypothesis, NBestEntry, NBestFormatError, NBestList, read_nbest, write_nbest

pytestmark = pytest.mark.slow  # lm-rescore processes, killed and run again


def lists(n: int, hyps: int = 3, words: int = 4) -> NBestList:
    """n entries of ``hyps`` hypotheses over the tiny bundles' words, with an 'am' score and one reference each."""
    entries = []
    for i in range(n):
        texts = [" ".join(f"w{(i + k + j) % 30}" for j in range(words)) for k in range(hyps)]
        entries.append(
            NBestEntry(f"u{i}", [Hypothesis(t, {"am": -1.0 - k}, k + 1) for k, t in enumerate(texts)], [texts[0]])
        )
    return NBestList(entries)


def weights_file(path: Path, bundle: Path, features=("am", "neural")) -> Path:
    """A weights file as lm-rescore tune writes it (format 1: paths as given), naming ``bundle``."""
    record = {
        "format": "lmserve-weights",
        "format_version": 1,
        "features": list(features),
        "weights": dict.fromkeys(features, 1.0),
        "metric": "wer",
        "dev_set": "dev",
        "date": "2026-01-01T00:00:00+00:00",
        "setup": {"lm": str(bundle), "ngram": None, "normalize": None, "definitions": {}, "lambda": None},
    }
    path.write_text(json.dumps(record))
    return path


OPENED: list[str] = []


def _audit(event, args):
    if event == "open" and isinstance(args[0], str) and args[0].endswith(".onnx"):
        OPENED.append(args[0])


sys.addaudithook(_audit)


def run_cli(*args: str, debug: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LMSERVE_DEBUG": "1" if debug else ""}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True)


# -- 1. a hypothesis without a feature its list-mates have ----------------------------------------------------------


def test_a_missing_feature_is_an_error_not_the_best_score(tmp_path, bundles, capsys):
    path = tmp_path / "l.jsonl"
    good = {"text": "w1 w2", "features": {"am": -5.0}}
    path.write_text(
        json.dumps({"id": "u", "hypotheses": [good, {"text": "w3", "features": {}}], "references": ["w1"]}) + "\n"
    )
    with pytest.raises(NBestFormatError, match=r"l\.jsonl:1: field 'hypotheses\[1\]': no feature 'am'"):
        read_nbest(path)
    assert read_nbest(path, feature_defaults={"am": -100.0}).entries[0].hypotheses[1].features == {"am": -100.0}
    weights = weights_file(tmp_path / "w.json", bundles[("full", 0.0)][1])
    out = tmp_path / "out.jsonl"
    assert rescore_main(["nbest", str(path), "--weights", str(weights), "--out", str(out), "--quiet"]) == 2
    assert "no feature 'am'" in capsys.readouterr().err and not out.exists()
    args = ["nbest", str(path), "--weights", str(weights), "--out", str(out), "--quiet", "--feature-default", "am=-100"]
    assert rescore_main(args) == 0
    assert read_nbest(out).entries[0].hypotheses[0].text == "w1 w2"  # the hypothesis with a score wins


# -- 2. kill -9 during a folder output; left-overs -------------------------------------------------------------------


WRITER = """
import json, sys
import numpy as np
from lmserve.core.atomic import atomic_write_text
from lmserve.rescoring.lmscores import HypothesisScores, write_cache
from lmserve.rescoring.nbest import Hypothesis, NBestEntry, NBestList, write_nbest
kind, out = sys.argv[1:]
nbest = NBestList([NBestEntry(f"u{i}", [Hypothesis(f"w{i} w{k}", {"score": -1.0 * k, "decoder": -2.0}, k + 1)
                   for k in range(1, 31)], [f"w{i}"]) for i in range(3000)])
print("ready", flush=True)
if kind == "folder":
    write_nbest(nbest, out, "espnet")
elif kind == "file":
    write_nbest(nbest, out, "jsonl")
elif kind == "report":
    atomic_write_text(out, json.dumps({"rows": [[i] * 100 for i in range(30000)]}))
else:
    row = [HypothesisScores(np.full(20, -1.5), None, 0)] * 30
    write_cache(__import__("pathlib").Path(out), {}, nbest, [row] * len(nbest))
print("done", flush=True)
sys.stdin.read()
"""
COMPLETE = {
    "folder": lambda out: (
        {len(e.hypotheses) for e in read_nbest(out)} == {30} and read_nbest(out).entries[-1].references
    ),
    "file": lambda out: len(read_nbest(out)) == 3000,
    "report": lambda out: len(json.loads(out.read_text())["rows"]) == 30000,
    "cache": lambda out: len(out.read_text().splitlines()) == 3001,
}


@pytest.mark.parametrize(
    ("kind", "delay"),
    [("folder", 0.0), ("folder", 0.1), ("folder", 0.2), ("file", 0.0), ("report", 0.0), ("cache", 0.0)],
)
def test_an_output_killed_while_written_is_complete_or_absent(tmp_path, kind, delay):
    """kill -9 during a write, from the moment its first byte is on disk: the output is complete or absent (an
    ESPnet folder was left with some of its ranks and no references, and read back as a shorter list), and the next
    write removes what the killed one left."""
    out = tmp_path / ("dump" if kind == "folder" else f"out.{kind}")
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, kind, str(out)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "ready"
    while not [p for p in tmp_path.rglob("*") if p.is_file()]:  # the first file is being written (wherever it is)
        time.sleep(0.002)
    time.sleep(delay)
    proc.kill()
    proc.communicate()
    if out.exists():
        assert COMPLETE[kind](out)
    if kind == "folder":
        write_nbest(lists(2), out, "espnet")
    else:
        from lmserve.core.atomic import atomic_write_text

        atomic_write_text(out, "again\n")
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]


# -- 3. the output format follows --out ------------------------------------------------------------------------------


def test_out_format_follows_the_out_name(tmp_path, bundles, capsys):
    dump = tmp_path / "dev"
    write_nbest(lists(4), dump, "espnet")
    weights = weights_file(tmp_path / "w.json", bundles[("full", 0.0)][1])
    out = tmp_path / "var" / "dev.rescored.jsonl"
    common = ["nbest", str(dump), "--weights", str(weights), "--quiet"]
    assert rescore_main([*common, "--out", str(out)]) == 0
    assert out.is_file() and len(read_nbest(out)) == 4  # a JSONL file, not a folder named *.jsonl
    assert rescore_main([*common, "--out", str(out), "--out-format", "jsonl"]) == 0  # as after make demo
    capsys.readouterr()
    assert rescore_main([*common, "--out", str(tmp_path / "plain")]) == 2
    assert "cannot tell the output format" in capsys.readouterr().err
    assert rescore_main([*common, "--out", str(out), "--out-format", "espnet"]) == 2
    assert "--out-format says espnet" in capsys.readouterr().err


# -- 4. errors before the expensive work ----------------------------------------------------------------------------


def test_bad_input_fails_before_any_model_is_loaded(tmp_path, bundles, capsys):
    weights = weights_file(tmp_path / "w.json", bundles[("full", 0.0)][1])
    good = tmp_path / "l.jsonl"
    write_nbest(lists(3), good, "jsonl")
    moses = tmp_path / "l.kbest"
    moses.write_text("0 ||| w1 w2 ||| am=-1 ||| -1\n1 ||| w3 ||| am=-2 ||| -2\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    blocker = tmp_path / "file"
    blocker.write_text("")
    out = tmp_path / "out.jsonl"
    cases = {
        "missing references": (["nbest", str(moses), "--weights", str(weights), "--out", str(out)], "no reference"),
        "an empty list": (["nbest", str(empty), "--weights", str(weights), "--out", str(out)], "no n-best entries"),
        "--out under a file": (
            ["nbest", str(good), "--weights", str(weights), "--out", str(blocker / "o.jsonl")],
            "is a file, not a folder",
        ),
        "--lambdas abc": (
            ["tune", str(good), "--lm", str(bundles[("full", 0.0)][1]), "--metric", "wer", "--features", "am,neural"]
            + ["--lambdas", "abc", "--out", str(tmp_path / "t.json")],
            "--lambdas",
        ),
    }
    for name, (args, message) in cases.items():
        OPENED.clear()
        assert rescore_main([*args, "--quiet"]) == 2, name
        assert message in capsys.readouterr().err, name
        assert not OPENED, f"{name}: a model was loaded before the error"
        assert not out.exists(), f"{name}: --out was written"


# -- 5. tracebacks --------------------------------------------------------------------------------------------------


def test_damaged_files_and_wrong_formats_are_errors_naming_the_file(tmp_path, bundles):
    dump = tmp_path / "dump"
    write_nbest(lists(40, hyps=5), dump, "espnet")
    tarball = tmp_path / "dump.tar.gz"
    with tarfile.open(tarball, "w:gz") as tar:
        tar.add(dump, arcname="dump")
    data = tarball.read_bytes()
    tarball.write_bytes(data[: len(data) // 2])
    with pytest.raises(NBestFormatError, match="dump.tar.gz"):
        read_nbest(tarball, "espnet")
    jsonl = tmp_path / "l.jsonl"
    write_nbest(lists(2), jsonl, "jsonl")
    with pytest.raises(NBestFormatError, match=r"l\.jsonl"):
        read_nbest(jsonl, "espnet")

    bundle = tmp_path / "bundle"
    subprocess.run(["cp", "-r", str(bundles[("full", 0.0)][1]), str(bundle)], check=True)
    manifest = json.loads((bundle / "manifest.json").read_text())
    del manifest["model"]["layers"]
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="model.layers"):
        Bundle.load(bundle)

    from lmserve.rescoring.scorer import Scorer

    subprocess.run(["cp", "-r", str(bundles[("full", 0.0)][1]), str(bundle.with_name("b2"))], check=True)
    bundle = bundle.with_name("b2")
    graph = bundle / "step.onnx"
    graph.write_bytes(graph.read_bytes()[:1000])
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["files"]["step.onnx"] = sha256_file(graph)
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="step.onnx"):
        Scorer(bundle, threads=1)


def test_no_traceback_for_a_bad_flag_a_bad_config_or_ctrl_c(tmp_path, bundles):
    empty = run_cli("-m", "lmserve.training.cli", "fit", "")
    assert empty.returncode == 2 and "Traceback" not in empty.stderr and len(empty.stderr.splitlines()) == 1
    big = tmp_path / "big.jsonl"
    write_nbest(lists(20000, hyps=5, words=12), big, "jsonl")
    weights = weights_file(tmp_path / "w.json", bundles[("full", 0.0)][1])
    args = [
        "-m",
        "lmserve.rescoring.commands.cli",
        "nbest",
        str(big),
        "--weights",
        str(weights),
        "--out",
        str(tmp_path / "o.jsonl"),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("LMSERVE_DEBUG", None)
    # a shell's background job (`make test &`) ignores SIGINT and its children inherit that: Ctrl-C as a terminal has it
    default_sigint = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
    proc = subprocess.Popen(
        [sys.executable, *args], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint
    )
    # Ctrl-C once the models run (their progress bar is on stderr): a fixed wait raced a run that got faster
    seen = ""
    while "LM scores" not in seen and proc.poll() is None:
        seen += proc.stderr.read(1)
    proc.send_signal(signal.SIGINT)
    err = seen + proc.communicate(timeout=60)[1]
    # the message ends stderr (after the progress bar, which may stop mid-line)
    assert proc.returncode == 130 and err.rstrip().endswith("lm-rescore: interrupted") and "Traceback" not in err
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary files left
    debug = run_cli(
        "-m",
        "lmserve.rescoring.commands.cli",
        "nbest",
        str(tmp_path / "nope.jsonl"),
        "--weights",
        str(weights),
        "--out",
        "x.jsonl",
        debug=True,
    )
    assert debug.returncode == 1 and "Traceback" in debug.stderr


# -- 6. weights files work from anywhere -------------------------------------------------------------------------------


def test_weights_name_models_relative_to_themselves(tmp_path, bundles, monkeypatch, capsys):
    work = tmp_path / "work"
    (work / "models").mkdir(parents=True)
    subprocess.run(["cp", "-r", str(bundles[("full", 0.0)][1]), str(work / "models" / "lm")], check=True)
    dev = work / "dev.jsonl"
    write_nbest(lists(12), dev, "jsonl")
    monkeypatch.chdir(work)
    tune = ["tune", "dev.jsonl", "--lm", "models/lm", "--metric", "wer", "--features", "am,neural", "--restarts", "1"]
    assert rescore_main([*tune, "--quiet", "--out", "rescore/dev.weights.json"]) == 0
    assert json.loads((work / "rescore" / "dev.weights.json").read_text())["setup"]["lm"] == "../models/lm"
    monkeypatch.chdir(tmp_path)
    args = ["nbest", "work/dev.jsonl", "--weights", "work/rescore/dev.weights.json", "--out", "o.jsonl", "--quiet"]
    assert rescore_main(args) == 0
    (work / "models" / "lm").rename(work / "models" / "gone")
    assert rescore_main(args) == 2
    assert "work/rescore/dev.weights.json" in capsys.readouterr().err  # the error names the weights file


# -- 7. non-finite features --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("l.jsonl", '{"id": "u", "hypotheses": [{"text": "a", "features": {"am": Infinity}}]}\n'),
        ("l.jsonl", '{"id": "u", "hypotheses": [{"text": "a", "features": {"am": 1e999}}]}\n'),
        ("l.kbest", "0 ||| a ||| am=inf ||| -1\n"),
        ("l.kbest", "0 ||| a ||| am=-1 ||| -inf\n"),
    ],
)
def test_infinite_features_are_refused(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(NBestFormatError, match=rf"{name}:1: field .*(expected a finite number|is not name=number)"):
        read_nbest(path)


# -- 8. a length limit, the server's ----------------------------------------------------------------------------------


def test_over_long_hypotheses_are_refused_with_the_servers_limit(tmp_path):
    from lmserve.rescoring.nbest import MAX_WORDS
    from lmserve.server.config import Limits

    assert Limits().max_words == MAX_WORDS
    path = tmp_path / "l.jsonl"
    long = " ".join(["w1"] * (MAX_WORDS + 1))
    path.write_text(json.dumps({"id": "u", "hypotheses": [{"text": "w1"}, {"text": long}]}) + "\n")
    with pytest.raises(
        NBestFormatError, match=rf"l\.jsonl:1: field 'hypotheses\[1\]': a hypothesis of {MAX_WORDS + 1} words"
    ):
        read_nbest(path)
    assert len(read_nbest(path, max_words=MAX_WORDS + 1)) == 1


# -- 9. --version, score --normalize -----------------------------------------------------------------------------------


def test_version_and_score_normalize(tmp_path, bundles):
    for module in ("lmserve.training.cli", "lmserve.rescoring.commands.cli", "lmserve.server.cli"):
        done = run_cli("-m", module, "--version")
        assert done.returncode == 0 and "lmserve" in done.stdout, module
    from lmserve.core.textnorm import PRESETS
    from lmserve.rescoring.scorer import Scorer

    bundle = bundles[("full", 0.0)][1]
    text = tmp_path / "s.txt"
    text.write_text("W1 W2 W3\n")
    done = run_cli(
        "-m",
        "lmserve.rescoring.commands.cli",
        "score",
        "--lm",
        str(bundle),
        "--input",
        str(text),
        "--normalize",
        "lower",
    )
    assert done.returncode == 0, done.stderr
    want = Scorer(bundle, threads=1, normalizer=PRESETS["lower"]).score(["W1 W2 W3"])[0].logprob
    assert float(done.stdout) == pytest.approx(want, abs=1e-5)


# -- 10. bundle file names stay in the bundle --------------------------------------------------------------------------


def test_bundle_file_names_are_confined_to_the_bundle(tmp_path, bundles):
    bundle = tmp_path / "bundle"
    subprocess.run(["cp", "-r", str(bundles[("full", 0.0)][1]), str(bundle)], check=True)
    (tmp_path / "x.onnx").write_bytes((bundle / "step.onnx").read_bytes())
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["files"]["../x.onnx"] = manifest["files"].pop("step.onnx")
    manifest["graphs"]["step"] = "../x.onnx"
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match=r"'\.\./x\.onnx'.*inside the bundle"):
        Bundle.load(bundle)
