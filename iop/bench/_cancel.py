"""``cancel``: how soon a client's hang-up reaches the backend, per window of a request.

The backend is a mock OpenAI-compatible server inside this process
(``iop/bench/_mock_backend.py``: a small trio + h11 TCP server streaming
``chat.completion.chunk`` SSE, or holding its answer), so the client
closing its connection and the backend seeing its socket end are timed on
one clock (``time.perf_counter``, CLOCK_MONOTONIC, the clock of the edge's
``time.monotonic()`` too). The node has two ``openai_compat`` instances on
it: ``bench`` with free slots, and ``bench-q`` with ``max_concurrency =
1``, whose slot a held request keeps busy. For each window, ``--trials``
times: a client (h11 on a trio socket of its own) sends a request, waits
until the window is reached, waits ``--settle-ms``, and closes its socket;
the time from that ``close()`` until the backend's read of that request's
socket returns EOF (or a reset) is the sample. Windows:

  queued              the request waits in the edge's queue for bench-q's
                      one slot. No backend socket exists: the sample ends
                      at the edge's own time of the run's leaving the queue
                      (/admin/nodes ``queue.last_exit``, read --poll-ms
                      after the close), and the backend must never see the
                      request (counted as "leaked" otherwise);
  before-headers      the backend has read the request and sent nothing;
  before-first-token  the backend sent its 200 and SSE headers, no chunk;
  mid-stream          the backend sent --mid-chunks chunks and the client
                      read them all;
  non-streaming       a "stream": false request; the backend holds its
                      JSON answer.

--perf-trace records the trials with ``perf record`` (the scheduler, and
the cancel path's syscalls) on the same clock: ``scripts/trace_cancel.py``
(removed; ``git show 37c0eb9^:scripts/trace_cancel.py``) then shows where one trial's time went, and how much of each sample was
a wait for a CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

import h11
import httpx
import msgspec
import trio

from iop.bench._cancel_report import print_cancel, report
from iop.bench._client import (
    MAX_HTTP_BYTES,
    Answer,
    admin_nodes,
    chat_body,
    decode_chunk,
    next_event,
    sse_data,
    wait_edge_idle,
)
from iop.bench._mock_backend import MockBackend, mock_instance, start_mock_cluster
from iop.bench._procs import (
    LITELLM_ENV,
    READY_TIMEOUT_S,
    CpuWindow,
    Stack,
    litellm_command,
    litellm_config,
    litellm_version,
    perf_record,
)
from iop.bench._results import counter_delta, summary
from iop.bench._runner import RunContext, options_argv, register
from iop.bench._steps import Step, run_step
from iop.testing import Proc, free_port, poll

__all__ = ["STEP", "WINDOWS", "CancelOptions", "run_cancel"]

MODEL_FREE: Final = "bench"  # mock backend, free slots
MODEL_QUEUED: Final = "bench-q"  # mock backend, one slot
WINDOWS: Final = ("queued", "before-headers", "before-first-token", "mid-stream", "non-streaming")


async def _poll_until(
    client: httpx.AsyncClient, url: str, cond: Callable[[dict[str, Any]], bool], period_s: float
) -> tuple[float, dict[str, Any]]:
    """perf_counter() at the send of the first /admin/nodes poll whose answer
    meets ``cond``, and that answer."""
    while True:
        sent = time.perf_counter()
        admin = await admin_nodes(client, url)
        if cond(admin):
            return sent, admin
        await trio.sleep(period_s)


def _queue_cancels(admin: dict[str, Any]) -> int | None:
    """Runs that left the edge's queue cancelled (None: an edge that does not say)."""
    queue = admin.get("queue")
    return None if queue is None else int(queue["exits"]["cancelled"])


