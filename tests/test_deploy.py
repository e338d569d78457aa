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
    assert set(objects) == {"ConfigMap", "Deployment", "Service", "HorizontalPodAutoscaler"}
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
