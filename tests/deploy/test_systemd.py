"""deploy/systemd/iop-edge.service and iop-node.service, verified by systemd itself.

``systemd-analyze verify`` loads each unit as systemd would and checks that
its commands are executables; ``systemd-analyze security --offline`` scores
its sandbox. Both read the unit with ``/opt/iop`` moved to an install of this
tree's wheel (tests/deploy/conftest.py), so the command it starts is the one
pip installs (docs/deploying.md, "systemd").
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from iop.cli._main import build_parser
from iop.config import EdgeConfig, NodeConfig
from tests.deploy._deploy import DEPLOY, ENV_REF, PREFIX, InstalledWheel, load

UNITS = {
    "edge": DEPLOY / "systemd" / "iop-edge.service",
    "node": DEPLOY / "systemd" / "iop-node.service",
}
CONFIGS = {"edge": EdgeConfig, "node": NodeConfig}

# systemd-analyze security's exposure score, 0-100 (shown as 0.0-10.0); the
# units score 15 on systemd 252. Above 20 a hardening line went missing.
MAX_EXPOSURE = 20

needs_systemd = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None,
    reason="systemd-analyze is not installed (Debian: apt-get install systemd)",
)


def service(unit: Path) -> dict[str, list[str]]:
    """The [Service] section, every value of a repeated key kept."""
    out: dict[str, list[str]] = {}
    section = ""
    for raw in unit.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            section = line
            continue
        if section == "[Service]":
            key, _, value = line.partition("=")
            out.setdefault(key, []).append(value)
    return out


def relocated(unit: Path, installed_wheel: InstalledWheel, into: Path) -> Path:
    """The unit with ``/opt/iop`` replaced by the wheel's install."""
    copy = into / unit.name
    copy.write_text(unit.read_text().replace(PREFIX, str(installed_wheel.venv)))
    return copy


@needs_systemd
@pytest.mark.parametrize("name", sorted(UNITS))
def test_systemd_verifies_the_unit(
    name: str, installed_wheel: InstalledWheel, tmp_path: Path
) -> None:
    unit = relocated(UNITS[name], installed_wheel, tmp_path)
    done = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, check=False
    )
    # verify exits 0 on a line it could not parse ("ignoring"): any output is a fault.
    assert done.returncode == 0, done.stderr
    assert done.stderr == "", done.stderr
    assert done.stdout == "", done.stdout


@needs_systemd
@pytest.mark.parametrize("name", sorted(UNITS))
def test_the_sandbox_scores_low_exposure(
    name: str, installed_wheel: InstalledWheel, tmp_path: Path
) -> None:
    unit = relocated(UNITS[name], installed_wheel, tmp_path)
    done = subprocess.run(
        [
            *("systemd-analyze", "security", "--offline=true", "--no-pager"),
            f"--threshold={MAX_EXPOSURE}",
            str(unit),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr


@pytest.mark.parametrize("name", sorted(UNITS))
def test_the_unit_is_hardened_and_reloads_with_sighup(name: str) -> None:
    s = service(UNITS[name])
    assert s["NoNewPrivileges"] == ["yes"]
    assert s["User"] == ["iop"]
    assert s["Group"] == ["iop"]
    assert s["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert s["KillSignal"] == ["SIGTERM"]  # the signal that drains (iop/cli/_signals.py)
    assert s["ProtectSystem"] == ["strict"]
    assert s["CapabilityBoundingSet"] == [""]


@pytest.mark.parametrize("name", sorted(UNITS))
def test_the_unit_starts_iop_with_a_config_it_can_read(name: str) -> None:
    (start,) = service(UNITS[name])["ExecStart"]
    argv = shlex.split(start)
    assert argv[0] == f"{PREFIX}/bin/iop"
    args = build_parser().parse_args(argv[1:])
    assert args.command == name
    # /etc/iop/<name>.toml is deploy/config/<name>.toml, installed (the unit's header).
    assert args.config == f"/etc/iop/{name}.toml"
    assert f"deploy/config/{name}.toml /etc/iop/{name}.toml" in UNITS[name].read_text()
    config = DEPLOY / "config" / f"{name}.toml"
    # Every variable it reads is set by the unit or the env file.
    env = dict(line.partition("=")[::2] for line in service(UNITS[name]).get("Environment", []))
    for line in (DEPLOY / "iop.env.example").read_text().splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key] = value
    needed = set(ENV_REF.findall(config.read_text()))
    assert needed <= set(env), needed - set(env)
    assert service(UNITS[name])["EnvironmentFile"] == ["/etc/iop/iop.env"]


@pytest.mark.parametrize("name", sorted(UNITS))
def test_systemd_waits_for_the_drain(name: str) -> None:
    (stop,) = service(UNITS[name])["TimeoutStopSec"]
    cfg = load(DEPLOY / "config" / f"{name}.toml", CONFIGS[name])
    drain = cfg.server.drain_timeout_s if isinstance(cfg, EdgeConfig) else cfg.node.drain_timeout_s
    assert int(stop) > drain
