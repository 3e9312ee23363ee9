"""``memory``: RSS of edge and node with idle streams open, and after they close.

The same mock backend sends its headers and one chunk, then stays silent.
The script opens --streams streams (1,000; the file limit is raised to the
hard limit), waits until every client has its first chunk, and samples
VmRSS of edge and node (/proc/PID/status) before, with all open, and
--settle-s after closing them all (clients close their sockets). Deadlines
and the node's slots are configured out of the way (every timeout 3600 s,
max_concurrency above --streams). --rounds times in one set of processes:
the first round is the cost of a fresh process, the next ones show
whether the memory is reused.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from typing import Any, Final

import h11
import httpx
import msgspec
import trio

from iop.bench._client import RawClient, admin_nodes, chat_body
from iop.bench._mock_backend import MockBackend, mock_instance, start_mock_cluster
from iop.bench._procs import Stack, rss_kb
from iop.bench._report import fmt, table
from iop.bench._runner import ReportInput, RunContext, options_argv, register
from iop.bench._steps import Step, run_step

__all__ = ["STEP", "MemoryOptions", "print_memory", "run_memory"]

MODEL: Final = "bench"  # the mock backend's


async def _open_idle_streams(
    client: RawClient, n: int, concurrency: int, nursery: trio.Nursery, timeout_s: float
) -> tuple[int, Counter[str]]:
    """Start ``n`` idle streams in ``nursery``; return once each has its first chunk."""
    limiter = trio.CapacityLimiter(concurrency)
    opened = [0]
    errors: Counter[str] = Counter()
    all_open = trio.Event()
    body = chat_body(MODEL, bench={"mode": "idle"})

    async def one() -> None:
        await limiter.acquire()
        held = [True]

        def on_head(status: int, headers: list[tuple[bytes, bytes]]) -> None:
            if status != 200:
                errors[f"HTTP {status}"] += 1

        def on_data(data: bytes) -> None:
            if held[0] and b'"content"' in data:
                held[0] = False
                limiter.release()
                opened[0] += 1
                if opened[0] + sum(errors.values()) >= n:
                    all_open.set()

        try:
            await client.post("/v1/chat/completions", body, on_head, on_data)
            errors["ended"] += 1
        except (h11.ProtocolError, trio.BrokenResourceError, OSError) as exc:
            errors[type(exc).__name__] += 1
        finally:
            if held[0]:
                limiter.release()
                if opened[0] + sum(errors.values()) >= n:
                    all_open.set()

    for _ in range(n):
        nursery.start_soon(one)
    with trio.move_on_after(timeout_s):
        await all_open.wait()
    return opened[0], errors


async def _memory(args: argparse.Namespace, stack: Stack) -> dict[str, Any]:
    backend = MockBackend(MODEL)
    n = args.streams
    big = {"first_token_timeout_s": 3600.0, "idle_timeout_s": 3600.0, "request_timeout_s": 3600.0}
    out: dict[str, Any] = {"streams": n, "rounds": []}
    async with trio.open_nursery() as nursery:
        url = await backend.start(nursery)
        instances = [mock_instance("free", url, n + 64, max_queue=64, deadlines=big)]
        edge_cfg = {"deadlines": big, "scheduler": {"max_queue": max(256, n)}}
        cl = await start_mock_cluster(stack, edge_cfg, instances, {MODEL})
        out["config"] = {"edge": edge_cfg, "instances": instances}
        out["pids"] = cl.pids()
        pids = cl.pids()

        def rss() -> dict[str, int]:
            return {k: rss_kb(p) for k, p in pids.items()}

        async with httpx.AsyncClient(timeout=30, trust_env=False) as ac:
            client = RawClient(cl.url)
            for rnd in range(args.rounds + 1):  # round 0 warms up
                warm = rnd == 0
                count = min(50, n) if warm else n
                await trio.sleep(args.settle_s)
                before = rss()
                t0 = time.perf_counter()
                async with trio.open_nursery() as streams:
                    opened, errors = await _open_idle_streams(
                        client, count, args.open_concurrency, streams, 120
                    )
                    open_s = time.perf_counter() - t0
                    await trio.sleep(args.settle_s)
                    a = await admin_nodes(ac, cl.url)
                    during = rss()
                    runs = len(a["runs"])
                    streams.cancel_scope.cancel()  # every client closes its socket
                with trio.move_on_after(60):
                    while True:
                        if not backend.open_streams and not (await admin_nodes(ac, cl.url))["runs"]:
                            break
                        await trio.sleep(0.2)
                await trio.sleep(args.settle_s)
                after = rss()
                if warm:
                    continue
                grew = {k: during[k] - before[k] for k in pids}
                kept = {k: after[k] - before[k] for k in pids}
                total_grew = sum(grew.values())
                out["rounds"].append(
                    {
                        "round": rnd,
                        "opened": opened,
                        "errors": dict(errors),
                        "edge_runs_while_open": runs,
                        "open_s": round(open_s, 2),
                        "rss_kb": {"before": before, "open": during, "after": after},
                        "kb_per_stream": {k: round(v / opened, 1) for k, v in grew.items()}
                        | {"edge+node": round(total_grew / opened, 1)},
                        "returned_pct": {
                            k: round(100 * (during[k] - after[k]) / grew[k], 1) if grew[k] else None
                            for k in pids
                        }
                        | {
                            "edge+node": round(
                                100 * (total_grew - sum(kept.values())) / total_grew, 1
                            )
                            if total_grew
                            else None
                        },
                    }
                )
                r = out["rounds"][-1]
                print(
                    f"bench: memory round {rnd}: {opened} open, {r['kb_per_stream']} KB per "
                    f"stream, returned {r['returned_pct']} %",
                    flush=True,
                )
        nursery.cancel_scope.cancel()
    out["backend_errors"] = dict(backend.errors)
    return out


def run_memory(args: argparse.Namespace, stack: Stack) -> dict[str, Any]:
    return trio.run(_memory, args, stack)


def print_memory(res: dict[str, Any]) -> None:
    print(f"\nmemory: {res['streams']} idle streams, RSS (KiB) of edge and node")
    print(
        f"{'round':>6}{'opened':>8}{'edge before/open/after':>26}{'node before/open/after':>26}"
        f"{'KB/stream e/n/e+n':>22}{'returned % e+n':>16}"
    )
    for r in res["rounds"]:
        rk, kb = r["rss_kb"], r["kb_per_stream"]

        def col(k: str, rk: dict[str, Any] = rk) -> str:
            return f"{rk['before'][k]}/{rk['open'][k]}/{rk['after'][k]}"

        print(
            f"{r['round']:>6}{r['opened']:>8}{col('edge'):>26}{col('node'):>26}"
            f"{kb['edge']:>8.1f}/{kb['node']:.1f}/{kb['edge+node']:<6.1f}"
            f"{r['returned_pct']['edge+node']!s:>14}"
        )


# --------------------------------------------------------------------------- options


def add_arguments(g: argparse._ArgumentGroup) -> None:
    d = MemoryOptions()  # the defaults are the runner's: one copy
    g.add_argument(
        "--streams", type=int, default=d.streams, help="idle streams (default: %(default)s)"
    )
    g.add_argument(
        "--rounds", type=int, default=d.rounds, help="open/close rounds (default: %(default)s)"
    )
    g.add_argument(
        "--open-concurrency",
        type=int,
        default=d.open_concurrency,
        help="streams being opened at once (default: %(default)s)",
    )
    g.add_argument(
        "--settle-s",
        type=float,
        default=d.settle_s,
        help="wait before each RSS sample (default: %(default)s)",
    )


def check(args: argparse.Namespace, ap: argparse.ArgumentParser) -> None:
    if not 1 <= args.streams <= 20_000 or not 1 <= args.rounds <= 10:
        ap.error("--streams must be within 1..20000 and --rounds within 1..10")


STEP: Final = Step("memory", "about 50 s", __doc__, add_arguments, run_memory, print_memory, check)


# --------------------------------------------------------------------------- iop bench


class MemoryOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The memory measurement's options (idle streams held open)."""

    streams: int = 1000
    rounds: int = 1
    open_concurrency: int = 64
    settle_s: float = 3.0