async def _cancel_trial(
    args: argparse.Namespace,
    poller: httpx.AsyncClient,
    url: str,
    backends: dict[str, MockBackend],
    window: str,
    tid: str,
    eof_timeout_s: float = 10.0,
) -> dict[str, Any]:
    """One close in ``window``: milliseconds from the client's close to the backend's EOF.

    The client is h11 on a trio socket of its own, so that the close is one
    ``close()`` of that socket (the FIN leaves then) at a known time. An
    httpx client closes its socket somewhere in the unwinding of its
    response, 0.5 ms after the cancel at the median and up to 2.5 ms on this
    box (measured: docs/benchmarks.md, "Cancellation"), time the old samples
    counted as the platform's.
    """
    queued = window == "queued"
    backend = backends[MODEL_QUEUED if queued else MODEL_FREE]
    mode = {"before-headers": "head", "before-first-token": "first", "mid-stream": "mid"}
    body = chat_body(
        MODEL_QUEUED if queued else MODEL_FREE,
        stream=window != "non-streaming",
        bench={"trial": tid, "mode": mode.get(window, "head"), "chunks": args.mid_chunks},
    )
    got = trio.Event()
    res: dict[str, Any] = {"window": window, "trial": tid}
    u = httpx.URL(url)
    stream = await trio.open_tcp_stream(u.host, u.port or 80)
    h = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HTTP_BYTES)
    head = h11.Request(
        method="POST",
        target="/v1/chat/completions",
        headers=[
            ("host", f"{u.host}:{u.port}"),
            ("content-type", "application/json"),
            ("content-length", str(len(body))),
        ],
    )
    await stream.send_all(h.send(head) + h.send(h11.Data(data=body)) + h.send(h11.EndOfMessage()))

    async def read() -> None:
        try:
            event = await next_event(stream, h)
            if not isinstance(event, h11.Response) or event.status_code != 200:
                res["error"] = f"HTTP {getattr(event, 'status_code', event)}"
                got.set()
                return
            a = Answer(arrival=0.0, status=200)
            while isinstance(event := await next_event(stream, h), h11.Data):
                # The load generator's SSE reading, to count content chunks.
                payloads, a.buf = sse_data(a.buf + event.data)
                for payload in payloads:
                    if payload.startswith(b"{"):
                        chunk = decode_chunk(payload)
                        if chunk.choices and chunk.choices[0].delta.content:
                            a.chunks += 1
                if a.chunks >= args.mid_chunks:
                    got.set()
            res["error"] = "the response ended in the window"
            got.set()
        except trio.ClosedResourceError:
            pass  # our own close (below)

    cancels: int | None = None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(read)
        with trio.move_on_after(10) as waiting:
            if queued:
                _, admin = await _poll_until(poller, url, lambda a: a["queued"] >= 1, 0.005)
                cancels = _queue_cancels(admin)
            else:
                await backend.trial(tid).reached.wait()
            if window == "mid-stream":
                await got.wait()
        if waiting.cancelled_caught:
            res["error"] = "window not reached within 10 s"
        elif "error" not in res:
            await trio.sleep(args.settle_ms / 1000)
        closed_at = time.perf_counter()
        stream.socket.close()
        nursery.cancel_scope.cancel()
    res["t_close"] = closed_at
    if "error" in res:
        return res
    if queued:
        with trio.move_on_after(10):
            if cancels is None:
                # An edge that does not say when its queue's runs leave: the
                # first poll that shows the queue empty (resolution: a poll
                # and its period; answering polls slows the edge down).
                gone, _ = await _poll_until(
                    poller, url, lambda a: a["queued"] == 0, args.poll_ms / 1000
                )
                res["ms"] = round(1000 * (gone - closed_at), 3)
                return res
            # No poll at once: answering one (about 1 ms of the edge's CPU)
            # would compete with the dequeue it is meant to see.
            await trio.sleep(args.poll_ms / 1000)
            seen, admin = await _poll_until(
                poller, url, lambda a: (_queue_cancels(a) or 0) > cancels, args.poll_ms / 1000
            )
            # The edge's own time of the dequeue, on the clock this process
            # shares with it (CLOCK_MONOTONIC: _check_clock); the poll only
            # says when it is known, not how precisely.
            last = admin["queue"]["last_exit"]
            res["t_end"] = last["monotonic_s"]
            res["ms"] = round(1000 * (last["monotonic_s"] - closed_at), 3)
            res["poll_ms"] = round(1000 * (seen - closed_at), 3)
            return res
        res["error"] = "still queued 10 s after the close"
        return res
    trial = backend.trial(tid)
    with trio.move_on_after(eof_timeout_s):
        await trial.closed.wait()
        res["t_end"] = trial.eof_at
        res["ms"] = round(1000 * (trial.eof_at - closed_at), 3)
        return res
    res["error"] = f"no EOF at the backend within {eof_timeout_s:g} s"
    return res


