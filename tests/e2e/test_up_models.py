"""README "Models on demand": ``iop up --config configs/up-models.toml`` runs
the packaged SmolLM2-135M under three names with different context sizes as
on-demand llama.cpp models, and ``iop models`` loads them, evicting the least
recently used when the budget is full. Real llama.cpp servers, real
processes, the official SDK.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from iop.testing import Proc
from tests.e2e._platform import poll, require_real_backend

pytestmark = pytest.mark.slow

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "up-models.toml"
# Three llama.cpp servers start and stop: generous on a loaded machine.
READY_TIMEOUT_S = 120.0


@pytest.fixture
def up(tmp_path: Path) -> Iterator[str]:
    require_real_backend()
    proc = Proc("iop-up-models", ["up", "--port", "0", "--config", str(CONFIG)], tmp_path)
    try:
        proc.wait_stdout(r"iop up: ready; models: .*", timeout=READY_TIMEOUT_S)
        m = re.search(r"OpenAI API on (http://\S+)/v1", proc.stdout())
        assert m is not None, proc.logs()
        yield m.group(1)
    finally:
        proc.stop()


def iop_models(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "iop", "models", *args, "--url", url],
        capture_output=True,
        text=True,
        timeout=READY_TIMEOUT_S + 30,
        check=False,
    )


def node(url: str) -> dict[str, Any]:
    nodes = httpx.get(f"{url}/admin/nodes", trust_env=False).json()["nodes"]
    found: dict[str, Any] = next(n for n in nodes if n["id"] == "local")
    return found


def states(url: str) -> dict[str, str]:
    return {m["model"]: m["state"] for m in node(url)["models"]}


def test_up_serves_three_context_sizes_of_smollm2_on_demand(up: str) -> None:
    poll(lambda: node(up)["models"], timeout=30.0, what="the node's models")
    assert states(up) == {"smollm2-2k": "cold", "smollm2-4k": "cold", "smollm2-8k": "cold"}
    assert node(up)["memory_mib"] == {"used": 0, "budget": 600}

    for name in ("smollm2-2k", "smollm2-4k"):
        out = iop_models(up, "load", "local", name, "--wait", "--timeout", str(READY_TIMEOUT_S))
        assert out.returncode == 0, out.stderr
        assert f"{name} on local: ready" in out.stdout
    assert node(up)["memory_mib"]["used"] == 450

    with openai.OpenAI(base_url=f"{up}/v1", api_key="x", max_retries=0, timeout=60.0) as client:
        reply = client.chat.completions.create(
            model="smollm2-4k",
            messages=[{"role": "user", "content": "Name a colour."}],
            max_tokens=8,
        )
    assert reply.choices[0].message.content
    assert reply.model == "smollm2-4k"

    # The 8k one does not fit beside both: the least recently used (2k) goes.
    out = iop_models(up, "load", "local", "smollm2-8k", "--wait", "--timeout", "120")
    assert out.returncode == 0, out.stderr
    poll(
        lambda: states(up) == {"smollm2-2k": "cold", "smollm2-4k": "ready", "smollm2-8k": "ready"},
        timeout=30.0,
        what="smollm2-2k evicted for smollm2-8k",
    )
    assert node(up)["memory_mib"] == {"used": 600, "budget": 600}
    listed = iop_models(up, "list")
    assert listed.returncode == 0, listed.stderr
    assert re.search(r"^local\s+smollm2-8k\s+ready\s+350 MiB", listed.stdout, re.M)
