"""The wheel works anywhere: built from this checkout, installed without its dependencies into a fresh virtual
environment (which borrows them from this one, so no network is needed), it brings one top-level package, every module
of the checkout, and ``lm-train``, ``lm-rescore`` and ``lm-serve`` that work from a temporary folder on a small model
trained there.

The wheel is built from a copy of what it is made of (``pyproject.toml``, ``README.md``, ``lmserve/`` and the three
folders it maps), so setuptools' ``build/`` and ``*.egg-info`` stay out of the checkout, and installed with
``--no-deps``; the fresh environment borrows its dependencies from this one's site-packages through a ``.pth`` line.
A path line does not run the ``.pth`` files inside that path: the editable install of the checkout stays out, and
``import lmserve`` finds the wheel (:func:`check_import`). Every command runs in a temporary folder with the checkout
off ``sys.path``; the data folder comes from ``--data-dir`` or ``LMSERVE_DATA``, KenLM's programs from
``LMSERVE_KENLM_BIN``.

About 30 s (a wheel build, a venv, a training run, an export and a server): the one test of the installed package.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from lmserve.rescoring.ngram import find_program

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow  # a wheel build, a venv, a training run and a server

WHEEL_SOURCES = ("pyproject.toml", "README.md", "lmserve", "training", "rescoring", "server")
CLI_TIMEOUT = 300
SERVE_STEP = "lm-serve serve + client score"


@dataclass
class Install:
    wheel: Path
    venv: Path
    wheel_names: list[str]

    @property
    def bin(self) -> Path:
        return self.venv / "bin"

    @property
    def python(self) -> Path:
        return self.bin / "python"


def build_wheel(dist: Path, source: Path = ROOT) -> Path:
    """``pip wheel --no-deps --no-build-isolation`` of a copy of ``source``'s packaged files; the wheel's path."""
    copy = dist / "src"
    for name in WHEEL_SOURCES:
        if (source / name).is_dir():
            shutil.copytree(source / name, copy / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            copy.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source / name, copy / name)
    command = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation"]
    run([*command, "--wheel-dir", str(dist), str(copy)], cwd=dist)
    (wheel,) = dist.glob("lmserve-*.whl")
    return wheel


def fresh_venv(venv: Path) -> None:
    """A new virtual environment (without pip: this one's pip installs into it) whose site-packages reaches this
    environment's packages through a ``.pth`` line."""
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    site = Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}))
    ours = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    (site / "dependencies.pth").write_text("".join(f"{path}\n" for path in sorted(ours)))


def pip_into(venv: Path, *args: str) -> str:
    return run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), *args]).stdout


def install(work: Path) -> Install:
    """Build the wheel into ``work/dist`` and install it into the fresh venv ``work/venv``."""
    wheel = build_wheel(work / "dist")
    fresh_venv(work / "venv")
    pip_into(work / "venv", "install", "--quiet", "--no-deps", "--no-index", str(wheel))
    with zipfile.ZipFile(wheel) as archive:
        return Install(wheel, work / "venv", archive.namelist())


def pip_show_top_level(venv: Path) -> list[str]:
    """The top-level names of the files ``pip show --files lmserve`` lists, but its ``*.dist-info`` and the scripts
    (``../../../bin/``)."""
    listed = pip_into(venv, "show", "--files", "lmserve").split("Files:", 1)[1].split()
    return sorted(top_level_packages([f for f in listed if not f.startswith("..")]))