def _memory_report(r: ReportInput) -> dict[str, str]:
    res = r.median
    rows = []
    for rd in res["rounds"]:
        rk, kb = rd["rss_kb"], rd["kb_per_stream"]
        rows.append(
            [
                str(rd["round"]),
                str(rd["opened"]),
                f"{rk['before']['edge']:,} / {rk['open']['edge']:,} / {rk['after']['edge']:,}",
                f"{rk['before']['node']:,} / {rk['open']['node']:,} / {rk['after']['node']:,}",
                f"{fmt(kb['edge'])} / {fmt(kb['node'])} / **{fmt(kb['edge+node'])}**",
                fmt(rd["returned_pct"]["edge+node"], 0),
            ]
        )
    head = [
        "round",
        "streams open",
        "edge RSS KiB before / open / after",
        "node RSS KiB",
        "KiB per stream edge / node / both",
        "returned after the close, %",
    ]
    text = table(head, rows)
    return {r.scenario: f"{text}\n\n{r.footer}"}


@register(
    "memory",
    MemoryOptions,
    "RSS of edge and node with N idle streams open, and after they close",
    report=_memory_report,
)
def run(opts: MemoryOptions, ctx: RunContext) -> dict[str, Any]:
    if ctx.smoke:
        opts = msgspec.structs.replace(opts, streams=5, rounds=1, open_concurrency=5, settle_s=0.2)
    return run_step(STEP, options_argv(opts), ctx)
