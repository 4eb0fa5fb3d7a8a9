"""deploy/: the lint (shellcheck, Kubernetes schemas) and how the manifests fit together."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.deploy.conftest import REPO

LINT = REPO / "scripts" / "lint-deploy.sh"
KUBERNETES = REPO / "deploy" / "kubernetes"
COMPOSE = REPO / "deploy" / "local" / "compose.yaml"
_VARIABLE = re.compile(r"\$\{?([A-Z][A-Z0-9_]*)|environ\[\"([A-Z][A-Z0-9_]*)")


def _lint(*files: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(LINT), *map(str, files)],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=600,  # the first run may install shellcheck and kubernetes-validate
        check=False,
    )


@pytest.fixture(scope="module")
def lint_result() -> subprocess.CompletedProcess[str]:
    """scripts/lint-deploy.sh over everything, run once."""
    return _lint()


@pytest.fixture(scope="module")
def yaml(lint_result: subprocess.CompletedProcess[str]) -> ModuleType:
    """PyYAML, which the lint installs along with kubernetes-validate."""
    return importlib.import_module("yaml")


def _load(yaml: ModuleType, path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def test_lint_passes_on_deploy_and_scripts(lint_result: subprocess.CompletedProcess[str]) -> None:
    """Every shell script passes shellcheck and every manifest the Kubernetes schemas."""
    output = lint_result.stdout + lint_result.stderr
    assert lint_result.returncode == 0, output
    for name in ("server.sbatch", "annotate.sbatch", "submit.sh", "serve.sh", "slurm-cluster.sh"):
        assert name in output, f"{name} was not checked:\n{output}"
    for manifest in ("vllm-deployment.yaml", "vllm-service.yaml", "annotator-job.yaml"):
        assert manifest in output, f"{manifest} was not checked:\n{output}"


@pytest.mark.parametrize(
    ("name", "text", "complaint"),
    [
        (
            "bad-deployment.yaml",
            "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: x}\n"
            "spec:\n  replicas: two\n  selector: {matchLabels: {a: b}}\n"
            "  template:\n    metadata: {labels: {a: b}}\n"
            "    spec: {containers: [{name: c, image: i}]}\n",
            "spec.replicas",
        ),
        ("bad.sh", "#!/usr/bin/env bash\nrm -rf $1/*\n", "SC2115"),
    ],
)
def test_lint_rejects_a_broken_file(tmp_path: Path, name: str, text: str, complaint: str) -> None:
    """A manifest against the schema, or a script shellcheck warns about, fails the lint."""
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    result = _lint(path)
    assert result.returncode != 0
    assert complaint in result.stdout + result.stderr


def test_kustomization_lists_every_manifest(yaml: ModuleType) -> None:
    """`kubectl apply -k` applies every manifest of the folder."""
    kustomization = _load(yaml, KUBERNETES / "kustomization.yaml")
    manifests = {p.name for p in KUBERNETES.glob("*.yaml") if p.name != "kustomization.yaml"}
    assert set(kustomization["resources"]) == manifests


def test_headless_service_selects_the_vllm_pods(yaml: ModuleType) -> None:
    """The Service is headless (DNS lists the pods) and reaches their HTTP port."""
    service = _load(yaml, KUBERNETES / "vllm-service.yaml")
    deployment = _load(yaml, KUBERNETES / "vllm-deployment.yaml")
    pod = deployment["spec"]["template"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"].get("publishNotReadyAddresses", False) is False
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (port,) = service["spec"]["ports"]
    (container,) = pod["spec"]["containers"]
    assert port["targetPort"] in {p["name"] for p in container["ports"]}


def test_vllm_pods_are_probed_on_health(yaml: ModuleType) -> None:
    """Startup, readiness and liveness probes all ask /health, so DNS lists only servers
    that answer."""
    deployment = _load(yaml, KUBERNETES / "vllm-deployment.yaml")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"
        assert container[probe]["httpGet"]["port"] == "http"
    assert "nvidia.com/gpu" in container["resources"]["limits"]


def _settings(yaml: ModuleType) -> dict[str, str]:
    kustomization = _load(yaml, KUBERNETES / "kustomization.yaml")
    (generator,) = kustomization["configMapGenerator"]
    return dict(literal.split("=", 1) for literal in generator["literals"])


def test_annotator_job_finds_the_servers_through_the_service(yaml: ModuleType) -> None:
    """The Job's --servers-dns names the headless Service and its port."""
    service = _load(yaml, KUBERNETES / "vllm-service.yaml")
    job = _load(yaml, KUBERNETES / "annotator-job.yaml")
    (port,) = service["spec"]["ports"]
    assert _settings(yaml)["SERVERS_DNS"] == f"{service['metadata']['name']}:{port['port']}"
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert '--servers-dns "$SERVERS_DNS"' in " ".join(container["args"])


