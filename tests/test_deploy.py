"""The deployment files agree with the server and with each other: the Kubernetes manifests parse, their probes and
Service reach the container's gRPC port, the ConfigMap's config is one the server loads, and the container's
entry point hands its environment to ``lm-serve serve``. No cluster and no container runtime needed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lmserve.server.app import LIVENESS, READINESS
from lmserve.server.config import load_config

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))


def manifests() -> dict[str, dict]:
    docs = [doc for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]
    by_kind = {doc["kind"]: doc for doc in docs}
    assert len(by_kind) == len(docs), "one object of each kind"
    return by_kind


def containerfile_env() -> dict[str, str]:
    """The runtime stage's ENV (one ENV instruction with continuation lines)."""
    text = (DEPLOY / "Containerfile").read_text().replace("\\\n", " ")
    env_line = [line for line in text.splitlines() if line.startswith("ENV ")][-1]
    return dict(re.findall(r"(\w+)=(\S+)", env_line))


def lmserve_container() -> dict:
    (container,) = manifests()["Deployment"]["spec"]["template"]["spec"]["containers"]
    return container


def test_the_manifests_parse_into_the_objects_a_deployment_needs():
    objects = manifests()
    assert set(objects) == {"ConfigMap", "Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget"}
    for obj in objects.values():
        assert obj["apiVersion"] and obj["metadata"]["name"]


def test_the_probes_are_grpc_health_checks_on_the_containers_grpc_port():
    container = lmserve_container()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    env = {e["name"]: e["value"] for e in container["env"]}
    assert ports["grpc"] == int(env["LMSERVE_PORT"]) == int(containerfile_env()["LMSERVE_PORT"])
    assert ports["metrics"] == int(env["LMSERVE_METRICS_PORT"])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == ports["grpc"], probe


def test_the_probes_ask_for_the_health_services_the_server_reports_liveness_and_readiness_on():
    """Readiness may fail when the pod is full (service lmserve.v1.LMService: NOT_SERVING at max_concurrent_calls);
    liveness and startup must not (service "": a busy pod is alive, and restarting it would lose its calls)."""
    container = lmserve_container()
    assert container["readinessProbe"]["grpc"].get("service", "") == READINESS
    for probe in ("startupProbe", "livenessProbe"):
        assert container[probe]["grpc"].get("service", "") == LIVENESS != READINESS, probe