@contextlib.contextmanager
def _perf_record(args: argparse.Namespace, pids: dict[str, int]) -> Iterator[Path | None]:
    """``perf record`` of the trials with --perf-trace (``perf_record``); None without."""
    if not args.perf_trace:
        yield None
        return
    with perf_record(args.out_dir / f"stress-{args.stamp}-cancel.perf.data", pids) as data:
        yield data


def _check_clock() -> None:
    """The samples compare this process's perf_counter() with the edge's
    time.monotonic(): on Linux both are CLOCK_MONOTONIC, one clock for every
    process on the host."""
    ours = time.get_clock_info("perf_counter").implementation
    theirs = time.get_clock_info("monotonic").implementation
    if ours != theirs:
        raise SystemExit(f"bench: perf_counter ({ours}) is not the monotonic clock ({theirs})")


# LiteLLM has no queue of its own: the queued window is the edge's.
LITELLM_WINDOWS: Final = ("before-headers", "before-first-token", "mid-stream", "non-streaming")


def _start_litellm(args: argparse.Namespace, stack: Stack, backend_url: str) -> tuple[Proc, str]:
    """LiteLLM's proxy (``args.litellm``) on a free port, ready, serving ``bench``."""
    # Set up as the platform runner's (docs/benchmarks.md, "What is measured":
    # no database, one worker, offline cost map); the `bench` body key
    # reaches the backend as the OpenAI provider's extra_body.
    cfg = stack.logdir / "litellm.yaml"
    config = litellm_config(
        {MODEL_FREE: backend_url}, cancel_on_disconnect=args.litellm_cancel_on_disconnect
    )
    cfg.write_text(config)
    port = free_port()
    argv = litellm_command(args.litellm, cfg, port)
    lite = stack.launch("litellm", argv=argv, env=LITELLM_ENV)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        if not lite.alive:
            raise RuntimeError(f"litellm exited during start-up:\n{lite.logs(tail=15)}")
        try:
            with httpx.Client(base_url=url, timeout=2, trust_env=False) as c:
                if c.get("/health/liveliness").status_code != 200:
                    return False
                return MODEL_FREE in {m["id"] for m in c.get("/v1/models").json()["data"]}
        except (httpx.HTTPError, ValueError, KeyError):
            return False

    poll(ready, timeout=READY_TIMEOUT_S, what="LiteLLM to be ready", interval=0.2)
    return lite, url


def _window_summary(trials: list[dict[str, Any]], window: str) -> dict[str, Any]:
    rs = [t for t in trials if t["window"] == window]
    return {
        "ms": summary([t["ms"] for t in rs if "ms" in t]),
        "errors": dict(Counter(t["error"] for t in rs if "error" in t)),
        "samples_ms": [t.get("ms") for t in rs],
    }