@pytest.mark.parametrize("manifest", ["vllm-deployment.yaml", "annotator-job.yaml"])
def test_every_setting_a_container_uses_is_defined(yaml: ModuleType, manifest: str) -> None:
    """Each $VARIABLE in a container's command is a setting of kustomization.yaml."""
    settings = _settings(yaml)
    spec = _load(yaml, KUBERNETES / manifest)["spec"]["template"]["spec"]
    containers = spec.get("initContainers", []) + spec["containers"]
    for container in containers:
        script = " ".join(container.get("command", []) + container.get("args", []))
        used = {shell or python for shell, python in _VARIABLE.findall(script)}
        assert used, f"{container['name']} uses no setting"
        assert used <= settings.keys(), f"undefined: {used - settings.keys()}"


def test_compose_pins_each_server_to_its_own_gpu(yaml: ModuleType) -> None:
    """Each vLLM service of compose.yaml has its own GPU, and the annotator uses them all."""
    services = _load(yaml, COMPOSE)["services"]
    servers = sorted(name for name in services if name.startswith("vllm-"))
    assert len(servers) >= 2
    devices = [
        tuple(services[name]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"])
        for name in servers
    ]
    assert len(set(devices)) == len(devices)
    command = " ".join(services["annotator"]["command"])
    for name in servers:
        assert f"http://{name}:8000/v1" in command


def test_the_sharded_overlay_runs_one_shard_per_index(yaml: ModuleType) -> None:
    """deploy/kubernetes-sharded: an Indexed Job whose completions, parallelism and
    shard count agree, each pod with --shard auto (its JOB_COMPLETION_INDEX)."""
    overlay = _load(yaml, REPO / "deploy" / "kubernetes-sharded" / "kustomization.yaml")
    assert overlay["resources"] == ["../kubernetes"]
    patch, volume = overlay["patches"]
    assert patch["target"] == {"kind": "Job", "name": "llm-annotator"}
    assert volume["target"]["kind"] == "PersistentVolumeClaim"  # pods on many nodes
    assert yaml.safe_load(volume["patch"])[0]["value"] == ["ReadWriteMany"]
    ops = {op["path"]: op["value"] for op in yaml.safe_load(patch["patch"])}
    assert ops["/spec/completionMode"] == "Indexed"
    (count,) = ops["/spec/template/spec/containers/0/env"]
    assert count["name"] == "LLM_ANNOTATOR_SHARD_COUNT"
    assert ops["/spec/completions"] == ops["/spec/parallelism"] == int(count["value"])
    args = ops["/spec/template/spec/containers/0/args/0"]
    job = _load(yaml, KUBERNETES / "annotator-job.yaml")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert args.replace(" --shard auto", "") == container["args"][0]  # the same run


def test_the_elastic_overlay_runs_the_same_claiming_worker_in_every_pod(yaml: ModuleType) -> None:
    """deploy/kubernetes-elastic: a Job with parallelism and no index, every pod with
    --shard claim, over a ReadWriteMany volume."""
    overlay = _load(yaml, REPO / "deploy" / "kubernetes-elastic" / "kustomization.yaml")
    assert overlay["resources"] == ["../kubernetes"]
    patch, volume = overlay["patches"]
    assert yaml.safe_load(volume["patch"])[0]["value"] == ["ReadWriteMany"]
    ops = {op["path"]: op["value"] for op in yaml.safe_load(patch["patch"])}
    assert "/spec/completionMode" not in ops and "/spec/completions" not in ops
    assert ops["/spec/parallelism"] > 1
    args = ops["/spec/template/spec/containers/0/args/0"]
    job = _load(yaml, KUBERNETES / "annotator-job.yaml")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert args.replace(" --shard claim", "") == container["args"][0]  # the same run


def test_the_pipeline_overlay_runs_the_same_pipeline_worker_in_every_pod(
    yaml: ModuleType,
) -> None:
    """deploy/kubernetes-pipeline: a Job with parallelism and no index, every pod an
    elastic worker of the same pipeline file, each setting it uses defined."""
    overlay = _load(yaml, REPO / "deploy" / "kubernetes-pipeline" / "kustomization.yaml")
    assert overlay["resources"] == ["../kubernetes"]
    (generator,) = overlay["configMapGenerator"]
    assert generator["behavior"] == "merge"
    settings = _settings(yaml) | dict(item.split("=", 1) for item in generator["literals"])
    patch, volume = overlay["patches"]
    assert yaml.safe_load(volume["patch"])[0]["value"] == ["ReadWriteMany"]
    ops = {op["path"]: op["value"] for op in yaml.safe_load(patch["patch"])}
    assert "/spec/completionMode" not in ops and ops["/spec/parallelism"] > 1
    args = ops["/spec/template/spec/containers/0/args/0"]
    assert args.startswith('exec llm-annotator pipeline run "$PIPELINE_FILE"')
    assert "--shard claim" in args
    used = {shell or python for shell, python in _VARIABLE.findall(args)}
    assert used <= settings.keys(), f"undefined: {used - settings.keys()}"
    from llm_annotator.cli.main import build_parser

    argv = args.removeprefix("exec llm-annotator ").replace('"', "").split()
    parsed = build_parser(argv).parse_args(argv)  # the flags are the command's own
    assert parsed.shard == "claim"
