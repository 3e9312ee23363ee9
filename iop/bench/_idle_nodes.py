"""``idle-nodes``: the edge's CPU with many idle node links, and how fast a lost node goes.

One edge and --nodes idle nodes. --real-nodes of them are ``iop node``
processes (each with an in-process sim instance); the rest are
``NodeAgent``s (``iop.node.open_node_agent``, the code ``iop node`` runs)
in one helper process (this module with ``--serve-agents``), each with its
own node id, a sim instance and its own WebSocket link: the edge sees 100
real links either way, and one process keeps 100 Python interpreters
(about 5 GiB and minutes of CPU to start on 2 cores) out of the
measurement. Once /admin/nodes lists them all, edge CPU (utime+stime from
/proc/PID/stat) is measured over --idle-s, with the nodes' CPU per node
from both kinds of process. Then node-loss detection: SIGSTOP one real
node (a frozen host) and time until /admin/nodes no longer lists it,
--loss-trials times, and once with SIGKILL (the TCP connection closes at
once).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Final

import httpx
import msgspec
import trio

from iop.bench._procs import (
    NODE_TOKEN,
    CpuWindow,
    Stack,
    find_py_spy,
    log_counts,
    rss_kb,
    script_main,
    spy_report,
    start_edge,
    start_node,
    start_py_spy,
)
from iop.bench._report import fmt, table
from iop.bench._results import summary
from iop.bench._runner import ReportInput, RunContext, options_argv, register
from iop.bench._steps import Step, run_step
from iop.testing import Proc

__all__ = ["STEP", "IdleNodesOptions", "print_idle_nodes", "run_idle_nodes", "serve_agents"]


def _sim_instance() -> dict[str, Any]:
    return {"adapter": "sim", "name": "sim"}


def _node_ids(c: httpx.Client, url: str) -> set[str]:
    r = c.get(url + "/admin/nodes")
    r.raise_for_status()
    return {n["id"] for n in r.json()["nodes"]}


def _idle_spies(  # pragma: no cover - py-spy attaches by ptrace: not in the suite
    args: argparse.Namespace, pids: dict[str, int], seconds: float
) -> dict[str, tuple[Path, Any]]:
    """py-spy at 1000 Hz on ``pids`` for ``seconds`` (an idle edge spends a few
    ms per second: 100 Hz would sample it a handful of times)."""
    py_spy = find_py_spy(args.python)
    if py_spy is None:
        print("bench: --idle-profile needs py-spy (pip install py-spy)", file=sys.stderr)
        return {}
    out: dict[str, tuple[Path, Any]] = {}
    for name, pid in pids.items():
        raw = args.out_dir / f"stress-{args.stamp}-idle-{name}.txt"
        out[name] = (raw, start_py_spy(py_spy, pid, raw, rate=1000, seconds=seconds))
    return out


def run_idle_nodes(args: argparse.Namespace, stack: Stack) -> dict[str, Any]:
    edge, url, link = start_edge(stack, {})
    with httpx.Client(timeout=10, trust_env=False) as c:
        return _idle_nodes(args, stack, c, edge, url, link)


def _idle_nodes(
    args: argparse.Namespace, stack: Stack, c: httpx.Client, edge: Proc, url: str, link: str
) -> dict[str, Any]:
    out: dict[str, Any] = {"nodes": args.nodes, "real_nodes": args.real_nodes}
    time.sleep(1.0)
    w = CpuWindow({"edge": edge.pid})
    time.sleep(5.0)
    out["edge_alone"] = w.stop()
    reals = [
        start_node(stack, f"idle-real-{i}", link, {}, [_sim_instance()])
        for i in range(args.real_nodes)
    ]
    agents = args.nodes - args.real_nodes
    helper = None
    if agents:
        helper = stack.launch(
            "agents",
            argv=[
                args.python,
                "-m",
                "iop.bench._idle_nodes",
                "--serve-agents",
                str(agents),
                "--link",
                link,
            ],
        )
    t0 = time.monotonic()
    deadline = t0 + 90
    while len(_node_ids(c, url)) < args.nodes:
        for p in stack.procs:
            if not p.alive:
                raise RuntimeError(f"{p.name} exited:\n{p.logs(tail=15)}")
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"only {len(_node_ids(c, url))} of {args.nodes} nodes joined in 90 s"
            )
        time.sleep(0.5)
    out["join_s"] = round(time.monotonic() - t0, 1)
    print(f"bench: idle-nodes: {args.nodes} nodes joined in {out['join_s']} s", flush=True)
    time.sleep(3.0)  # the joins' own work is over
    polls = []
    for _ in range(5):
        t = time.perf_counter()
        _node_ids(c, url)
        polls.append(1000 * (time.perf_counter() - t))
    # The resolution of the loss times below: one /admin/nodes poll.
    out["admin_poll_ms"] = summary(polls)
    time.sleep(1.0)
    pids = {"edge": edge.pid} | {p.name: p.pid for p in reals}
    if helper is not None:
        pids["agents"] = helper.pid
    rss0 = {k: rss_kb(p) for k, p in pids.items()}
    w = CpuWindow(pids)
    time.sleep(args.idle_s)
    idle = w.stop()
    out["idle"] = idle
    out["rss_kb"] = rss0
    if args.idle_profile > 0:
        # After the CPU window, so the sampler's own reads stay out of it.
        spies = _idle_spies(args, {"edge": edge.pid}, args.idle_profile)
        time.sleep(args.idle_profile)
        out["profile"] = spy_report(spies)
    cpu = idle["cpu_s"]
    wall = idle["wall_s"]
    real_pct = [100 * cpu[p.name] / wall for p in reals]
    out["edge_cpu_pct_of_core"] = round(100 * cpu["edge"] / wall, 2)
    out["edge_cpu_ms_per_node_s"] = round(1000 * cpu["edge"] / wall / args.nodes, 3)
    out["real_node_cpu_pct_of_core"] = [round(x, 2) for x in real_pct]
    out["real_node_cpu_ms_per_s"] = round(10 * sum(real_pct) / len(real_pct), 3)
    if helper is not None:
        out["agent_cpu_ms_per_node_s"] = round(1000 * cpu["agents"] / wall / agents, 3)
    # Node loss: a frozen node (SIGSTOP) is only noticed by the heartbeat timeout.
    losses: list[float] = []
    for p in reals[: args.loss_trials]:
        os.kill(p.pid, signal.SIGSTOP)
        t0 = time.perf_counter()
        while p.name in _node_ids(c, url):
            if time.perf_counter() - t0 > 30:
                break
            time.sleep(0.02)
        losses.append(round(time.perf_counter() - t0, 3))
        os.kill(p.pid, signal.SIGCONT)
    out["loss_sigstop_s"] = losses
    killed = reals[-1]
    os.kill(killed.pid, signal.SIGKILL)
    t0 = time.perf_counter()
    while killed.name in _node_ids(c, url) and time.perf_counter() - t0 < 30:
        time.sleep(0.005)
    out["loss_sigkill_s"] = round(time.perf_counter() - t0, 3)
    killed.popen.wait(5)
    out["edge_log_warnings"] = log_counts(edge)
    return out


def print_idle_nodes(res: dict[str, Any]) -> None:
    idle = res["idle"]
    print(
        f"\nidle-nodes: {res['nodes']} nodes ({res['real_nodes']} `iop node` processes), "
        f"{idle['wall_s']:.0f} s idle"
    )
    print(
        f"  edge: {res['edge_cpu_pct_of_core']} % of a core "
        f"({res['edge_cpu_ms_per_node_s']} ms CPU per node per second; "
        f"alone, no nodes: {res['edge_alone']['cpu_pct_of_core']['edge']} %)"
    )
    print(
        f"  a node process: {res['real_node_cpu_ms_per_s']} ms CPU per second "
        f"({res['real_node_cpu_pct_of_core']} % of a core each)"
    )
    if "agent_cpu_ms_per_node_s" in res:
        print(f"  an in-process NodeAgent: {res['agent_cpu_ms_per_node_s']} ms CPU per second")
    print(
        f"  node loss: SIGSTOP detected after {res['loss_sigstop_s']} s, "
        f"SIGKILL after {res['loss_sigkill_s']} s (one /admin/nodes poll: "
        f"{res['admin_poll_ms'].get('p50')} ms); "
        f"load {idle['loadavg']}, foreign {idle['foreign_cpu_pct_of_core']} %"
    )
    for name, rep in res.get("profile", {}).items():
        print(f"  py-spy {name}: {rep.get('samples')} samples, {rep.get('raw_file')}")
        for fn, share in rep.get("inclusive_pct_top_functions", [])[:12]:
            print(f"    {share:5.1f} %  {fn}")


def serve_agents(
    args: argparse.Namespace,
) -> int:  # pragma: no cover - runs in the idle-nodes helper process
    """The helper process of idle-nodes: ``--serve-agents N`` NodeAgents on one link URL."""
    from iop.config import NodeConfig, decode_config
    from iop.node import open_node_agent

    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    async def agents() -> None:
        async with contextlib.AsyncExitStack() as stack, trio.open_nursery() as nursery:
            for i in range(args.serve_agents):
                cfg = decode_config(
                    {
                        "node": {
                            "id": f"idle-{args.first_id + i:03d}",
                            "edges": [{"url": args.link, "token": NODE_TOKEN}],
                        },
                        "instances": [_sim_instance()],
                    },
                    NodeConfig,
                    source="iop.bench._idle_nodes --serve-agents",
                )
                agent = await stack.enter_async_context(open_node_agent(cfg))
                await nursery.start(agent.serve)
            print(f"agents: {args.serve_agents} serving", flush=True)
            await trio.sleep_forever()

    trio.run(agents)
    return 0


# --------------------------------------------------------------------------- options


def add_arguments(g: argparse._ArgumentGroup) -> None:
    d = IdleNodesOptions()  # the defaults are the runner's: one copy
    g.add_argument("--nodes", type=int, default=d.nodes, help="idle nodes (default: %(default)s)")
    g.add_argument(
        "--real-nodes",
        type=int,
        default=d.real_nodes,
        help="of them, `iop node` processes; the rest are NodeAgents in one helper "
        "process (default: %(default)s)",
    )
    g.add_argument(
        "--idle-s", type=float, default=d.idle_s, help="CPU measurement (default: %(default)s)"
    )
    g.add_argument(
        "--loss-trials",
        type=int,
        default=d.loss_trials,
        help="SIGSTOP node-loss detections, one per real node (default: %(default)s)",
    )
    g.add_argument(
        "--idle-profile",
        type=float,
        default=0.0,
        metavar="S",
        help="after the CPU window, py-spy (1000 Hz, idle stacks left out) on the edge "
        "for S seconds; raw stacks go to --out-dir (default: none)",
    )


def check(args: argparse.Namespace, ap: argparse.ArgumentParser) -> None:
    if args.real_nodes > args.nodes or args.real_nodes < 1:
        ap.error("--real-nodes must be within 1..--nodes")
    if args.loss_trials >= args.real_nodes:
        ap.error("--loss-trials must be below --real-nodes (the last one is SIGKILLed)")


STEP: Final = Step(
    "idle-nodes", "about 45 s", __doc__, add_arguments, run_idle_nodes, print_idle_nodes, check
)


# --------------------------------------------------------------------------- iop bench


class IdleNodesOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The idle-nodes measurement's options (one edge, N idle node links)."""

    nodes: int = 100
    real_nodes: int = 4
    idle_s: float = 20.0
    loss_trials: int = 3