async def _cancel(args: argparse.Namespace, stack: Stack) -> dict[str, Any]:
    _check_clock()
    backends = {MODEL_FREE: MockBackend(MODEL_FREE), MODEL_QUEUED: MockBackend(MODEL_QUEUED)}
    # Long enough for the held request of the queued window to outlive the run.
    long = {"idle_timeout_s": 600.0, "first_token_timeout_s": 600.0}
    out: dict[str, Any] = {}
    async with trio.open_nursery() as nursery:
        free_url = await backends[MODEL_FREE].start(nursery)
        q_url = await backends[MODEL_QUEUED].start(nursery)
        instances = [
            mock_instance("free", free_url, 64, deadlines=long),
            mock_instance("one", q_url, 1, max_queue=8, deadlines=long),
        ]
        edge_cfg = {"deadlines": long}
        cl = await start_mock_cluster(stack, edge_cfg, instances, set(backends))
        out["pids"] = cl.pids()
        lite_url = ""
        lite_windows = [w for w in args.window_list if w in LITELLM_WINDOWS]
        if args.litellm is not None and lite_windows:
            lite, lite_url = await trio.to_thread.run_sync(_start_litellm, args, stack, free_url)
            out["pids"]["litellm"] = lite.pid
            out["litellm_version"] = await trio.to_thread.run_sync(litellm_version, args.litellm)
        out["config"] = {"edge": edge_cfg, "instances": instances}
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=8)
        async with (
            httpx.AsyncClient(timeout=30, limits=limits, trust_env=False) as client,
            httpx.AsyncClient(timeout=10, trust_env=False) as poller,
        ):
            # Warm every path once, then hold bench-q's one slot for the queued window.
            for model in backends:
                for stream in (True, False):
                    r = await client.post(
                        cl.url + "/v1/chat/completions",
                        content=chat_body(model, stream=stream, bench={"mode": "complete"}),
                        headers={"Content-Type": "application/json"},
                    )
                    r.raise_for_status()
            holder_done = trio.Event()

            async def hold() -> None:
                body = chat_body(MODEL_QUEUED, bench={"trial": "holder", "mode": "holder"})
                r = await client.post(
                    cl.url + "/v1/chat/completions",
                    content=body,
                    headers={"Content-Type": "application/json"},
                )
                out["holder_status"] = r.status_code
                holder_done.set()

            nursery.start_soon(hold)
            with trio.fail_after(10):
                await backends[MODEL_QUEUED].trial("holder").reached.wait()
            o0 = (await admin_nodes(poller, cl.url))["outcomes"]
            warm = 2
            trials: list[dict[str, Any]] = []
            lite_trials: list[dict[str, Any]] = []
            pids = {"edge": cl.edge.pid, "node": cl.node.pid, "bench": os.getpid()}
            with _perf_record(args, pids) as perf:
                win = CpuWindow(cl.pids())
                for i in range(warm + args.trials):
                    # Round robin: a noisy moment of the box hits every window alike.
                    for window in args.window_list:
                        tid = f"{window}-{i}"
                        t = await _cancel_trial(args, poller, cl.url, backends, window, tid)
                        if i >= warm:
                            trials.append(t)
                        if "error" in t:
                            print(f"bench: cancel {t['trial']}: {t['error']}", file=sys.stderr)
                            await wait_edge_idle(poller, cl.url, 10)
                        # LiteLLM in the same window, right after: the same
                        # moment of the box's load (fewer trials: a window it
                        # never cancels costs the whole EOF wait).
                        if lite_url and window in lite_windows and i < 1 + args.litellm_trials:
                            t = await _cancel_trial(
                                args,
                                poller,
                                lite_url,
                                backends,
                                window,
                                f"litellm-{tid}",
                                eof_timeout_s=args.litellm_eof_s,
                            )
                            if i >= 1:
                                lite_trials.append(t)
                out["cpu"] = win.stop()
            if perf is not None:
                out["perf_trace"] = {"data": str(perf), "pids": pids}
            backends[MODEL_QUEUED].release.set()
            with trio.fail_after(10):
                await holder_done.wait()
            await trio.sleep(0.5)
            leaked = [t for t in backends[MODEL_QUEUED].trials if t.startswith("queued-")]
            out["edge_outcomes"] = counter_delta(
                (await admin_nodes(poller, cl.url))["outcomes"], o0
            )
        nursery.cancel_scope.cancel()
    out["windows"] = {}
    if lite_url:
        out["litellm"] = {
            "windows": {w: _window_summary(lite_trials, w) for w in lite_windows},
            "trials": args.litellm_trials,
            "eof_wait_s": args.litellm_eof_s,
            "cancel_on_disconnect": args.litellm_cancel_on_disconnect,
        }
    for window in args.window_list:
        rs = [t for t in trials if t["window"] == window]
        out["windows"][window] = _window_summary(trials, window)
        if window == "queued":
            # The old measure, kept to compare: the first /admin/nodes poll
            # that showed the exit (resolution: the poll period plus a poll).
            polls = [t["poll_ms"] for t in rs if "poll_ms" in t]
            out["windows"][window]["poll_ms"] = summary(polls)
    out["windows"].get("queued", {})["leaked_to_backend"] = leaked
    # Per trial, the close and the end on the host's monotonic clock
    # (perf_counter): where to look in a trace of the run (--perf-trace).
    out["trials"] = trials
    out["settings"] = {
        "trials": args.trials,
        "warmup_per_window": warm,
        "settle_ms": args.settle_ms,
        "mid_chunks": args.mid_chunks,
        "poll_ms": args.poll_ms,
    }
    out["backend_errors"] = {k: dict(b.errors) for k, b in backends.items()}
    return out


