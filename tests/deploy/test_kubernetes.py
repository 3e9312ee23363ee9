"""deploy/kubernetes/*.yaml, validated against the Kubernetes API's schemas.

Every document is checked by ``kubernetes-validate`` in strict mode (an
unknown field is an error) against the schemas of ``KUBERNETES_VERSION``;
then the references between them: selectors that select, the ConfigMap keys
and Secret keys the pods read, the configs the containers load (decoded with
the pods' environment), the probes on the edge's ``/readyz`` and
``/healthz``, and grace periods that outlast the drains
(docs/deploying.md, "Kubernetes").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from iop.cli._main import build_parser
from iop.config import EdgeConfig, NodeConfig
from iop.sim import SimFile
from tests.deploy._deploy import DEPLOY, ENV_REF, PREFIX, load
from tests.deploy.test_container import healthcheck_argv

MANIFESTS = DEPLOY / "kubernetes"
# The oldest release the manifests use a field of: the preStop sleep action
# (beta and on by default since 1.30).
KUBERNETES_VERSION = "1.30"


def documents() -> list[tuple[Path, dict[str, Any]]]:
    out = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        out.extend((path, doc) for doc in yaml.safe_load_all(path.read_text()) if doc)
    return out


def find(kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for _, d in documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def pod(kind: str, name: str) -> dict[str, Any]:
    spec: dict[str, Any] = find(kind, name)["spec"]["template"]["spec"]
    return spec


def container(spec: dict[str, Any], name: str) -> dict[str, Any]:
    (c,) = [c for c in spec["containers"] if c["name"] == name]
    return c


@pytest.mark.parametrize("version", [KUBERNETES_VERSION, "1.37"])
def test_every_manifest_validates_against_the_schemas(version: str) -> None:
    docs = documents()
    assert {d["kind"] for _, d in docs} >= {
        "StatefulSet",
        "Deployment",
        "Service",
        "ConfigMap",
        "Secret",
        "PodDisruptionBudget",
    }
    for path, doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{path.name}: {doc['kind']} {doc['metadata']['name']}: {exc.message}")


def test_selectors_select_the_pods() -> None:
    workloads = {
        d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]
        for _, d in documents()
        if d["kind"] in ("Deployment", "StatefulSet")
    }
    for _, doc in documents():
        if doc["kind"] == "Service":
            selector = doc["spec"]["selector"]
        elif doc["kind"] in ("PodDisruptionBudget", "Deployment", "StatefulSet"):
            selector = doc["spec"]["selector"]["matchLabels"]
        else:
            continue
        chosen = [n for n, labels in workloads.items() if selector.items() <= labels.items()]
        assert len(chosen) == 1, (doc["kind"], doc["metadata"]["name"], chosen)
    assert find("StatefulSet", "iop-edge")["spec"]["serviceName"] == "iop-edge-link"
    assert find("Service", "iop-edge-link")["spec"]["clusterIP"] == "None"


def _env(c: dict[str, Any]) -> dict[str, str]:
    """A container's environment, Secret values and field refs filled in."""
    secret = find("Secret", "iop-secrets")["stringData"]
    env: dict[str, str] = {}
    for var in c.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "secretKeyRef" in var["valueFrom"]:
            ref = var["valueFrom"]["secretKeyRef"]
            assert ref["name"] == "iop-secrets"
            env[var["name"]] = secret[ref["key"]]  # a key the Secret has
        else:
            assert var["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
            env[var["name"]] = "iop-node-5d8f7-abcde"
    return env


def _config_file(spec: dict[str, Any], c: dict[str, Any], path: str) -> str:
    """The text a container reads at ``path``, through its ConfigMap volume."""
    (mount,) = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    cm = find("ConfigMap", volume["configMap"]["name"])
    rel = path.removeprefix(mount["mountPath"] + "/")
    (item,) = [i for i in volume["configMap"]["items"] if i["path"] == rel]
    text: str = cm["data"][item["key"]]
    return text


@pytest.mark.parametrize(
    ("kind", "name", "cname", "cfg_type"),
    [
        ("StatefulSet", "iop-edge", "edge", EdgeConfig),
        ("Deployment", "iop-node", "node", NodeConfig),
        ("Deployment", "iop-node", "sim", SimFile),
    ],
)
def test_containers_run_iop_with_configs_they_can_load(
    kind: str, name: str, cname: str, cfg_type: type[Any], tmp_path: Path
) -> None:
    spec = pod(kind, name)
    c = container(spec, cname)
    assert c["image"] == "iop:latest"
    assert "command" not in c  # the image's entrypoint, /opt/iop/bin/iop
    args = build_parser().parse_args(c["args"])
    assert args.command == cname
    text = _config_file(spec, c, args.config)
    env = _env(c)
    assert set(ENV_REF.findall(text)) <= set(env)
    copy = tmp_path / "config.toml"
    copy.write_text(text)
    load(copy, cfg_type, env)


def test_the_configmap_holds_deploy_config_byte_for_byte() -> None:
    data = find("ConfigMap", "iop-config")["data"]
    for key in ("edge.toml", "sim.toml"):
        assert data[key] == (DEPLOY / "config" / key).read_text(), key


def test_the_nodes_dial_every_edge_by_its_stable_name() -> None:
    edges = find("StatefulSet", "iop-edge")
    port = container(edges["spec"]["template"]["spec"], "edge")["ports"][0]["containerPort"]
    node_toml = find("ConfigMap", "iop-config")["data"]["node.toml"]
    expected = [
        f"ws://iop-edge-{i}.{edges['spec']['serviceName']}:{port}/v1/link"
        for i in range(edges["spec"]["replicas"])
    ]
    urls = [line.split('"')[1] for line in node_toml.splitlines() if line.startswith("url = ")]
    assert urls == expected
    assert find("Service", "iop-edge-link")["spec"]["publishNotReadyAddresses"] is True


def test_the_edge_is_probed_on_readyz_and_healthz_and_drains() -> None:
    spec = pod("StatefulSet", "iop-edge")
    edge = container(spec, "edge")
    assert edge["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert edge["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert edge["readinessProbe"]["httpGet"]["port"] == edge["ports"][0]["name"]
    pre_stop = edge["lifecycle"]["preStop"]["sleep"]["seconds"]
    cfg = load(DEPLOY / "config" / "edge.toml", EdgeConfig)
    assert edge["ports"][0]["containerPort"] == cfg.server.port
    assert spec["terminationGracePeriodSeconds"] > pre_stop + cfg.server.drain_timeout_s
    node_cfg = load(DEPLOY / "config" / "node.toml", NodeConfig)
    nodes = pod("Deployment", "iop-node")
    assert nodes["terminationGracePeriodSeconds"] > node_cfg.node.drain_timeout_s


def test_the_sim_probe_is_the_images_health_check() -> None:
    sim = container(pod("Deployment", "iop-node"), "sim")
    argv = sim["readinessProbe"]["exec"]["command"]
    assert argv[0] == f"{PREFIX}/bin/python"
    assert argv == healthcheck_argv()
    port = sim["args"][sim["args"].index("--port") + 1]
    assert _env(sim)["IOP_HEALTH_URL"] == f"http://127.0.0.1:{port}/health"


def test_every_pod_runs_unprivileged() -> None:
    for _, doc in documents():
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        spec = doc["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        for c in spec["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]


def test_disruption_budgets_cover_the_edges_and_the_nodes() -> None:
    assert find("PodDisruptionBudget", "iop-edge")["spec"]["minAvailable"] == 1
    assert find("PodDisruptionBudget", "iop-node")["spec"]["maxUnavailable"] == 1
