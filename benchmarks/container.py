"""The lm-serve container, built and run on this machine: the base image from Debian packages, the image from
deploy/Containerfile, its size and contents, start-to-healthy time, the first ScoreSentences answer through the
project's client from the host, and a SIGTERM stop. Any step that fails is recorded with its exact error, and the
result file is written either way (``ok`` 1/0).

    python -m benchmarks.container [--reuse-base] [--cache]

Needs root and podman (deploy/build-base.sh installs podman, mmdebstrap and runc with apt when missing), a Debian
mirror and PyPI (the builder downloads and compiles the runtime wheels), and the demo model of ``make demo``
(var/bundles/demo, var/ngrams/demo_3gram.bin). Podman's storage: var/podman (deploy/podman.sh). The container runs
as the Kubernetes pods do (deploy/kubernetes): read-only root file system, the config and models mounted read-only,
the address and port from LMSERVE_* variables; on the host network, listening on 127.0.0.1 only. Not part of
``make test``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from google.protobuf.json_format import MessageToDict

from benchmarks.common import COMMIT_AT_START, ROOT, write_result
from lmserve.rescoring.client import LMServeClient
from lmserve.rescoring.scorer import Scorer

PODMAN = ROOT / "deploy" / "podman.sh"
BASE = "localhost/lmserve-base:bookworm"
BUNDLE = ROOT / "var" / "bundles" / "demo"
NGRAM = ROOT / "var" / "ngrams" / "demo_3gram.bin"
SENTENCE = "the cat sat on the mat"
# a host behind a TLS-intercepting proxy: its CA bundle goes to the builder as the pip_ca secret (deploy/Containerfile)
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
CONFIG = f"""# benchmarks/container.py: the demo model with its 3-gram (the kenlm module of the image answers), no text
# normalisation so that the host's own scorer gives the comparison score
[server]
workers = 2
grace_seconds = 10.0

