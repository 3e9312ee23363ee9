"""The soak's processes: started, faulted on a schedule, sampled, their ledger read back.

``SoakStack`` starts valkey, ``iop sim``, the edge and two nodes (one with a
managed llama.cpp server) by role and restarts a role after a fault
(``apply_fault``: a node killed, llama.cpp killed, Valkey restarted, the
edge reloaded by SIGHUP or ``POST /admin/reload``); ``take_sample`` reads
RSS, fds and CPU of every process from /proc; ``ledger`` reads the usage
ledger back after the edge's graceful stop, against what the clients saw.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import httpx
import trio

from iop.bench._edges import key_digest
from iop.bench._procs import descendants, fd_count, proc_cpu_s, rss_kb, start_valkey
from iop.bench._runner import RunContext
from iop.bench._soak_traffic import KEYS, LLAMA_MODEL, SIM_MODEL, Options, Request
from iop.ledger import LedgerStore
from iop.testing import EDGE_READY, NODE_READY, SIM_READY, Proc, free_port, poll, toml_dumps

__all__ = [
    "START_S",
    "Fault",
    "SoakStack",
    "apply_fault",
    "count_runs",
    "deaths",
    "fault_dict",
    "ledger",
    "run_faults",
    "sampler",
    "schedule",
    "take_sample",
]

_TOKEN: Final = "iop-bench-soak-node-token"
_OPERATOR: Final = "iop-bench-soak-operator"
# Start-ups on a loaded 2-core box: llama.cpp loads its model in ~1 s alone.
START_S: Final = 90.0
# A fault's recovery (a node's re-dial, llama.cpp's restart) gets this long.
RECOVER_S: Final = 90.0
# The edge's last runs, after the traffic stops, end within this.


@dataclass
class SoakStack:
    """The soak's processes by role; a restarted one replaces its role's entry."""

    opts: Options
    ctx: RunContext
    procs: dict[str, Proc] = field(default_factory=dict)
    # Every process ever started, with whether a fault ended it on purpose.
    history: list[tuple[Proc, bool]] = field(default_factory=list)
    killed: set[int] = field(default_factory=set)  # pids a fault ended
    generation: dict[str, int] = field(default_factory=dict)
    reload_rpm: int = 1_000_000

    @property
    def wd(self) -> Path:
        return self.ctx.workdir

    def _launch(self, role: str, args: list[str], **kw: Any) -> Proc:
        gen = self.generation.get(role, 0) + 1
        self.generation[role] = gen
        name = role if gen == 1 else f"{role}-{gen}"
        proc = Proc(name, args, self.wd, python=self.ctx.python, **kw)
        self.procs[role] = proc
        self.history.append((proc, False))
        return proc

    def start_valkey(self) -> None:
        start_valkey(lambda argv: self._launch("valkey", [], argv=argv), self.valkey_port)

    def edge_config(self) -> dict[str, Any]:
        return {
            "server": {"admin_keys": [_OPERATOR]},
            "usage": {"ledger_path": str(self.wd / "usage.db"), "flush_interval_s": 0.5},
            "prices": {"*": {"input": 0.5, "output": 1.5}},
            "cluster": {
                "valkey_url": f"redis://127.0.0.1:{self.valkey_port}/0",
                "edge_id": "soak-edge",
                "key_prefix": "soak:",
            },
            "tenants": [
                {
                    "name": "alpha",
                    "keys": [{"sha256": key_digest(KEYS["alpha"]), "name": "alpha-ci"}],
                    # Changed by every reload, never reached.
                    "requests_per_minute": self.reload_rpm,
                    "max_concurrent_runs": 1000,
                },
                {
                    "name": "beta",
                    "key_sha256": [key_digest(KEYS["beta"])],
                    "tokens_per_minute": 100_000_000,
                },
            ],
        }

    def start(self) -> None:
        self.valkey_port = free_port()
        self.start_valkey()
        sim = self._launch(
            "sim",
            [
                "sim",
                "--port",
                "0",
                "--ttft",
                str(self.opts.sim_ttft_s),
                "--tokens-per-s",
                str(self.opts.sim_tokens_per_s),
                "--seed",
                str(self.opts.seed),
                "--log-level",
                "warning",
            ],
        )
        self.sim_url = sim.wait_stdout(SIM_READY, START_S).group(1)
        self.edge_path = self.wd / "edge.toml"
        self.edge_path.write_text(toml_dumps(self.edge_config()))
        edge = self._launch(
            "edge",
            ["edge", "--port", "0", "--node-token", _TOKEN, "--config", str(self.edge_path)],
        )
        m = edge.wait_stdout(EDGE_READY, START_S)
        self.url, self.link = m.group(1), m.group(2)
        self.start_node_sim()
        self.start_node_llama()
        self.wait_models({SIM_MODEL, LLAMA_MODEL})
        self.llama_pid()  # it runs

    def _node_config(self, node_id: str, instance: dict[str, Any]) -> Path:
        cfg = {
            "node": {
                "id": node_id,
                "reconnect_min_s": 0.1,
                "reconnect_max_s": 1.0,
                "edges": [{"url": self.link, "token": _TOKEN}],
            },
            "instances": [instance],
        }
        path = self.wd / f"{node_id}.toml"
        path.write_text(toml_dumps(cfg))
        return path

    def start_node_sim(self) -> None:
        path = self._node_config(
            "node-sim",
            {"adapter": "vllm", "name": "sim", "endpoint": self.sim_url, "max_concurrency": 32},
        )
        self._launch("node-sim", ["node", "--config", str(path)]).wait_stdout(NODE_READY, START_S)

    def start_node_llama(self) -> None:
        path = self._node_config(
            "node-llama",
            {
                "adapter": "llamacpp",
                "name": "llama",
                "parallel": 2,
                "ctx": 2048,
                "threads": 1,
                "supervise": {"restart_min_s": 1.0, "restart_max_s": 10.0},
            },
        )
        self._launch("node-llama", ["node", "--config", str(path)]).wait_stdout(NODE_READY, START_S)

    def llama_pid(self) -> int | None:
        """The managed llama.cpp server's pid while it serves, or None: the
        last one the node logged ready (docs/operations.md, "When a managed
        backend dies"), if it is still its descendant."""
        node = self.procs["node-llama"]
        ready = re.findall(r"llama\.cpp server is ready at .*\bpid (\d+)\)", node.stderr())
        if not ready or int(ready[-1]) not in descendants(node.pid):
            return None
        return int(ready[-1])

    def _get(self, path: str, key: str = _OPERATOR) -> httpx.Response:
        return httpx.get(
            self.url + path,
            headers={"Authorization": f"Bearer {key}"},
            timeout=10,
            trust_env=False,
        )

    def models(self) -> set[str]:
        try:
            r = self._get("/v1/models", KEYS["alpha"])
        except httpx.TransportError:
            return set()
        return {m["id"] for m in r.json()["data"]} if r.status_code == 200 else set()

    def node_state(self) -> dict[str, Any]:
        r = self._get("/admin/nodes")
        r.raise_for_status()
        data: dict[str, Any] = r.json()
        return data

    def ready(self, want: set[str]) -> bool:
        """Every model of ``want`` served by an available instance."""
        if not want <= self.models():
            return False
        up: set[str] = set()
        for node in self.node_state()["nodes"]:
            for inst in node.get("instances", []):
                if inst.get("status", "available") == "available":
                    up.update(inst.get("models", []))
        return want <= up if up else True

    def wait_models(self, want: set[str]) -> None:
        def check() -> bool:
            for role, proc in self.procs.items():
                if not proc.alive:
                    raise RuntimeError(f"{role} exited:\n{proc.logs()}")
            return self.ready(want)

        poll(check, timeout=START_S, what=f"the edge to serve {sorted(want)}", interval=0.2)

    def kill(self, role: str) -> Proc:
        proc = self.procs[role]
        self.killed.add(proc.pid)
        proc.kill()
        return proc

    def stop(self) -> dict[str, int | None]:
        """Stop every process still running (last started first); their exit codes."""
        codes: dict[str, int | None] = {}
        for proc, _ in reversed(self.history):
            if proc.alive:
                try:
                    codes[proc.name] = proc.stop()
                except Exception as exc:  # recorded: the run goes on stopping the rest
                    codes[proc.name] = None
                    print(f"bench soak: stopping {proc.name}: {exc!r}")
        return codes


# --------------------------------------------------------------------------- faults


@dataclass
class Fault:
    at_s: float
    kind: str  # "reload-sighup", "reload-post", "node-kill", "llama-kill", "valkey-restart"
    done_s: float | None = None
    recovered_s: float | None = None  # from the fault to serving again
    detail: str = ""


def schedule(opts: Options, duration: float) -> list[Fault]:
    """The faults of a run of ``duration`` seconds, in time order."""
    faults = [
        Fault(0.2 * duration, "node-kill"),
        Fault(0.4 * duration, "llama-kill"),
        Fault(0.6 * duration, "valkey-restart"),
    ]
    for i in range(opts.reloads):
        kind = "reload-sighup" if i % 2 == 0 else "reload-post"
        faults.append(Fault((i + 0.5) / opts.reloads * duration * 0.9, kind))
    return sorted(faults, key=lambda f: f.at_s)


def apply_fault(stack: SoakStack, fault: Fault) -> None:
    """Do ``fault`` and wait until the stack serves again (blocking: run in a thread)."""
    t0 = time.monotonic()
    if fault.kind.startswith("reload"):
        stack.reload_rpm += 1
        stack.edge_path.write_text(toml_dumps(stack.edge_config()))
        if fault.kind == "reload-sighup":
            edge = stack.procs["edge"]
            n = edge.stderr().count("reload (SIGHUP)")
            edge.send(signal.SIGHUP)
            m = poll(
                lambda: re.findall(r"reload \(SIGHUP\): (\w+)", edge.stderr())[n:] or None,
                timeout=RECOVER_S,
                what="the edge to log its reload",
                interval=0.1,
            )
            fault.detail = m[0]
        else:
            r = httpx.post(
                stack.url + "/admin/reload",
                headers={"Authorization": f"Bearer {_OPERATOR}"},
                timeout=30,
                trust_env=False,
            )
            fault.detail = r.json().get("status") if r.status_code == 200 else r.text[:200]
    elif fault.kind == "node-kill":
        stack.kill("node-sim")
        fault.done_s = round(time.monotonic() - t0, 2)
        stack.start_node_sim()
        stack.wait_models({SIM_MODEL})
    elif fault.kind == "llama-kill":
        pid = stack.llama_pid()
        if pid is None:
            raise RuntimeError("no llama.cpp server to kill")
        os.kill(pid, signal.SIGKILL)
        stack.killed.add(pid)
        poll(
            lambda: (p := stack.llama_pid()) is not None and p != pid,
            timeout=RECOVER_S,
            what="the node to restart llama.cpp",
            interval=0.2,
        )
        stack.wait_models({LLAMA_MODEL})
        fault.detail = f"pid {pid} killed"
    elif fault.kind == "valkey-restart":
        old = stack.procs["valkey"]
        stack.killed.add(old.pid)
        old.stop()
        fault.done_s = round(time.monotonic() - t0, 2)
        stack.start_valkey()
    else:
        raise ValueError(fault.kind)
    fault.recovered_s = round(time.monotonic() - t0, 2)


async def run_faults(stack: SoakStack, faults: list[Fault], t0: float) -> None:
    for fault in faults:
        await trio.sleep_until(t0 + fault.at_s)
        await trio.to_thread.run_sync(apply_fault, stack, fault)


# --------------------------------------------------------------------------- samples


def _roles(stack: SoakStack) -> dict[str, int]:
    pids = {role: p.pid for role, p in stack.procs.items() if p.alive}
    llama = stack.llama_pid()
    if llama is not None:
        pids["llama-server"] = llama
    return pids


def take_sample(stack: SoakStack, t: float) -> dict[str, Any]:
    """RSS, fds and CPU of every process of the stack at ``t`` seconds."""
    procs: dict[str, Any] = {}
    for role, pid in _roles(stack).items():
        try:
            procs[role] = {
                "pid": pid,
                "rss_kb": rss_kb(pid),
                "fds": fd_count(pid),
                "cpu_s": round(proc_cpu_s(pid), 2),
            }
        except (OSError, RuntimeError, IndexError):
            continue  # it ended between the listing and the reads
    return {"t": round(t, 1), "procs": procs}


def deaths(stack: SoakStack) -> list[dict[str, Any]]:
    """Processes that exited when no fault ended them."""
    return [
        {"name": p.name, "pid": p.pid, "rc": p.returncode}
        for p, _ in stack.history
        if not p.alive and p.pid not in stack.killed
    ]


async def sampler(
    stack: SoakStack, t0: float, until: float, period: float, out: list[dict[str, Any]]
) -> None:
    while True:
        out.append(take_sample(stack, trio.current_time() - t0))
        if trio.current_time() + period > until:
            return
        await trio.sleep(period)


# --------------------------------------------------------------------------- the ledger


def count_runs(stack: SoakStack) -> dict[str, int]:
    """The edge's ``iop_runs_total`` by outcome (``/metrics``)."""
    text = stack._get("/metrics").text
    runs: dict[str, int] = {}
    for labels, value in re.findall(r"^iop_runs_total\{([^}]*)\} (\S+)$", text, re.MULTILINE):
        outcome = re.search(r'outcome="([^"]*)"', labels)
        key = outcome.group(1) if outcome else "?"
        runs[key] = runs.get(key, 0) + int(float(value))
    return runs


def ledger(stack: SoakStack, requests: list[Request]) -> dict[str, Any]:
    """The ledger (read after the edge's graceful stop) against the clients."""
    path = stack.wd / "usage.db"
    usage_cli = subprocess.run(
        [stack.ctx.python, "-m", "iop", "usage", "--ledger", str(path), "--format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if usage_cli.returncode != 0:
        raise RuntimeError(f"iop usage failed: {usage_cli.stderr}")
    report = json.loads(usage_cli.stdout)
    store = LedgerStore(path, readonly=True)
    try:
        records = store.since(0)
    finally:
        store.close()
    by_outcome: dict[str, int] = {}
    tokens = [0, 0, 0]
    for rec in records:
        by_outcome[rec.outcome] = by_outcome.get(rec.outcome, 0) + 1
        if rec.outcome == "complete":
            tokens[0] += rec.input_tokens
            tokens[1] += rec.output_tokens
            tokens[2] += rec.cached_tokens
    done = [r for r in requests if r.outcome == "complete"]
    client = [sum(r.usage[i] for r in done) for i in range(3)]
    return {
        "records": len(records),
        "usage_cli": report.get("total", report),
        "by_outcome": by_outcome,
        "complete_tokens": {"input": tokens[0], "output": tokens[1], "cached": tokens[2]},
        "client_complete": len(done),
        "client_tokens": {"input": client[0], "output": client[1], "cached": client[2]},
        "tokens_equal": tokens == client,
        "complete_equal": by_outcome.get("complete", 0) == len(done),
    }


def fault_dict(f: Fault) -> dict[str, Any]:
    return {
        "at_s": round(f.at_s, 1),
        "kind": f.kind,
        "recovered_s": f.recovered_s,
        "detail": f.detail,
    }
