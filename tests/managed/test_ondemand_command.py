"""Models on demand started by a command (``engine = "vllm"``,
``iop.managed._command``), with real processes: ``iop sim`` speaks vLLM's
wire and answers ``/health``, so it stands in for ``vllm serve``."""

from __future__ import annotations

import sys

import msgspec
import pytest
import trio

from iop.config import NodeSection, VllmModel
from iop.errors import BackendUnavailable, ErrorCode
from iop.node._models import ModelManager
from iop.ondemand import ModelState

# Starting a Python process that imports IOP: a few seconds on a loaded machine.
LOAD_TIMEOUT_S = 60.0


def command_model(name: str, command: list[str], **kw: object) -> VllmModel:
    return msgspec.convert(
        {"engine": "vllm", "name": name, "memory_mib": 100, "command": command, **kw}, VllmModel
    )


SIM = [sys.executable, "-m", "iop", "sim", "--port", "{port}", "--model", "{name}"]


async def test_a_command_model_loads_serves_its_name_and_unloads() -> None:
    mgr = ModelManager(
        [command_model("sim-a", SIM), command_model("sim-b", SIM)], [], NodeSection(memory_mib=150)
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(mgr.serve)
        lease = await mgr.acquire("sim-a", LOAD_TIMEOUT_S)
        probe = await lease.adapter.probe("sim-a")
        assert probe.status == "available"
        assert probe.targets == ("sim-a",)
        mgr.release(lease)
        lease = await mgr.acquire("sim-b", LOAD_TIMEOUT_S)
        assert mgr.table.models["sim-a"].state is ModelState.COLD
        mgr.release(lease)
        nursery.cancel_scope.cancel()


async def test_a_command_that_exits_while_loading_fails_the_load_with_its_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    failing = [sys.executable, "-c", "import sys; print('no GPU found'); sys.exit(3)", "{port}"]
    mgr = ModelManager([command_model("broken", failing)], [], NodeSection(memory_mib=150))
    async with trio.open_nursery() as nursery:
        await nursery.start(mgr.serve)
        with pytest.raises(BackendUnavailable) as failed:
            await mgr.acquire("broken", LOAD_TIMEOUT_S)
        assert failed.value.code == ErrorCode.MODEL_LOAD_FAILED
        assert "exited with 3 while loading" in failed.value.message
        assert mgr.table.models["broken"].state is ModelState.FAILED
        nursery.cancel_scope.cancel()
    # The node's log has the process's last lines with the reason.
    assert any(
        "exited with 3 while loading; last lines of its log:\nno GPU found" in r.getMessage()
        for r in caplog.records
    )
