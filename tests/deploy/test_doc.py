"""docs/deploying.md shows only files the suite checks, as they are.

Every ``deploy/`` path the page names is a file (or a folder of files) that
a module of tests/deploy checks, every file under ``deploy/`` is one of
those, and a code block that opens with ``# deploy/<file>`` is an excerpt
of that file: its lines appear there, in order.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.deploy._deploy import DEPLOY, ROOT

PAGE = ROOT / "docs" / "deploying.md"
HERE = Path(__file__).parent

# Every file of deploy/, the test module that checks it, and what in that
# module checks it (the file's name, or the test that does).
CHECKED = {
    "deploy/config/edge.toml": ("test_container.py", "edge.toml"),
    "deploy/config/node.toml": ("test_container.py", "node.toml"),
    "deploy/config/sim.toml": ("test_container.py", "sim.toml"),
    "deploy/iop.env.example": ("test_systemd.py", "iop.env.example"),
    "deploy/container/Containerfile": ("test_container.py", "Containerfile"),
    # The folder the recipe copies wheels from (COPY deploy/container/wheels/).
    "deploy/container/wheels/README.md": (
        "test_container.py",
        "test_every_file_the_recipe_copies_exists",
    ),
    "deploy/container/wheels/.gitignore": (
        "test_container.py",
        "test_every_file_the_recipe_copies_exists",
    ),
    "deploy/compose.yaml": ("test_compose.py", "compose.yaml"),
    "deploy/systemd/iop-edge.service": ("test_systemd.py", "iop-edge.service"),
    "deploy/systemd/iop-node.service": ("test_systemd.py", "iop-node.service"),
    # Every manifest: MANIFESTS.glob("*.yaml"), each named where it is used.
    "deploy/kubernetes/config.yaml": ("test_kubernetes.py", '"ConfigMap", "iop-config"'),
    "deploy/kubernetes/secret.yaml": ("test_kubernetes.py", '"Secret", "iop-secrets"'),
    "deploy/kubernetes/edge.yaml": ("test_kubernetes.py", '"StatefulSet", "iop-edge"'),
    "deploy/kubernetes/nodes.yaml": ("test_kubernetes.py", '"Deployment", "iop-node"'),
    "deploy/kubernetes/valkey.yaml": ("test_kubernetes.py", "test_every_manifest_validates"),
    "deploy/proxy/Caddyfile": ("test_proxy.py", "Caddyfile"),
}

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```$", re.M | re.S)
DEPLOY_PATH = re.compile(r"deploy/[\w./*-]*[\w*]")


def _tracked() -> set[str]:
    out = set()
    for path in DEPLOY.rglob("*"):
        rel = path.relative_to(ROOT).as_posix()
        # Wheels put in for a build are not the repository's (.gitignore there).
        if path.is_file() and not rel.endswith(".whl"):
            out.add(rel)
    return out


def test_every_file_of_deploy_is_checked() -> None:
    assert _tracked() == set(CHECKED)
    for rel, (module, needle) in CHECKED.items():
        assert needle in (HERE / module).read_text(), (rel, module, needle)


def test_every_deploy_path_on_the_page_is_a_checked_file() -> None:
    text = PAGE.read_text()
    named = set(DEPLOY_PATH.findall(text))
    assert named
    for path in sorted(named):
        if "*" in path:
            assert any(Path(c).match(path) for c in CHECKED), path
        elif path.endswith("/") or (ROOT / path).is_dir():
            assert any(c.startswith(path.rstrip("/") + "/") for c in CHECKED), path
        else:
            # deploy/iop.env: made from deploy/iop.env.example, never committed.
            assert path in CHECKED or f"{path}.example" in CHECKED, path


def test_every_excerpt_is_in_its_file_in_order() -> None:
    excerpts = 0
    for block in FENCE.findall(PAGE.read_text()):
        first, _, body = block.partition("\n")
        m = re.fullmatch(r"# (deploy/\S+)", first)
        if m is None:
            continue
        excerpts += 1
        assert m.group(1) in CHECKED, m.group(1)
        lines = iter((ROOT / m.group(1)).read_text().splitlines())
        for line in body.splitlines():
            if line.strip():
                assert any(line == have for have in lines), (m.group(1), line)
    assert excerpts >= 6
