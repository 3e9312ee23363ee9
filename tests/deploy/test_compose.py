"""deploy/compose.yaml: an edge, two nodes, the simulator and Valkey.

The file goes through ``docker-compose config`` where Debian's
docker-compose is installed (it validates against the Compose file schema
it ships and needs no daemon). Containers cannot run in the suite, so the
file is also parsed (PyYAML) and every reference in it is checked against
what it points at: the image the
Containerfile builds and its commands, the configs those commands read and
the variables they need, the ports the configs listen on, and the services
named in ``depends_on`` and in URLs (docs/deploying.md, "Compose").
"""

from __future__ import annotations

import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from iop.cli._main import build_parser
from iop.config import EdgeConfig, NodeConfig
from tests.deploy._deploy import DEPLOY, ENV_REF, load
from tests.deploy.test_container import image_path

COMPOSE = DEPLOY / "compose.yaml"


def compose() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return doc


def services() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = compose()["services"]
    return out


def iop_services() -> dict[str, dict[str, Any]]:
    return {k: v for k, v in services().items() if v["image"] == "localhost/iop:latest"}


def env_file_values(service: dict[str, Any]) -> dict[str, str]:
    """The variables of the service's env_file, read from its committed example."""
    values: dict[str, str] = {}
    for name in service.get("env_file", []):
        path = COMPOSE.parent / name
        example = path.with_name(path.name + ".example")
        assert path.exists() or example.exists(), name
        for line in (path if path.exists() else example).read_text().splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.partition("=")
                values[key] = value
    return values


def test_the_stack_is_an_edge_two_nodes_a_sim_and_valkey() -> None:
    commands = {name: s["command"][0] for name, s in iop_services().items()}
    assert sorted(commands.values()) == ["edge", "node", "node", "sim"]
    assert "valkey" in services()
    assert services()["valkey"]["image"].startswith("docker.io/valkey/valkey:")


def test_every_iop_command_parses_and_reads_a_file_of_the_image() -> None:
    parser = build_parser()
    for name, service in iop_services().items():
        args = parser.parse_args(service["command"])
        assert args.command == service["command"][0], name
        assert image_path(args.config).is_file(), (name, args.config)


@pytest.mark.parametrize("name", ["edge", "node-a", "node-b", "sim"])
def test_every_variable_a_config_needs_is_set(name: str) -> None:
    service = iop_services()[name]
    env = {**env_file_values(service), **service.get("environment", {})}
    config = image_path(build_parser().parse_args(service["command"]).config)
    needed = set(ENV_REF.findall(config.read_text()))
    assert needed <= set(env), needed - set(env)
    if service["command"][0] in ("edge", "node"):
        cfg_type = EdgeConfig if service["command"][0] == "edge" else NodeConfig
        load(config, cfg_type, env)


def test_urls_name_services_and_ports_that_listen() -> None:
    edge_port = tomllib.loads((DEPLOY / "config" / "edge.toml").read_text())["server"]["port"]
    edge = services()["edge"]
    assert edge["ports"] == [f"{edge_port}:{edge_port}"]
    sim_command = services()["sim"]["command"]
    sim_port = int(sim_command[sim_command.index("--port") + 1])
    assert sim_command[sim_command.index("--host") + 1] == "0.0.0.0"  # reachable from the nodes
    listening = {"edge": edge_port, "sim": sim_port, "valkey": 6379}
    for name, service in services().items():
        for key, value in service.get("environment", {}).items():
            if "://" not in str(value):
                continue
            url = urlsplit(value)
            host = url.hostname
            if host == "127.0.0.1":  # the container itself: its health check
                assert url.port == listening[name], (name, key)
                continue
            assert host in services(), (name, key, value)
            assert url.port == listening[host], (name, key, value)


def test_depends_on_names_services_and_health_checks_are_real() -> None:
    for name, service in services().items():
        deps = service.get("depends_on", [])
        for dep in deps:
            assert dep in services(), (name, dep)
            if isinstance(deps, dict) and deps[dep].get("condition") == "service_healthy":
                assert "test" in services()[dep]["healthcheck"], (name, dep)
    # A node serves no HTTP: the image's check on /readyz is off there.
    for name in ("node-a", "node-b"):
        assert services()[name]["healthcheck"] == {"disable": True}
    assert services()["sim"]["environment"]["IOP_HEALTH_URL"].endswith("/health")


def test_the_containers_drain_before_they_are_killed() -> None:
    grace = int(services()["edge"]["stop_grace_period"].removesuffix("s"))
    edge = load(DEPLOY / "config" / "edge.toml", EdgeConfig)
    node = load(DEPLOY / "config" / "node.toml", NodeConfig)
    for service in iop_services().values():
        assert service["stop_signal"] == "SIGTERM"
        assert service["stop_grace_period"] == f"{grace}s"
        assert "no-new-privileges:true" in service["security_opt"]
    assert grace > edge.server.drain_timeout_s
    assert grace > node.node.drain_timeout_s


def test_the_node_ids_differ() -> None:
    ids = [
        s["environment"]["IOP_NODE_ID"]
        for s in iop_services().values()
        if "IOP_NODE_ID" in s.get("environment", {})
    ]
    assert len(ids) == 2
    assert len(set(ids)) == 2


@pytest.mark.skipif(
    shutil.which("docker-compose") is None,
    reason="docker-compose is not installed (Debian: apt-get install docker-compose)",
)
def test_docker_compose_accepts_the_file(tmp_path: Path) -> None:
    shutil.copy(COMPOSE, tmp_path / "compose.yaml")
    # The env file an operator makes from the example (docs/deploying.md).
    shutil.copy(DEPLOY / "iop.env.example", tmp_path / "iop.env")
    done = subprocess.run(
        ["docker-compose", "-f", "compose.yaml", "config", "--quiet"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