def test_pods_and_their_container_run_under_the_runtimes_default_seccomp_profile():
    pod = manifests()["Deployment"]["spec"]["template"]["spec"]
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert lmserve_container()["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}


def test_the_disruption_budget_covers_the_pods_and_leaves_one_serving():
    objects = manifests()
    budget = objects["PodDisruptionBudget"]["spec"]
    pod_labels = objects["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert budget["selector"]["matchLabels"].items() <= pod_labels.items()
    least = objects["HorizontalPodAutoscaler"]["spec"]["minReplicas"]
    available = budget["minAvailable"] if "minAvailable" in budget else least - budget["maxUnavailable"]
    assert 1 <= available < least  # a drain can always move a pod, and never takes the last


def test_the_headless_service_selects_the_pods_and_names_their_ports():
    objects = manifests()
    service = objects["Service"]["spec"]
    pod = objects["Deployment"]["spec"]["template"]
    assert service["clusterIP"] == "None"  # DNS gives every pod's address: the client balances call by call
    assert service["selector"].items() <= pod["metadata"]["labels"].items()
    names = {p["name"] for p in lmserve_container()["ports"]}
    assert {p["targetPort"] for p in service["ports"]} <= names


def test_the_autoscaler_scales_the_deployment_on_its_cpu_request():
    objects = manifests()
    target = objects["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", objects["Deployment"]["metadata"]["name"])
    resources = lmserve_container()["resources"]
    assert "cpu" in resources["requests"]  # utilisation is measured against the request


def test_the_config_map_is_a_config_the_server_loads_and_the_pod_mounts_where_it_reads(tmp_path):
    objects = manifests()
    container = lmserve_container()
    (key,) = objects["ConfigMap"]["data"]
    path = tmp_path / key
    path.write_text(objects["ConfigMap"]["data"][key])
    config = load_config(path)  # unknown keys and wrong types would raise, naming the key
    env = {e["name"]: e["value"] for e in container["env"]}
    volumes = {v["name"]: v for v in objects["Deployment"]["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    config_volume = next(name for name, v in volumes.items() if "configMap" in v)
    assert volumes[config_volume]["configMap"]["name"] == objects["ConfigMap"]["metadata"]["name"]
    assert env["LMSERVE_CONFIG"] == f"{mounts[config_volume]}/{key}"
    assert config.server.metrics_port == int(env["LMSERVE_METRICS_PORT"])
    spec = objects["Deployment"]["spec"]["template"]["spec"]
    assert spec["terminationGracePeriodSeconds"] > config.server.grace_seconds  # the drain ends before the kill
    for model in config.models.values():
        for file in (model.bundle, model.ngram, *model.profiles.values()):
            assert file is None or file.is_relative_to(mounts["models"]), file


def test_the_images_default_config_loads_and_serves_a_model_under_models():
    config = load_config(DEPLOY / "serve.toml")
    assert [m.bundle for m in config.models.values()] == [Path("/models/default")]


def test_the_image_runs_as_the_user_the_pods_require():
    text = (DEPLOY / "Containerfile").read_text()
    (user,) = re.findall(r"^USER (\d+):(\d+)$", text, flags=re.M)
    security = manifests()["Deployment"]["spec"]["template"]["spec"]["securityContext"]
    assert security["runAsNonRoot"] and (security["runAsUser"], security["runAsGroup"]) == tuple(map(int, user))


def entrypoint(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    """deploy/entrypoint.sh with this venv's lm-serve on PATH and only ``env`` of the LMSERVE_ variables."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("LMSERVE_")}
    base["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{base['PATH']}"
    return subprocess.run(
        ["sh", str(DEPLOY / "entrypoint.sh"), *args], env={**base, **env}, capture_output=True, text=True, timeout=60
    )


def test_the_entry_point_serves_the_config_that_lmserve_config_names(tmp_path):
    missing = tmp_path / "nowhere.toml"
    result = entrypoint({"LMSERVE_CONFIG": str(missing)})
    assert result.returncode != 0
    assert str(missing) in result.stderr


@pytest.mark.parametrize("variable, flag", [("LMSERVE_PORT", "--port"), ("LMSERVE_METRICS_PORT", "--metrics-port")])
def test_the_entry_point_passes_ports_from_the_environment(tmp_path, variable, flag):
    result = entrypoint({"LMSERVE_CONFIG": str(tmp_path / "x.toml"), variable: "not-a-port"})
    assert result.returncode == 2  # argparse refused the value: it reached lm-serve's option
    assert f"{flag}: invalid int value: 'not-a-port'" in result.stderr


# -- the walkthrough as written ----------------------------------------------------------------------------------

MODELS = DEPLOY / "kubernetes" / "models"
GUIDE = [DEPLOY.parent / "README.md", *sorted((DEPLOY.parent / "docs").rglob("*.md"))]


def test_every_documented_podman_run_has_a_read_only_root():
    runs = [
        f"{path.name}: {line.strip()}"
        for path in sorted(DEPLOY.rglob("*"))
        if path.is_file()
        for line in path.read_text().splitlines()
        if "podman.sh run" in line or "podman run" in line
    ]
    assert runs and all("--read-only" in run for run in runs), runs


def test_the_autoscaler_alone_sets_the_number_of_pods():
    assert "replicas" not in manifests()["Deployment"]["spec"]  # kubectl apply would reset the autoscaler's count


def fake_command(tmp_path: Path, name: str, script: str) -> Path:
    """A stand-in for ``name`` that logs its arguments to ``name.log`` and then runs ``script``."""
    path = tmp_path / name
    path.write_text(f'#!/bin/sh\necho "$@" >> "{tmp_path / name}.log"\n{script}\n')
    path.chmod(0o755)
    return path


def test_the_models_volume_is_defined_filled_with_what_the_guide_writes_and_named_by_the_config(tmp_path):
    pvc, loader = (yaml.safe_load((MODELS / name).read_text()) for name in ("pvc.yaml", "loader.yaml"))
    volumes = {v["name"]: v for v in manifests()["Deployment"]["spec"]["template"]["spec"]["volumes"]}
    claim = volumes["models"]["persistentVolumeClaim"]["claimName"]
    assert pvc["kind"] == "PersistentVolumeClaim" and pvc["metadata"]["name"] == claim
    assert loader["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == claim
    (key,) = manifests()["ConfigMap"]["data"]
    (tmp_path / key).write_text(manifests()["ConfigMap"]["data"][key])
    model = next(iter(load_config(tmp_path / key).models.values()))
    served = {str(p) for p in (model.bundle, model.ngram, *model.profiles.values())}

    env = {**os.environ, "KUBECTL": str(fake_command(tmp_path, "kubectl", ""))}
    work = tmp_path / "work"  # a checkout, run from its root
    work.mkdir()
    missing = subprocess.run(["sh", str(MODELS / "load.sh")], cwd=work, env=env, capture_output=True, text=True)
    assert missing.returncode == 1 and "run the LibriSpeech rescoring session first" in missing.stderr
    copied = re.search(r'models="([^"]+)"', (MODELS / "load.sh").read_text())[1].split()
    for name in copied:
        (work / "var" / name).parent.mkdir(parents=True, exist_ok=True)
        (work / "var" / name).write_text("x")
    done = subprocess.run(["sh", str(MODELS / "load.sh")], cwd=work, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    calls = (tmp_path / "kubectl.log").read_text().splitlines()
    assert calls[0].startswith("apply") and calls[1].startswith("wait") and calls[-1].startswith("delete")
    targets = [call.split()[-1].split(":", 1)[1] for call in calls if call.startswith("cp ")]
    assert set(targets) == served  # the config serves exactly what is copied in

    written = set()  # what the guide's commands write: --out of export, tune (a file) and ngram build (NAME.bin)
    for path in GUIDE:
        for out in re.findall(r"--out (var/\S+)", path.read_text()):
            written |= {out, f"{out}.bin"}
    assert {f"var/{name}" for name in copied} <= written, written


@pytest.mark.parametrize("failure", ["ERROR: No matching distribution found for grpcio>=1.85.1", "ERROR: disk full"])
def test_the_image_build_says_which_flag_a_tls_intercepting_proxy_needs(tmp_path, failure):
    podman = fake_command(tmp_path, "podman", f'case "$1" in build) echo "{failure}"; exit 1;; esac')
    env = {**os.environ, "PODMAN": str(podman)}
    done = subprocess.run(["sh", str(DEPLOY / "build-image.sh")], env=env, capture_output=True, text=True)
    assert done.returncode == 1 and failure in done.stdout
    advised = "deploy/build-image.sh --pip-ca /etc/ssl/certs/ca-certificates.crt" in done.stderr
    assert advised == ("No matching distribution" in failure), done.stderr


def test_the_image_build_passes_the_proxys_ca_and_mentions_the_builder_image_it_leaves(tmp_path):
    podman = fake_command(tmp_path, "podman", 'case "$1" in images) echo "0123abcd 1.1 GB";; esac')
    (tmp_path / "ca.pem").write_text("-----BEGIN CERTIFICATE-----\n")
    env = {**os.environ, "PODMAN": str(podman)}
    done = subprocess.run(
        ["sh", str(DEPLOY / "build-image.sh"), "--pip-ca", str(tmp_path / "ca.pem"), "localhost/lmserve:test"],
        env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    build = (tmp_path / "podman.log").read_text().splitlines()[0]
    assert f"--secret id=pip_ca,src={tmp_path / 'ca.pem'}" in build and "-t localhost/lmserve:test" in build
    assert "--format docker" in build and "-f " in build
    assert "untagged image" in done.stderr and "0123abcd 1.1 GB" in done.stderr and "image prune" in done.stderr
