"""deploy/kubernetes: each kustomization renders with `kubectl kustomize`,
every built-in object passes the Kubernetes schema (tests/deploy/k8s_schema.py),
and the parts agree with each other and with loragw itself: Services select
pods and name their ports, containers' args parse with loragw's own CLI, the
gateway names every worker KEDA may start, and the Dockerfile exposes the
ports and pins the torch of the Makefile.

KEDA's ScaledObject and KubeRay's RayCluster are custom resources: no schema
of theirs is available offline, so only their references are checked here
(deploy/README.md says what was checked by hand)."""

from __future__ import annotations

import argparse
import copy
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy.k8s_schema import ValidationError, validate

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
KUSTOMIZATIONS = ("base", "keda", "ray")
CUSTOM_KINDS = {("keda.sh/v1alpha1", "ScaledObject"), ("ray.io/v1", "RayCluster")}
KUBECTL = shutil.which("kubectl")
pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed (it renders the kustomizations)")


def render(name: str) -> list[dict]:
    result = subprocess.run([KUBECTL, "kustomize", str(KUBERNETES / name)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: render(name) for name in KUSTOMIZATIONS}


def find(docs: list[dict], kind: str, name: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def pod_templates(docs: list[dict]):
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet"):
            yield doc, doc["spec"]["template"]


def containers(docs: list[dict]):
    for _, template in pod_templates(docs):
        yield from template["spec"]["containers"]


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_every_object_passes_its_schema(rendered, name):
    docs = rendered[name]
    assert docs
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in CUSTOM_KINDS:
            continue
        validate(doc)  # raises on an unknown field, a wrong type, a missing required field


MUTATIONS = {
    "an unknown field": lambda d: d["spec"]["template"]["spec"]["containers"][0].update(livenessprobe={}),
    "a field in snake case": lambda d: d["spec"]["template"]["spec"]["containers"][0].update(liveness_probe={}),
    "replicas as a string": lambda d: d["spec"].update(replicas="1"),
    "a port as a float": lambda d: d["spec"]["template"]["spec"]["containers"][0]["ports"][0].update(
        containerPort=8000.5),
    "no container name": lambda d: d["spec"]["template"]["spec"]["containers"][0].pop("name"),
    "no selector": lambda d: d["spec"].pop("selector"),
}


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_the_schema_check_catches_a_broken_manifest(rendered, mutation):
    doc = copy.deepcopy(find(rendered["base"], "Deployment", "loragw-gateway"))
    MUTATIONS[mutation](doc)
    with pytest.raises(ValidationError):
        validate(doc)


def test_custom_resources_are_the_only_objects_without_a_schema(rendered):
    kinds = {(d["apiVersion"], d["kind"]) for docs in rendered.values() for d in docs}
    assert CUSTOM_KINDS <= kinds
    with pytest.raises(KeyError):
        validate(find(rendered["keda"], "ScaledObject", "loragw-worker"))


def ray_pod_templates(docs: list[dict]) -> list[dict]:
    spec = find(docs, "RayCluster", "loragw-ray")["spec"]
    return [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]


def test_the_ray_clusters_pods_pass_the_pod_schema(rendered):
    """KubeRay embeds Kubernetes' PodTemplateSpec: its pods are checked as one."""
    for template in ray_pod_templates(rendered["ray"]):
        validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template})


def test_the_ray_heads_gateway_parses_with_loragw_and_finds_its_workers(rendered):
    head = ray_pod_templates(rendered["ray"])[0]["spec"]["containers"][0]
    script = " ".join(head["args"])
    command = script[script.index("exec loragw ") + len("exec loragw "):].split()
    config = serve_config(command, pod_env(head))
    assert config.worker_pool.ray_address == "auto" and config.db_url == SECRET_VALUES["db-url"]
    assert config.port == container_port(head, "http") and config.metrics_port == container_port(head, "metrics")
    service = find(rendered["ray"], "Service", "loragw-ray-gateway")
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= {p["name"] for p in head["ports"]}
    gpu_group = find(rendered["ray"], "RayCluster", "loragw-ray")["spec"]["workerGroupSpecs"][0]
    assert gpu_group["maxReplicas"] >= config.worker_pool.ray_max_workers


def test_services_select_pods_and_name_their_ports(rendered):
    docs = rendered["base"]
    for service in (d for d in docs if d["kind"] == "Service"):
        selector = service["spec"]["selector"].items()
        matched = [t for _, t in pod_templates(docs) if selector <= t["metadata"]["labels"].items()]
        assert len(matched) == 1, service["metadata"]["name"]
        ports = {p["name"] for c in matched[0]["spec"]["containers"] for p in c["ports"]}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports, (service["metadata"]["name"], port)


def test_probes_volumes_and_secrets_refer_to_what_exists(rendered):
    docs = rendered["base"]
    claims = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    secret_keys = documented_secret_keys()
    for _, template in pod_templates(docs):
        volumes = {v["name"] for v in template["spec"]["volumes"]}
        for volume in template["spec"]["volumes"]:
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims
        for container in template["spec"].get("initContainers", []) + template["spec"]["containers"]:
            assert {m["name"] for m in container.get("volumeMounts", [])} <= volumes, container["name"]
        for container in template["spec"]["containers"]:
            ports = {p["name"] for p in container["ports"]}
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                action = container.get(probe, {})
                for handler in ("httpGet", "tcpSocket"):
                    if handler in action:
                        assert action[handler]["port"] in ports, (container["name"], probe)
            for env in container.get("env", []):
                ref = env["valueFrom"]["secretKeyRef"]
                assert ref["name"] == "loragw" and ref["key"] in secret_keys, env