def top_level_packages(names: list[str]) -> set[str]:
    """The wheel's top-level names apart from its ``*.dist-info``."""
    return {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without what would put the checkout on ``sys.path`` or pick KenLM's programs for us."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LMSERVE_DATA", "LMSERVE_KENLM_BIN")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if not shutil.which("lmplz", path=p))
    env["PYTHONNOUSERSITE"] = "1"
    return {**env, **extra}


def check_import(target: Install, cwd: Path) -> dict:
    """Where the fresh environment finds ``lmserve`` and its version's metadata."""
    code = (
        "import json, importlib.metadata as m, lmserve, lmserve.training, lmserve.rescoring.client, lmserve.server; "
        "print(json.dumps({'file': lmserve.__file__, 'training': lmserve.training.__file__, "
        "'version': lmserve.__version__, 'metadata': str(m.distribution('lmserve').locate_file('lmserve'))}))"
    )
    return json.loads(run([str(target.python), "-c", code], cwd=cwd, env=clean_env()).stdout)


def make_sentences(n: int, seed: int, vocab_size: int = 30) -> list[str]:
    """A random bigram chain over a Zipf-ish vocabulary, the same chain for every seed."""
    rng, chain = np.random.default_rng(seed), np.random.default_rng(0)
    unigram = 1.0 / np.arange(1, vocab_size + 1)
    transitions = chain.dirichlet(unigram * 3, size=vocab_size)
    sentences = []
    for _ in range(n):
        word = int(rng.choice(vocab_size, p=unigram / unigram.sum()))
        words = [word]
        for _ in range(int(rng.integers(1, 10))):
            word = int(rng.choice(vocab_size, p=transitions[word]))
            words.append(word)
        sentences.append(" ".join(f"w{w}" for w in words))
    return sentences


CONFIG = """\
[data]
train = "{data}/train.txt"
valid = "{data}/valid.txt"
test = "{data}/valid.txt"
mode = "sentence"

[model]
embedding_size = 16
hidden_size = 16
layers = 1

[optimizer]
name = "adam"
lr = 0.02

[train]
batch_size = 16
eval_batch_size = 8
epochs = 1
threads = 1
"""


def write_inputs(work: Path) -> None:
    """``data/`` (the shared data folder of this run), the config, sentences to score and a small n-best list."""
    (work / "data").mkdir(parents=True)
    (work / "data" / "train.txt").write_text("\n".join(make_sentences(300, seed=1)) + "\n")
    (work / "data" / "valid.txt").write_text("\n".join(make_sentences(30, seed=2)) + "\n")
    (work / "config.toml").write_text(CONFIG)
    (work / "sentences.txt").write_text("\n".join(make_sentences(5, seed=3)) + "\n")
    rng = np.random.default_rng(4)
    with (work / "dev.jsonl").open("w") as f:
        for k, reference in enumerate(make_sentences(12, seed=5)):
            others = make_sentences(3, seed=100 + k)
            texts = [reference, *others]
            rng.shuffle(texts)
            hypotheses = [{"text": t, "features": {"am": float(-rng.uniform(5, 10))}} for t in texts]
            f.write(json.dumps({"id": f"u{k}", "hypotheses": hypotheses, "references": [reference]}) + "\n")
    (work / "serve.toml").write_text(
        '[server]\nworkers = 1\nmetrics_port = -1\n\n[models.tiny]\nbundle = "bundle"\nngram = "ngram/lm.bin"\n'
    )


def cli_steps(target: Install, work: Path, kenlm_bin: Path) -> dict[str, dict]:
    """Each command from ``work``: ``{name: {"ok", "detail"}}``; a failed step ends the sequence."""
    bin_ = target.bin
    data = {"LMSERVE_DATA": str(work / "data")}
    kenlm = {"LMSERVE_KENLM_BIN": str(kenlm_bin)}
    steps = [
        ("python -m lmserve.training --version", [target.python, "-m", "lmserve.training", "--version"], {}),
        ("lm-train fit", [bin_ / "lm-train", "--data-dir", "data", "fit", "config.toml", "--out", "run"], {}),
        ("lm-train export", [bin_ / "lm-train", "export", "--checkpoint", "run", "--out", "bundle"], data),
        ("lm-rescore score", [bin_ / "lm-rescore", "score", "--lm", "bundle", "--input", "sentences.txt"], {}),
        (
            "lm-rescore ngram build without KenLM",  # must fail, saying how to get the programs
            [bin_ / "lm-rescore", "ngram", "build", "--order", "3", "--text", "data/train.txt", "--out", "ngram/x"],
            {},
        ),
        (
            "lm-rescore ngram build",
            [bin_ / "lm-rescore", "ngram", "build", "--order", "3", "--text", "data/train.txt", "--like", "bundle"]
            + ["--out", "ngram/lm", "--discount-fallback"],
            kenlm,
        ),
        (
            "lm-rescore tune",
            [bin_ / "lm-rescore", "tune", "dev.jsonl", "--metric", "wer", "--lm", "bundle", "--ngram", "ngram/lm.bin"]
            + ["--features", "am,neural,ngram", "--restarts", "1", "--quiet", "--out", "weights.json"],
            {},
        ),
        (
            "lm-rescore nbest",
            [bin_ / "lm-rescore", "nbest", "dev.jsonl", "--weights", "weights.json", "--out", "rescored.jsonl"]
            + ["--report", "report.json", "--quiet"],
            {},
        ),
    ]
    results = {}
    for name, command, env in steps:
        done = subprocess.run(
            [str(c) for c in command],
            cwd=work,
            env=clean_env(**env),
            capture_output=True,
            text=True,
            timeout=CLI_TIMEOUT,
        )
        ok, detail = judge(name, done, work)
        results[name] = {"ok": ok, "detail": detail}
        if not ok:
            return results
    ok, detail = serve_and_call(target, work)
    results[SERVE_STEP] = {"ok": ok, **detail}
    return results


def judge(name: str, done: subprocess.CompletedProcess, work: Path) -> tuple[bool, str]:
    """Whether a step did what it should, and its last words."""
    tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-5:])
    if name == "lm-rescore ngram build without KenLM":
        return done.returncode == 2 and "install-tools" in done.stderr and not (work / "ngram").exists(), tail
    if done.returncode != 0:
        return False, tail
    if name == "python -m lmserve.training --version":
        return "lmserve" in done.stdout, tail
    if name == "lm-rescore score":
        return len(done.stdout.splitlines()) == 5, tail
    if name == "lm-rescore ngram build":
        return (work / "ngram" / "lm.bin").is_file(), tail
    if name == "lm-rescore nbest":
        report = json.loads((work / "report.json").read_text())
        return report["rescored"]["wer"] <= report["1best"]["wer"] + 1e-9, tail  # tuned on the same list
    return True, tail


