"""deploy/container/Containerfile: one image for ``iop edge``, ``iop node`` and ``iop sim``.

An image build takes minutes and needs buildah or podman, so the suite checks
the recipe: its structure (a non-root user, iop as the command, the health
check on the edge's ``/readyz``), that every file it copies exists, and that
every path and command it uses exists in an install of this tree's wheel; then
it runs the image's commands with the image's configs from that install and
its health check against them (docs/deploying.md, "The container image").
"""

from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from iop.config import EdgeConfig, NodeConfig, load_config
from iop.sim import SimFile
from iop.testing import EDGE_READY, NODE_READY, SIM_READY, STOP_GRACE_S, Proc, poll
from tests.deploy._deploy import DEPLOY, PREFIX, ROOT, InstalledWheel

CONTAINERFILE = DEPLOY / "container" / "Containerfile"

SECRETS = {
    "IOP_API_KEY": "deploy-test-client-key",
    "IOP_ADMIN_KEY": "deploy-test-admin-key",
    "IOP_NODE_TOKEN": "deploy-test-node-token",
    "IOP_VALKEY_URL": "",
}


def instructions(text: str) -> list[tuple[str, str]]:
    """A Containerfile's instructions, continuation lines joined, comments out."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        whole = pending + line
        pending = ""
        keyword, _, rest = whole.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    assert not pending, "the Containerfile ends inside a continued line"
    return out


def recipe() -> list[tuple[str, str]]:
    return instructions(CONTAINERFILE.read_text())


def one(keyword: str) -> str:
    found = [rest for kw, rest in recipe() if kw == keyword]
    assert len(found) == 1, f"{keyword}: {found}"
    return found[0]


def args_and_env() -> dict[str, str]:
    """ARG defaults and ENV values (``KEY=VALUE`` pairs)."""
    out: dict[str, str] = {}
    for kw, rest in recipe():
        if kw in ("ARG", "ENV"):
            for pair in shlex.split(rest):
                key, _, value = pair.partition("=")
                out[key] = value
    return out


def healthcheck_argv() -> list[str]:
    rest = one("HEALTHCHECK")
    _, _, exec_form = rest.partition("CMD ")
    argv: list[str] = json.loads(exec_form)
    return argv


def image_path(path: str) -> Path:
    """The repository file a path under /etc/iop of the image comes from (COPY)."""
    copies = [shlex.split(rest) for kw, rest in recipe() if kw == "COPY"]
    for src, dest in copies:
        if dest.endswith("/") and path.startswith(dest):
            return ROOT / src / path.removeprefix(dest)
    raise AssertionError(f"no COPY puts {path} into the image")


def test_the_image_runs_iop_as_an_unprivileged_user() -> None:
    user = one("USER")
    uid, _, gid = user.partition(":")
    assert uid.isdigit(), user
    assert gid.isdigit(), user
    assert int(uid) != 0
    assert int(gid) != 0
    runs = " ".join(rest for kw, rest in recipe() if kw == "RUN")
    assert f"useradd --system --uid {uid} " in runs
    # Every RUN comes before USER: nothing runs as root after it.
    keywords = [kw for kw, _ in recipe()]
    assert keywords.index("USER") > max(i for i, kw in enumerate(keywords) if kw == "RUN")


def test_the_command_is_iop_and_defaults_to_the_edge(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in SECRETS.items():
        monkeypatch.setenv(key, value)
    assert json.loads(one("ENTRYPOINT")) == [f"{PREFIX}/bin/iop"]
    cmd = json.loads(one("CMD"))
    assert cmd[:2] == ["edge", "--config"]
    load_config(image_path(cmd[2]), EdgeConfig)  # a file of the image, and an edge config
    assert one("STOPSIGNAL") == "SIGTERM"  # the signal that drains (iop/cli/_signals.py)


def test_the_health_check_is_the_edges_readyz() -> None:
    url = urlsplit(args_and_env()["IOP_HEALTH_URL"])
    assert url.path == "/readyz"
    port = tomllib.loads((DEPLOY / "config" / "edge.toml").read_text())["server"]["port"]
    assert url.port == port
    assert one("EXPOSE") == str(port)
    argv = healthcheck_argv()
    assert argv[0] == f"{PREFIX}/bin/python"
    assert "IOP_HEALTH_URL" in argv[-1]


def test_every_file_the_recipe_copies_exists() -> None:
    copies = [shlex.split(rest) for kw, rest in recipe() if kw == "COPY"]
    assert copies
    for src, _dest in copies:
        assert (ROOT / src).exists(), src
    base = re.search(r"^ARG BASE=(\S+)", CONTAINERFILE.read_text(), re.M)
    assert base is not None
    assert "debian" in base.group(1)
    assert one("FROM") == "${BASE}"


def test_the_image_configs_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in {
        **SECRETS,
        "IOP_NODE_ID": "n1",
        "IOP_EDGE_URL": "ws://edge:8080/v1/link",
        "IOP_BACKEND_URL": "http://sim:8000",
    }.items():
        monkeypatch.setenv(key, value)
    load_config(image_path("/etc/iop/edge.toml"), EdgeConfig)
    load_config(image_path("/etc/iop/node.toml"), NodeConfig)
    load_config(image_path("/etc/iop/sim.toml"), SimFile)


def _spec_name() -> tuple[str, list[str]]:
    spec = args_and_env()["IOP_SPEC"]
    m = re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[([a-z,]+)\])?", spec)
    assert m is not None, spec
    return m.group(1), (m.group(2) or "").split(",")


_PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_the_recipe_installs_this_distribution() -> None:
    name, extras = _spec_name()
    assert name == _PROJECT["name"]
    assert set(extras) <= set(_PROJECT["optional-dependencies"])


def test_the_recipe_asks_for_extras_that_exist() -> None:
    name, extras = _spec_name()
    assert name == "iop-platform"
    # the edge's [cluster] needs the Valkey client; a node reading vLLM's KV
    # cache events over ZeroMQ (kv_events_endpoint) needs pyzmq
    assert extras == ["cluster", "kvevents"]
    assert set(extras) <= set(_PROJECT["optional-dependencies"])


def test_every_path_and_command_exists_in_the_wheels_install(
    installed_wheel: InstalledWheel,
) -> None:
    text = CONTAINERFILE.read_text()
    paths = set(re.findall(re.escape(PREFIX) + r"/[\w/.-]+", text))
    assert f"{PREFIX}/bin/iop" in paths
    for path in sorted(paths - {f"{PREFIX}/bin/pip"}):  # pip: the image's venv, not the wheel
        assert installed_wheel.path(path).exists(), path
    where = subprocess.run(
        [installed_wheel.path(f"{PREFIX}/bin/python"), "-c", "import iop; print(iop.__file__)"],
        env=installed_wheel.env(),
        cwd=installed_wheel.venv,  # not this tree: `python -c` imports from the cwd
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert where.startswith(str(installed_wheel.venv)), where
    for command in ("edge", "node", "sim"):
        done = subprocess.run(
            [installed_wheel.path(f"{PREFIX}/bin/iop"), command, "--help"],
            env=installed_wheel.env(),
            cwd=installed_wheel.venv,  # not this tree: `python -c` imports from the cwd
            capture_output=True,
            text=True,
            check=False,
        )
        assert done.returncode == 0, done.stderr


def _health(installed_wheel: InstalledWheel, url: str) -> int:
    argv = healthcheck_argv()
    argv[0] = str(installed_wheel.path(argv[0]))
    return subprocess.run(
        argv,
        env={**installed_wheel.env(), "IOP_HEALTH_URL": url},
        cwd=installed_wheel.venv,
        capture_output=True,
        check=False,
        timeout=30,
    ).returncode


@pytest.mark.slow
def test_the_images_commands_run_and_its_health_check_follows_readyz(
    installed_wheel: InstalledWheel, tmp_path: Path
) -> None:
    """The image's edge, sim and node, from the wheel's install with the image's
    configs: the health check fails while no node serves and passes once one
    does; SIGTERM (the image's STOPSIGNAL) drains each and exits 0."""
    iop = str(installed_wheel.path(f"{PREFIX}/bin/iop"))
    env = {**SECRETS, "PYTHONPATH": ""}
    procs: list[Proc] = []

    def start(name: str, args: list[str], **extra: str) -> Proc:
        p = Proc(name, [], tmp_path, argv=[iop, *args], env={**env, **extra})
        procs.append(p)
        return p

    try:
        edge = start(
            "edge",
            [
                *("edge", "--config", str(image_path("/etc/iop/edge.toml"))),
                *("--host", "127.0.0.1", "--port", "0"),
            ],
        )
        api, link = edge.wait_stdout(EDGE_READY).groups()
        assert _health(installed_wheel, api + "/readyz") != 0  # 503: no nodes connected
        sim = start("sim", ["sim", "--config", str(image_path("/etc/iop/sim.toml")), "--port", "0"])
        (backend,) = sim.wait_stdout(SIM_READY).groups()
        node = start(
            "node",
            ["node", "--config", str(image_path("/etc/iop/node.toml"))],
            IOP_NODE_ID="deploy-node",
            IOP_EDGE_URL=link,
            IOP_BACKEND_URL=backend,
        )
        node.wait_stdout(NODE_READY)
        poll(
            lambda: _health(installed_wheel, api + "/readyz") == 0,
            timeout=30,
            what="the image's health check to pass",
        )
        for p in (node, sim, edge):
            p.send(signal.SIGTERM)
            assert p.wait(STOP_GRACE_S) == 0, p.logs()
    finally:
        for p in procs:
            p.kill()
