"""The lm-serve container, built and run on this machine: the base image from Debian packages, the image from
deploy/Containerfile, what the runtime holds (no torch, no compilers or pip, not root), start to healthy as its own
HEALTHCHECK says, a ``ScoreSentences`` answer through the project's client from the host equal to the host's scorer,
and a clean stop on SIGTERM.

It runs the container as the Kubernetes pods do (deploy/kubernetes): read-only root file system, the config and models
mounted read-only, the address and port from LMSERVE_* variables; on the host network, listening on 127.0.0.1 only.
Only with ``LMSERVE_TEST_CONTAINER=1``: it needs root and podman (deploy/build-base.sh installs podman, mmdebstrap and
runc with apt when missing), a Debian mirror and PyPI (the builder downloads and compiles the runtime wheels), and
minutes. An existing base image is reused and podman's layer cache is on (``deploy/podman.sh image rm
localhost/lmserve-base:bookworm`` and ``deploy/podman.sh system prune -a`` build from scratch).
"""

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest
from conftest import ROOT, make_sentences

from lmserve.rescoring.client import LMServeClient
from lmserve.rescoring.ngram import build_ngram
from lmserve.rescoring.scorer import Scorer

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("LMSERVE_TEST_CONTAINER") != "1",
        reason="builds the serving image with podman as root from a Debian mirror (about 10 minutes, more than CI's budget allows beside the suite); run it where podman may run with LMSERVE_TEST_CONTAINER=1 (docs/deployment.md)",
    ),
]

PODMAN = ROOT / "deploy" / "podman.sh"
BASE = "localhost/lmserve-base:bookworm"
IMAGE = "localhost/lmserve:test"
# a host behind a TLS-intercepting proxy: its CA bundle goes to the builder as the pip_ca secret (deploy/Containerfile)
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
SENTENCE = "w1 w2 w3 w4"
CONFIG = """[server]
workers = 2
grace_seconds = 10.0

[models.tiny]
bundle = "/models/tiny"
ngram = "/models/lm.bin"
lambda = 0.5
"""
# what the runtime image must not contain, and what it must be
IMAGE_CHECKS = r"""
id -u
for tool in gcc g++ cc c++ make pip pip3; do command -v $tool; done
python -c 'import importlib.util as u; print("torch" if u.find_spec("torch") else "no torch")'
"""


def podman(*args: str, check: bool = True, timeout: float = 1800) -> subprocess.CompletedProcess:
    done = subprocess.run([str(PODMAN), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert not check or done.returncode == 0, (
        f"podman {' '.join(args[:2])}: exit {done.returncode}: {done.stderr[-3000:]}"
    )
    return done


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def image() -> str:
    if podman("image", "exists", BASE, check=False).returncode != 0:
        subprocess.run(["sh", "deploy/build-base.sh", BASE], cwd=ROOT, check=True, timeout=3600)
    command = [str(PODMAN), "build", "--network", "host", "--format", "docker", "-f", "deploy/Containerfile"]
    command += ["--build-arg", f"BASE={BASE}", "-t", IMAGE]
    if HOST_CA.exists():
        command += ["--secret", f"id=pip_ca,src={HOST_CA}"]
    built = subprocess.run([*command, "."], cwd=ROOT, capture_output=True, text=True, timeout=3600)
    assert built.returncode == 0, (built.stdout + built.stderr)[-3000:]
    return IMAGE


def test_the_runtime_image_holds_no_torch_no_build_tools_and_runs_as_a_user(image):
    uid, *tools, torch = [
        line
        for line in podman("run", "--rm", "--entrypoint", "sh", image, "-c", IMAGE_CHECKS).stdout.split("\n")
        if line
    ]
    assert int(uid) != 0 and not tools and torch == "no torch"


def test_the_container_gets_healthy_answers_as_the_host_scorer_and_stops_on_sigterm(image, bundles, tmp_path):
    bundle = bundles[("full", 0.0)][1]
    build_ngram((s.split() for s in make_sentences(300, seed=1)), 3, tmp_path / "lm", discount_fallback=True)
    (tmp_path / "serve.toml").write_text(CONFIG)
    port, name = free_port(), f"lmserve-test-{os.getpid()}"
    run = ["run", "-d", "--name", name, "--network", "host", "--read-only", "--health-interval", "disable"]
    run += ["-e", "LMSERVE_HOST=127.0.0.1", "-e", f"LMSERVE_PORT={port}"]
    run += ["-v", f"{bundle}:/models/tiny:ro", "-v", f"{tmp_path / 'lm.bin'}:/models/lm.bin:ro"]
    run += ["-v", f"{tmp_path / 'serve.toml'}:/etc/lmserve/serve.toml:ro", image]
    podman(*run)
    try:
        start = time.monotonic()
        while podman("healthcheck", "run", name, check=False).returncode != 0:
            state = podman("inspect", "--format", "{{.State.Status}}", name).stdout.strip()
            logs = podman("logs", name, check=False)
            assert state == "running", f"container {state}: {(logs.stdout + logs.stderr)[-3000:]}"
            assert time.monotonic() - start < 300, f"not healthy in 300 s: {(logs.stdout + logs.stderr)[-3000:]}"
            time.sleep(0.25)
        with LMServeClient(f"127.0.0.1:{port}", timeout=30) as client:
            answer = client.score_sentences([SENTENCE], per_token=True).sentences[0]
        assert answer.neural.logprob == pytest.approx(Scorer(bundle, threads=1).score([SENTENCE])[0].logprob, abs=1e-4)
        podman("stop", "-t", "30", name)
        assert podman("inspect", "--format", "{{.State.ExitCode}}", name).stdout.strip() == "0"
    finally:
        podman("rm", "-f", name, check=False)