def serve_and_call(target: Install, work: Path) -> tuple[bool, dict]:
    """``lm-serve serve`` on a free port until it logs ``listening``, one ``lm-serve client score``, then SIGTERM."""
    command = [str(target.bin / "lm-serve"), "serve", "--config", "serve.toml", "--port", "0"]
    server = subprocess.Popen(command, cwd=work, env=clean_env(), stderr=subprocess.PIPE, text=True)
    detail: dict = {}
    try:
        port = None
        for line in server.stderr:  # (the server exits, ending this loop, when it cannot start)
            record = json.loads(line) if line.startswith("{") else {}
            if record.get("message") == "listening":
                port = record["port"]
                break
        if port is None:
            return False, {"detail": "no listening line"}
        scores = subprocess.run(
            [str(target.bin / "lm-serve"), "client", "--server", f"127.0.0.1:{port}", "score"],
            cwd=work,
            env=clean_env(),
            input=(work / "sentences.txt").read_text(),
            capture_output=True,
            text=True,
            timeout=CLI_TIMEOUT,
        )
        detail["detail"] = "\n".join((scores.stdout + scores.stderr).strip().splitlines()[-3:])
        answered = scores.returncode == 0 and len(scores.stdout.splitlines()) == 5
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            code = server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            code = server.wait()
        server.stderr.close()
    detail["exit_status"] = code
    return answered and code == 0, detail


def run(command: list, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run([str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, command))}: exit {done.returncode}\n{done.stdout}{done.stderr}")
    return done


def checkout_modules() -> set[str]:
    """Where each module of the checkout belongs in the wheel (pyproject.toml maps each folder, not the links)."""
    own = [*(ROOT / "lmserve").glob("*.py"), *(ROOT / "lmserve" / "v1").glob("*.py")]  # (not through the links)
    own += (ROOT / "lmserve" / "core").glob("*.py")
    modules = {p.relative_to(ROOT).as_posix() for p in own}
    for folder in ("training", "rescoring", "server"):
        modules |= {f"lmserve/{p.relative_to(ROOT).as_posix()}" for p in (ROOT / folder).rglob("*.py")}
    return modules


def test_the_wheel_installs_one_package_whose_commands_work_anywhere(tmp_path):
    target = install(tmp_path)
    assert top_level_packages(target.wheel_names) == {"lmserve"}
    assert pip_show_top_level(target.venv) == ["lmserve"]
    missing = checkout_modules() - set(target.wheel_names)
    assert not missing, f"not in the wheel (list the package in pyproject.toml's [tool.setuptools]): {sorted(missing)}"

    where = check_import(target, tmp_path)  # the wheel's code and metadata, not the checkout's editable install
    assert Path(where["file"]).is_relative_to(target.venv) and Path(where["training"]).is_relative_to(target.venv)
    assert Path(where["metadata"]).is_relative_to(target.venv)

    write_inputs(tmp_path / "cwd")
    steps = cli_steps(target, tmp_path / "cwd", find_program("lmplz").parent)
    failed = {name: step["detail"] for name, step in steps.items() if not step["ok"]}
    assert not failed, failed
    assert SERVE_STEP in steps and steps[SERVE_STEP]["exit_status"] == 0
