"""The reload path of the long-running commands (iop.cli._reloader): one reload
at a time, a refused file changes nothing, a real SIGHUP reloads; and where
``iop reload`` asks (iop.cli._reload)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from pathlib import Path

import msgspec
import pytest
import trio
import trio.testing

from iop._reload import NODE_RULES
from iop.cli._reload import admin_where as _where
from iop.cli._reloader import Reloader, watch_reloads
from iop.cli._signals import open_stop_signals
from iop.config import NodeConfig, NodeSection, SimInstance
from iop.errors import ConfigError

log = logging.getLogger("tests.reloader")


def node(probe_interval_s: float = 10.0) -> NodeConfig:
    return NodeConfig(
        node=NodeSection(id="n1", probe_interval_s=probe_interval_s),
        instances=[SimInstance(name="s")],
    )


class Files:
    """What the file says next, and what the process was given."""

    def __init__(self) -> None:
        self.next: NodeConfig | Exception = node()
        self.applied: list[NodeConfig] = []
        self.loads = 0
        self.gate: threading.Event | None = None

    def load(self) -> NodeConfig:
        self.loads += 1
        if self.gate is not None:
            self.gate.wait(10)
        if isinstance(self.next, Exception):
            raise self.next
        return self.next

    def reloader(self, source: str | None = "node.toml") -> Reloader[NodeConfig]:
        return Reloader(
            source=source,
            running=node(),
            load=self.load,
            rules=NODE_RULES,
            apply=self.applied.append,
            secrets=lambda cfg: [],
            log=log,
        )


async def test_a_live_change_is_applied_and_a_restart_key_is_kept() -> None:
    files = Files()
    reloader = files.reloader()
    new = node(probe_interval_s=1.0)
    files.next = msgspec.structs.replace(new, node=msgspec.structs.replace(new.node, id="n2"))
    outcome = await reloader.reload("test")
    assert outcome.status == "applied"
    assert outcome.applied == ["node.probe_interval_s"]
    assert outcome.restart_required == ["node.id"]
    (applied,) = files.applied
    assert applied.node.probe_interval_s == 1.0
    assert applied.node.id == "n1"
    assert reloader.running is applied
    # The same file again: no key changed, the restart key still pending; it
    # is applied all the same (files such as certificates are read again).
    again = await reloader.reload("test")
    assert again.status == "unchanged"
    assert again.restart_required == ["node.id"]
    assert len(files.applied) == 2
    assert files.applied[1] == applied


async def test_a_refused_file_changes_nothing(caplog: pytest.LogCaptureFixture) -> None:
    files = Files()
    reloader = files.reloader()
    files.next = ConfigError("node.toml: unknown key 'node.bogus'")
    outcome = await reloader.reload("SIGHUP")
    assert outcome.status == "refused"
    assert outcome.error == "node.toml: unknown key 'node.bogus'"
    assert "reload (SIGHUP): refused: node.toml: unknown key 'node.bogus'" in caplog.text
    files.next = RuntimeError("a bug")
    crashed = await reloader.reload("SIGHUP")
    assert crashed.status == "refused"
    assert crashed.error == "internal error: RuntimeError"
    assert files.applied == []
    assert reloader.running == node()
    no_file = await files.reloader(source=None).reload("SIGHUP")
    assert no_file.status == "refused"
    assert "without a config file" in (no_file.error or "")


async def test_reloads_run_one_at_a_time() -> None:
    files = Files()
    reloader = files.reloader()
    files.gate = threading.Event()
    files.next = node(probe_interval_s=2.0)
    outcomes: list[str] = []

    async def one() -> None:
        outcomes.append((await reloader.reload("test")).status)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one)
        nursery.start_soon(one)
        with trio.fail_after(10):
            while files.loads == 0:
                await trio.sleep(0.01)
        await trio.testing.wait_all_tasks_blocked()
        assert files.loads == 1  # the second waits for the first
        files.gate.set()
    # The second is planned against what the first left: no key changed.
    assert outcomes == ["applied", "unchanged"]
    assert len(files.applied) == 2
    assert files.applied[0] == files.applied[1]


async def test_sighup_reloads_and_the_drain_ends_the_watch() -> None:
    files = Files()
    reloader = files.reloader()
    files.next = node(probe_interval_s=3.0)
    async with open_stop_signals(log, reload=True) as stop, trio.open_nursery() as nursery:
        await nursery.start(watch_reloads, stop, reloader)
        os.kill(os.getpid(), signal.SIGHUP)
        with trio.fail_after(10):
            while not files.applied:
                await trio.sleep(0.01)
        stop.drain.set()  # what the first SIGTERM does: no more reloads
    assert files.applied[0].node.probe_interval_s == 3.0


def _args(**kw: object) -> argparse.Namespace:
    base: dict[str, object] = {"config": None, "url": None, "key": None}
    return argparse.Namespace(**{**base, **kw})


def test_iop_reload_asks_the_edge_its_file_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("IOP_ADMIN_KEY", raising=False)
    monkeypatch.setenv("IOP_TEST_ADMIN", "iop-admin-from-env")
    edge = tmp_path / "edge.toml"
    edge.write_text(
        '[server]\nhost = "0.0.0.0"\nport = 9123\napi_keys = ["k-client"]\n'
        'admin_keys = ["${IOP_TEST_ADMIN}"]\nbogus = 1\n'  # invalid, still readable
    )
    assert _where(_args(config=str(edge))) == ("http://127.0.0.1:9123", "iop-admin-from-env")
    up = tmp_path / "up.toml"
    up.write_text('[edge.server]\nport = 9124\napi_keys = ["k-client"]\n')
    # A client key never opens /admin: none is sent.
    assert _where(_args(config=str(up))) == ("http://127.0.0.1:9124", None)
    monkeypatch.setenv("IOP_ADMIN_KEY", "k-env")
    assert _where(_args(config=str(up), url="http://e:1")) == ("http://e:1", "k-env")
    broken = tmp_path / "broken.toml"
    broken.write_text("[server\n")
    with pytest.raises(ConfigError, match=r"not valid TOML.*pass --url"):
        _where(_args(config=str(broken)))
    with pytest.raises(ConfigError, match="--url, --config or --pid"):
        _where(_args())