[models.demo]
bundle = "/models/demo"
ngram = "/models/{NGRAM.name}"
lambda = 0.5
"""
# what the runtime image must not contain, and what it must be
IMAGE_CHECKS = r"""
id -u
for tool in gcc g++ cc c++ make pip pip3; do command -v $tool; done
python -c 'import importlib.util as u; print("torch" if u.find_spec("torch") else "no torch")'
python -c 'import importlib.metadata as m; print(*(f"{d.name}=={d.version}" for d in m.distributions()))'
du -sm /opt/lmserve | cut -f1
"""


class StepFailed(RuntimeError):
    """A step of the run failed; the message is what the result file records."""


def podman(*args: str, check: bool = True, timeout: float = 1800) -> subprocess.CompletedProcess:
    result = subprocess.run([str(PODMAN), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise StepFailed(f"podman {' '.join(args[:2])}: exit {result.returncode}: {result.stderr.strip()[-3000:]}")
    return result


def timed(command: list[str]) -> float:
    start = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        tail = (result.stdout + result.stderr).strip()[-3000:]
        raise StepFailed(f"{' '.join(command[:3])}: exit {result.returncode}: {tail}")
    return time.perf_counter() - start


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build(image: str, reuse_base: bool, cache: bool, metrics: dict) -> None:
    if reuse_base and podman("image", "exists", BASE, check=False).returncode == 0:
        metrics["base_build_s"] = None
    else:
        metrics["base_build_s"] = round(timed(["sh", "deploy/build-base.sh", BASE]), 1)
    metrics["base_size_mb"] = round(int(podman("image", "inspect", "--format", "{{.Size}}", BASE).stdout) / 1e6, 1)
    command = [str(PODMAN), "build", "--network", "host", "--format", "docker", "-f", "deploy/Containerfile"]
    command += ["--build-arg", f"BASE={BASE}", "-t", image, "-t", "localhost/lmserve:latest"]
    if HOST_CA.exists():
        command += ["--secret", f"id=pip_ca,src={HOST_CA}"]
    if not cache:
        command.append("--no-cache")
    metrics["image_build_s"] = round(timed([*command, "."]), 1)
    metrics["image_build_cached"] = int(cache)
    metrics["image_size_mb"] = round(int(podman("image", "inspect", "--format", "{{.Size}}", image).stdout) / 1e6, 1)


def inspect_image(image: str, metrics: dict) -> dict:
    out = podman("run", "--rm", "--entrypoint", "sh", image, "-c", IMAGE_CHECKS).stdout.split("\n")
    uid, *rest = [line for line in out if line]
    tools, (torch, packages, venv_mb) = rest[:-3], rest[-3:]
    metrics["image_uid"] = int(uid)
    metrics["image_has_torch"] = int(torch == "torch")
    metrics["image_compilers_or_pip"] = len(tools)
    metrics["image_venv_mb"] = int(venv_mb)
    versions = dict(p.split("==") for p in packages.split())
    return {"build_tools_found": tools, "packages": dict(sorted(versions.items()))}


def run_container(image: str, folder: Path, metrics: dict) -> dict:
    """Start the container, wait for its own HEALTHCHECK to pass, ask it one ScoreSentences, stop it."""
    config = folder / "serve.toml"
    config.write_text(CONFIG)
    port = free_port()
    name = f"lmserve-bench-{os.getpid()}"
    run = ["run", "-d", "--name", name, "--network", "host", "--read-only", "--health-interval", "disable"]
    run += ["-e", "LMSERVE_HOST=127.0.0.1", "-e", f"LMSERVE_PORT={port}"]
    run += ["-v", f"{BUNDLE}:/models/demo:ro", "-v", f"{NGRAM}:/models/{NGRAM.name}:ro"]
    run += ["-v", f"{config}:/etc/lmserve/serve.toml:ro", image]
    details: dict = {"container": name, "port": port}
    start = time.perf_counter()
    podman(*run)
    try:
        checks = 0
        while True:
            checks += 1
            if podman("healthcheck", "run", name, check=False).returncode == 0:
                metrics["start_to_healthy_s"] = round(time.perf_counter() - start, 2)
                break
            state = podman("inspect", "--format", "{{.State.Status}}", name).stdout.strip()
            if state != "running" or time.perf_counter() - start > 300:
                logs = podman("logs", name, check=False)
                raise StepFailed(f"container {state}, not healthy: {(logs.stdout + logs.stderr).strip()[-3000:]}")
            time.sleep(0.25)
        metrics["health_checks_until_healthy"] = checks
        details["health_status"] = podman("inspect", "--format", "{{.State.Health.Status}}", name).stdout.strip()

        with LMServeClient(f"127.0.0.1:{port}", timeout=30) as client:
            asked = time.perf_counter()
            response = client.score_sentences([SENTENCE], per_token=True)
            metrics["first_score_ms"] = round((time.perf_counter() - asked) * 1000, 1)
        answer = MessageToDict(response, preserving_proto_field_name=True)
        neural = response.sentences[0].neural.logprob
        host = Scorer(BUNDLE, threads=1).score([SENTENCE])[0].logprob
        metrics["first_score_neural_logprob"] = neural
        metrics["host_scorer_neural_logprob"] = host
        metrics["container_vs_host_abs_diff"] = abs(neural - host)
        details["first_answer"] = {"sentence": SENTENCE, **answer}

        stopping = time.perf_counter()
        podman("stop", "-t", "30", name)
        metrics["stop_s"] = round(time.perf_counter() - stopping, 2)
        metrics["exit_code"] = int(podman("inspect", "--format", "{{.State.ExitCode}}", name).stdout)
        details["log_tail"] = podman("logs", name).stderr.strip().splitlines()[-3:]
    finally:
        podman("rm", "-f", name, check=False)
    return details


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reuse-base", action="store_true", help="keep an existing base image (no base_build_s)")
    parser.add_argument("--cache", action="store_true", help="let podman reuse cached layers (not a full build)")
    args = parser.parse_args()
    image = f"localhost/lmserve:{COMMIT_AT_START[:12]}"
    metrics: dict = {"ok": 0}
    details: dict = {"image": image, "base": BASE}
    step = "models"
    try:
        for path in (BUNDLE, NGRAM):
            if not path.exists():
                raise StepFailed(f"{path}: missing; run `make demo` first")
        step = "build"
        build(image, args.reuse_base, args.cache, metrics)
        step = "inspect image"
        details.update(inspect_image(image, metrics))
        step = "run"
        with tempfile.TemporaryDirectory(prefix="lmserve-container-") as folder:
            details.update(run_container(image, Path(folder), metrics))
        metrics["ok"] = 1
    except (StepFailed, OSError, subprocess.TimeoutExpired) as e:
        details["failed_step"] = step
        details["error"] = str(e)
    except Exception as e:  # a gRPC error or anything else: recorded, not lost
        details["failed_step"] = step
        details["error"] = f"{type(e).__name__}: {e}"
    training = subprocess.run(["pgrep", "-f", "training.cli fit"], capture_output=True, text=True).stdout.split()
    details["training_running_beside"] = len(training) > 0  # then the times are upper bounds
    write_result("container", metrics, **details)
    print(json.dumps({"metrics": metrics, **{k: details[k] for k in ("failed_step", "error") if k in details}}))
    return 0 if metrics["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