def _idle_report(r: ReportInput) -> dict[str, str]:
    res = r.median
    rows = [
        [
            "edge, no node connected",
            f"{fmt(res['edge_alone']['cpu_pct_of_core']['edge'], 2)} % of a core",
        ],
        [
            f"**edge, {res['nodes']} idle nodes**",
            f"**{fmt(res['edge_cpu_pct_of_core'], 2)} % of a core** "
            f"({fmt(res['edge_cpu_ms_per_node_s'], 3)} ms per node per second)",
        ],
        [
            f"an `iop node` process ({res['real_nodes']} measured, 10 ms clock ticks)",
            f"{fmt(res['real_node_cpu_ms_per_s'], 2)} ms per second",
        ],
    ]
    if "agent_cpu_ms_per_node_s" in res:
        rows.append(
            [
                "a `NodeAgent` in the shared process",
                f"{fmt(res['agent_cpu_ms_per_node_s'], 2)} ms per second",
            ]
        )
    rows.append(
        [
            "node frozen (SIGSTOP) → gone from `/admin/nodes`",
            ", ".join(fmt(x, 2) for x in res["loss_sigstop_s"]) + " s",
        ]
    )
    rows.append(["node killed (SIGKILL) → gone", f"{fmt(res['loss_sigkill_s'], 2)} s"])
    text = table(["", "CPU"], rows)
    text += f"\n\nForeign CPU during the idle window: {fmt(res['idle']['foreign_cpu_pct_of_core'], 0)} % of a core."
    return {r.scenario: f"{text}\n\n{r.footer}"}


@register(
    "idle-nodes",
    IdleNodesOptions,
    "Edge CPU with N idle node links; how fast a frozen or killed node is dropped",
    report=_idle_report,
)
def run(opts: IdleNodesOptions, ctx: RunContext) -> dict[str, Any]:
    if ctx.smoke:
        opts = msgspec.structs.replace(opts, nodes=2, real_nodes=2, idle_s=1.0, loss_trials=1)
    return run_step(STEP, options_argv(opts), ctx)


def _agents_main(argv: list[str] | None = None) -> int:  # pragma: no cover - a helper process
    ap = argparse.ArgumentParser(description="idle-nodes' helper process: N NodeAgents")
    ap.add_argument("--serve-agents", type=int, required=True)
    ap.add_argument("--link", required=True)
    ap.add_argument("--first-id", type=int, default=0)
    args = ap.parse_args(argv)
    return script_main(lambda: serve_agents(args), on_interrupt=0)


if __name__ == "__main__":
    sys.exit(_agents_main())