def documented_secret_keys() -> set[str]:
    """The keys of the `kubectl create secret generic loragw` in docs/deploy.md."""
    text = (ROOT / "docs" / "deploy.md").read_text()
    command = re.search(r"kubectl -n loragw create secret generic loragw((?:.*\\\n)*.*)", text)
    assert command, "docs/deploy.md does not create the loragw Secret"
    return set(re.findall(r"--from-(?:literal|file)=([a-z-]+)=", command[1]))


# A value for each of the Secret's keys, to stand in for it in the pods' env.
SECRET_VALUES = {
    "db-url": "postgresql+asyncpg://loragw:pw@postgres:5432/loragw",
    "admin-token": "a" * 32,
    "worker-secret": "s" * 32,
    "redis-url": "redis://:pw@redis:6379/0",
}
SECRET_ENV = {"LORAGW_WORKER_SECRET": SECRET_VALUES["worker-secret"]}


def pod_env(container: dict) -> dict[str, str]:
    """The variables the container's env gives loragw, with SECRET_VALUES for the Secret."""
    return {e["name"]: SECRET_VALUES[e["valueFrom"]["secretKeyRef"]["key"]] for e in container.get("env", [])}


def serve_config(args: list[str], environ: dict[str, str] = SECRET_ENV):
    """`loragw ARGS...` (a serve command) as `loragw serve` configures itself."""
    from gateway.cli import _add_serve_parser, _serve_config

    parser = argparse.ArgumentParser(prog="loragw")
    _add_serve_parser(parser.add_subparsers(dest="command"), environ)
    return _serve_config(parser.parse_args(args), environ)


def test_container_args_parse_with_loragw_itself(rendered):
    from gateway.cli_worker import parse_worker_args

    docs = rendered["base"]
    gateway = find(docs, "Deployment", "loragw-gateway")["spec"]["template"]["spec"]["containers"][0]
    config = serve_config(gateway["args"], pod_env(gateway))
    assert config.worker_pool.workers == 0 and config.worker_pool.worker_secret == SECRET_VALUES["worker-secret"]
    assert config.port == container_port(gateway, "http") and config.metrics_port == container_port(gateway, "metrics")
    worker = find(docs, "StatefulSet", "loragw-worker")["spec"]["template"]["spec"]["containers"][0]
    assert worker["args"][0] == "worker"
    worker_config = parse_worker_args(worker["args"][1:], SECRET_ENV)
    assert worker_config.listen.endswith(f":{container_port(worker, 'worker')}")
    assert worker_config.metrics_port == container_port(worker, "metrics")


def test_gateway_replicas_share_limits_and_ledger_and_roll_without_a_gap(rendered):
    """Replicas are only safe with the limits in one Redis and the ledger in
    one PostgreSQL; a rolling update that may stop a replica before its
    successor is ready leaves nothing to serve."""
    deployment = find(rendered["base"], "Deployment", "loragw-gateway")
    gateway = deployment["spec"]["template"]["spec"]["containers"][0]
    config = serve_config(gateway["args"], pod_env(gateway))
    assert deployment["spec"]["replicas"] > 1
    assert config.redis.url == SECRET_VALUES["redis-url"]
    assert config.db_url == SECRET_VALUES["db-url"]
    strategy = deployment["spec"]["strategy"]
    assert strategy["type"] == "RollingUpdate" and strategy["rollingUpdate"]["maxUnavailable"] == 0


def container_port(container: dict, name: str) -> int:
    (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == name]
    return port


def test_the_gateway_names_every_worker_keda_may_start(rendered):
    docs = rendered["keda"]
    scaled = find(docs, "ScaledObject", "loragw-worker")
    target = scaled["spec"]["scaleTargetRef"]
    workers = find(docs, target["kind"], target["name"])
    service = find(docs, "Service", workers["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None"  # headless: one DNS name per pod
    port = container_port(workers["spec"]["template"]["spec"]["containers"][0], "worker")
    expected = {f"tcp://{target['name']}-{i}.{service['metadata']['name']}:{port}"
                for i in range(scaled["spec"]["maxReplicaCount"])}
    gateway = find(docs, "Deployment", "loragw-gateway")["spec"]["template"]["spec"]["containers"][0]
    assert set(serve_config(gateway["args"]).worker_pool.worker_endpoints) == expected


def test_keda_scales_on_a_series_loragw_exports(rendered):
    (trigger,) = find(rendered["keda"], "ScaledObject", "loragw-worker")["spec"]["triggers"]
    names = set(re.findall(r"loragw:([a-z_]+)", trigger["metadata"]["query"]))
    assert names == {"num_requests_waiting"}
    exported = (ROOT / "engine" / "snapshot_metrics.py").read_text()
    assert all(f'gauge("{name}"' in exported for name in names)


def test_the_dockerfile_matches_the_makefile_and_the_manifests(rendered):
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    pinned = re.search(r"\$\(PIP\) torch==(\S+)", (ROOT / "Makefile").read_text())[1]
    assert re.search(rf"^ARG TORCH_VERSION={re.escape(pinned)}$", dockerfile, re.M)
    assert re.search(r'^ENTRYPOINT \["loragw"\]$', dockerfile, re.M)
    user = re.findall(r"^USER (\S+)$", dockerfile, re.M)
    assert user and user[-1] not in ("root", "0")
    exposed = {int(p) for line in re.findall(r"^EXPOSE (.+)$", dockerfile, re.M) for p in line.split()}
    used = {p["containerPort"] for c in containers(rendered["base"]) for p in c["ports"]}
    assert used <= exposed
    uids = {t["spec"]["securityContext"]["runAsUser"] for _, t in pod_templates(rendered["base"])}
    assert uids == {int(re.search(r"--uid (\d+)", dockerfile)[1])}