def run_cancel(args: argparse.Namespace, stack: Stack) -> dict[str, Any]:
    return trio.run(_cancel, args, stack)


# --------------------------------------------------------------------------- options


def add_arguments(g: argparse._ArgumentGroup) -> None:
    d = CancelOptions()  # the defaults are the runner's: one copy
    g.add_argument("--trials", type=int, default=d.trials, help="per window (default: %(default)s)")
    g.add_argument(
        "--windows",
        default=",".join(d.windows),
        help="windows to measure (default: %(default)s)",
    )
    g.add_argument(
        "--settle-ms",
        type=float,
        default=d.settle_ms,
        help="wait in the window before closing, so every process has handled it "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--mid-chunks",
        type=int,
        default=d.mid_chunks,
        help="chunks sent (and read by the client) before the mid-stream close "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--perf-trace",
        action="store_true",
        help="record the trials with perf (scheduler and syscalls, on the samples' clock) "
        "for scripts/trace_cancel.py (needs perf and root; removed, git show 37c0eb9^:scripts/trace_cancel.py)",
    )
    g.add_argument(
        "--poll-ms",
        type=float,
        default=d.poll_ms,
        help="queued window: /admin/nodes poll period after the close, and the wait "
        "before the first poll; the sample is the edge's own dequeue time, so this "
        "sets when it is read, not its resolution (default: %(default)s)",
    )
    g.add_argument(
        "--litellm",
        type=Path,
        default=None,
        help="LiteLLM's `litellm` executable: measure its cancellation in the same windows "
        "(but queued), in front of the same mock backend (default: IOP only)",
    )
    g.add_argument(
        "--litellm-trials",
        type=int,
        default=d.litellm_trials,
        help="LiteLLM trials per window, after one unmeasured (default: %(default)s)",
    )
    g.add_argument(
        "--litellm-eof-s",
        type=float,
        default=d.litellm_eof_s,
        help="how long a LiteLLM trial waits for the backend's EOF; a window it never "
        "cancels in counts a 'no EOF' error per trial (default: %(default)s)",
    )
    g.add_argument(
        "--litellm-cancel-on-disconnect",
        action="store_true",
        help="LiteLLM's general_settings.cancel_on_disconnect: true (default: its default)",
    )


def check(args: argparse.Namespace, ap: argparse.ArgumentParser) -> None:
    args.window_list = [w.strip() for w in args.windows.split(",") if w.strip()]
    bad = [w for w in args.window_list if w not in WINDOWS]
    if bad:
        ap.error(f"--windows: unknown {bad}; choose from {list(WINDOWS)}")
    if not 1 <= args.trials <= 1000:
        ap.error("--trials must be within 1..1000")


STEP: Final = Step("cancel", "about 15 s", __doc__, add_arguments, run_cancel, print_cancel, check)


# --------------------------------------------------------------------------- iop bench


class CancelOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The cancel measurement's options (the cancel group of ``scripts/bench_stress.py --help``).

    ``litellm``: measure LiteLLM in the same windows too, when ``--litellm``
    is given.
    """

    trials: int = 20
    windows: list[str] = msgspec.field(default_factory=lambda: list(WINDOWS))
    settle_ms: float = 20.0
    mid_chunks: int = 8
    poll_ms: float = 20.0
    litellm: bool = False
    litellm_trials: int = 5
    litellm_eof_s: float = 2.0
    litellm_cancel_on_disconnect: bool = False


@register(
    "cancel",
    CancelOptions,
    "Client hang-up -> backend EOF, per window (queued, before headers, before the first "
    "token, mid-stream, non-streaming); LiteLLM beside it with --litellm",
    report=report,
)
def run(opts: CancelOptions, ctx: RunContext) -> dict[str, Any]:
    if ctx.smoke:
        opts = msgspec.structs.replace(opts, trials=1, litellm_trials=1, litellm_eof_s=0.5)
    with_litellm = opts.litellm and ctx.litellm is not None
    opts = msgspec.structs.replace(opts, litellm=False)
    argv = [a for a in options_argv(opts) if a != "--litellm"]
    if with_litellm:
        argv += ["--litellm", str(ctx.litellm)]
    res = run_step(STEP, argv, ctx)
    res.pop("trials", None)  # per-trial clock readings: for --perf-trace, not the report
    return res
