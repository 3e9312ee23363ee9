"""Chaos: nodes killed, frozen and restarted at random under a bounded load.

One edge and four nodes, each with a simulated backend of its own speed (time
to first token, token rate) and capacity (``max_concurrency``,
``max_queue``): three run the sim in-process (``adapter = "sim"``), one
speaks vLLM's wire format to an ``iop sim`` process of its own, so the node's
HTTP pool to a backend is in the fault path too. A fixed number of client
requests (streaming, non-streaming, and streams the client hangs up on after
a few chunks) runs at a fixed concurrency while a chaos driver, from a seeded
RNG, kills (SIGKILL) and restarts nodes and freezes (SIGSTOP) and thaws
(SIGCONT) them: a fixed number of events, each fired when the load has
reached a point (requests finished), not at a wall-clock time.

The seed is ``IOP_CHAOS_SEED`` (default ``DEFAULT_SEED``); every failure
message starts with it, so a failing run is replayed with
``IOP_CHAOS_SEED=<seed> pytest tests/e2e/test_chaos.py``. The schedule of
events and the requests are the same for a seed; which run a kill catches
depends on the machine's timing, so a seed does not replay byte for byte,
and no assertion depends on which it catches.

What every run must show (docs/operations.md, "The chaos test"):

* every request ends with exactly one terminal outcome as its client saw it
  (a finish reason or one error, then ``[DONE]`` for a stream; one status and
  body otherwise; or the client's own hang-up), and the edge recorded the
  matching outcome for its run;
* no client waits past its own bound, computed from the configured
  deadlines and the attempts its run made (a hang check, not a latency
  assertion: the bound is the worst case the deadlines allow plus a slack
  for a loaded machine);
* failover happens only before first output: a run with more than one
  placement had its first output after its last placement, and everything
  a client received came from one attempt (each node's sim has its own
  seed, so its text is its signature: the client's text is a prefix of the
  script of the node that ran the run's last attempt);
* once the chaos stops and every node is back, the edge has no run and
  nothing queued, its task, socket and fd counts and each node's fds are
  back to where they were before the load, the ``iop sim`` backend has
  nothing open, and every killed node process was reaped.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

import httpx
import pytest

from iop.config import SimConfig
from iop.sim._script import build_script
from iop.sim._vllm_wire import parse_chat_request
from iop.testing import NODE_READY, ClientStream, Proc, StreamEnd, count_terminals, toml_dumps
from iop.testing._platform import _fds
from tests.e2e._platform import MODEL, TOKEN, Edge, Procs, Sim, poll

pytestmark = pytest.mark.slow

SEED_ENV: Final = "IOP_CHAOS_SEED"
DEFAULT_SEED: Final = 20261201
SEED: Final = int(os.environ.get(SEED_ENV, DEFAULT_SEED))

# --- deadlines: short, so that a lost node or a stuck run ends within seconds ---------
HEARTBEAT_INTERVAL_S: Final = 0.2
HEARTBEAT_TIMEOUT_S: Final = 0.6
FIRST_TOKEN_TIMEOUT_S: Final = 2.5
IDLE_TIMEOUT_S: Final = 1.5
REQUEST_TIMEOUT_S: Final = 12.0
QUEUE_TIMEOUT_S: Final = 1.5
KEEPALIVE_S: Final = 0.3
# iop/edge/runs/_executor.py MAX_ATTEMPTS: the first try and two failovers.
MAX_ATTEMPTS: Final = 3
# The hang check's slack over the worst case the deadlines allow: process
# scheduling on a loaded 2-core machine, the edge's connect and body read.
HANG_SLACK_S: Final = 5.0

# --- the load -------------------------------------------------------------------------
REQUESTS: Final = 48
CONCURRENCY: Final = 6
OUTPUT_TOKENS: Final = (4, 12, 30)
# --- the chaos ------------------------------------------------------------------------
EVENTS: Final = 8
# A freeze shorter than this is a "blip": thawed before the edge can tell.
BLIP_S: Final = 0.1
# How long a recovery (restart, reconnect, release) may take on a loaded machine.
SETTLE_S: Final = 20.0


@dataclass(frozen=True)
class NodeSpec:
    node_id: str
    ttft_s: float
    tokens_per_s: float
    max_concurrency: int
    max_queue: int
    seed: int  # the sim's: the node's signature in the text it writes
    http: bool = False  # a vllm instance on an `iop sim` process of its own


NODES: Final = (
    NodeSpec("fast", ttft_s=0.05, tokens_per_s=200.0, max_concurrency=3, max_queue=2, seed=101),
    NodeSpec("mid", ttft_s=0.3, tokens_per_s=60.0, max_concurrency=2, max_queue=1, seed=102),
    NodeSpec("slow", ttft_s=0.8, tokens_per_s=30.0, max_concurrency=1, max_queue=0, seed=103),
    NodeSpec(
        "http", ttft_s=0.15, tokens_per_s=100.0, max_concurrency=2, max_queue=1, seed=104, http=True
    ),
)
SLOWEST_RATE: Final = min(n.tokens_per_s for n in NODES)

DEADLINES: Final = {
    "first_token_timeout_s": FIRST_TOKEN_TIMEOUT_S,
    "idle_timeout_s": IDLE_TIMEOUT_S,
    "request_timeout_s": REQUEST_TIMEOUT_S,
}
EDGE_CONFIG: Final = {
    "server": {"keepalive_interval_s": KEEPALIVE_S, "drain_timeout_s": 1.0},
    "link": {
        "heartbeat_interval_s": HEARTBEAT_INTERVAL_S,
        "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S,
    },
    "scheduler": {"queue_timeout_s": QUEUE_TIMEOUT_S, "max_queue": 64, "failover": True},
    "deadlines": DEADLINES,
}


def fail(message: str) -> None:
    pytest.fail(f"{SEED_ENV}={SEED}: {message}", pytrace=False)


# --- the nodes ------------------------------------------------------------------------


class ChaosNode:
    """One node id: its current process, restarted as a new one after a kill."""

    def __init__(self, spec: NodeSpec, edge: Edge, procs: Procs, backend: Sim | None) -> None:
        self.spec = spec
        self.edge = edge
        self.procs = procs
        self.log_dir = procs.log_dir
        self.generation = 0
        self.frozen = False
        self.killed: list[Proc] = []
        self.backend_port = None if backend is None else urlsplit(backend.url).port
        instance: dict[str, Any] = {
            "name": spec.node_id,
            "max_concurrency": spec.max_concurrency,
            "max_queue": spec.max_queue,
            "queue_timeout_s": QUEUE_TIMEOUT_S,
            "deadlines": DEADLINES,
        }
        if backend is None:
            sim = {"ttft_s": spec.ttft_s, "tokens_per_s": spec.tokens_per_s, "seed": spec.seed}
            instance.update(adapter="sim", sim=sim)
        else:
            instance.update(adapter="vllm", endpoint=backend.url)
        config = {
            "node": {
                "id": spec.node_id,
                "reconnect_min_s": 0.05,
                "reconnect_max_s": 0.3,
                "drain_timeout_s": 1.0,
                "edges": [{"url": edge.link_url, "token": TOKEN}],
            },
            "instances": [instance],
        }
        self.config_path = self.log_dir / f"{spec.node_id}.toml"
        self.config_path.write_text(toml_dumps(config))
        self.proc = self._start()
        self.ready()

    def _start(self) -> Proc:
        """Start the node's next process (not waiting for it: see ``ready``)."""
        self.generation += 1
        proc = Proc(
            f"{self.spec.node_id}-{self.generation}",
            ["node", "--config", str(self.config_path)],
            self.log_dir,
        )
        self.procs.adopt(proc)
        return proc

    def ready(self) -> None:
        """Wait for the current process's start-up line."""
        self.proc.wait_stdout(NODE_READY)

    @property
    def up(self) -> bool:
        return self.proc.alive and not self.frozen

    def kill(self) -> None:
        self.proc.kill()
        self.frozen = False
        self.killed.append(self.proc)

    def restart(self) -> None:
        # Not waited for: the load goes on while the node starts, as in life.
        self.proc = self._start()

    def freeze(self) -> None:
        self.proc.send(signal.SIGSTOP)
        self.frozen = True

    def thaw(self) -> None:
        self.proc.send(signal.SIGCONT)
        self.frozen = False

    def restore(self) -> None:
        if self.frozen:
            self.thaw()
        elif not self.proc.alive:
            self.restart()

    def fds(self) -> int:
        """Open fds of the current process, its idle pool to the backend left out."""
        return _fds(self.proc.pid, exclude_peer_port=self.backend_port)

    def gone(self) -> bool:
        """The edge no longer lists this node."""
        return all(n["id"] != self.spec.node_id for n in admin(self.edge)["nodes"])


# --- the clients ----------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """One client request, drawn from the seed."""

    index: int
    kind: str  # "stream", "hangup" (after hang_after content chunks) or "json"
    output_tokens: int
    hang_after: int = 0

    def body(self) -> dict[str, Any]:
        return {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"Chaos request {self.index}: go."}],
            "stream": self.kind != "json",
            "iop_sim": {"output_tokens": self.output_tokens},
        }


@dataclass
class Outcome:
    """What one client saw."""

    plan: Plan
    stream: ClientStream
    elapsed_s: float = 0.0
    overran: bool = False  # the client gave up at its hang bound
    run_id: str | None = None
    attempts: int = 1
    timeline: dict[str, Any] = field(default_factory=dict)

    @property
    def text(self) -> str:
        """The content received: the deltas of a stream, a completion's message."""
        if self.stream.sse:
            return self.stream.text
        event = self.stream.events[0] if self.stream.events else {}
        choices = event.get("choices") or [{}] if isinstance(event, dict) else [{}]
        return str((choices[0].get("message") or {}).get("content") or "")

    @property
    def terminal(self) -> str:
        n, names = count_terminals(self.stream)
        return names[0] if n == 1 else f"{n} terminals: {names}"


def hang_bound(plan: Plan, attempts: int) -> float:
    """The longest a request may take before it is a hang.

    Each attempt may wait for a slot (``queue_timeout_s``) and then for its
    first output (``first_token_timeout_s``; a frozen node is found out
    sooner, by ``heartbeat_timeout_s``); after the first output the answer
    streams at the slowest node's rate, each gap under ``idle_timeout_s``;
    ``request_timeout_s`` caps the whole run. Not a latency assertion: a
    request that ends anywhere under this bound is fine.
    """
    per_attempt = QUEUE_TIMEOUT_S + FIRST_TOKEN_TIMEOUT_S + HEARTBEAT_TIMEOUT_S
    output = plan.output_tokens / SLOWEST_RATE + IDLE_TIMEOUT_S
    return min(REQUEST_TIMEOUT_S, attempts * per_attempt + output) + HANG_SLACK_S


# The longest any request may take (three attempts): the client's own timeout.
CLIENT_BOUND_S: Final = max(hang_bound(Plan(0, "json", max(OUTPUT_TOKENS)), MAX_ATTEMPTS), 1.0)


def run_client(edge: Edge, plan: Plan) -> Outcome:
    """Send ``plan``'s request and read the answer, giving up at ``CLIENT_BOUND_S``."""
    stream = ClientStream(started_at=time.monotonic())
    out = Outcome(plan, stream)
    give_up = stream.started_at + CLIENT_BOUND_S
    hang_after = plan.hang_after if plan.kind == "hangup" else None
    timeout = httpx.Timeout(CLIENT_BOUND_S)
    with httpx.Client(timeout=timeout, trust_env=False) as client:
        try:
            with client.stream("POST", f"{edge.url}/v1/chat/completions", json=plan.body()) as resp:
                stream.status = resp.status_code
                if not resp.headers.get("content-type", "").startswith("text/event-stream"):
                    stream.feed_body(resp.read())
                else:
                    for data in resp.iter_raw():
                        if stream.take(data, hang_after, at=time.monotonic()):
                            break
                        if time.monotonic() > give_up:
                            out.overran = True
                            break
        except httpx.TimeoutException as exc:
            out.overran = True
            stream.finish(StreamEnd.TRANSPORT_ERROR, at=time.monotonic(), error=repr(exc))
        except httpx.TransportError as exc:
            stream.finish(StreamEnd.TRANSPORT_ERROR, at=time.monotonic(), error=repr(exc))
    stream.finish(StreamEnd.CLOSED, at=time.monotonic())
    out.elapsed_s = (stream.ended_at or time.monotonic()) - stream.started_at
    ids = {e.get("id") for e in stream.events if isinstance(e, dict) and "id" in e}
    ids.discard(None)
    if len(ids) == 1:
        out.run_id = str(ids.pop()).removeprefix("chatcmpl-")
    return out


def expected_text(plan: Plan, spec: NodeSpec) -> str:
    """What ``spec``'s sim answers to ``plan`` (a pure function of the two)."""
    request = parse_chat_request(json.dumps(plan.body()).encode())
    config = SimConfig(
        ttft_s=spec.ttft_s,
        tokens_per_s=spec.tokens_per_s,
        seed=spec.seed,
        output_tokens=plan.output_tokens,
    )
    return build_script(request, config).content


# --- the chaos driver -----------------------------------------------------------------


@dataclass
class Progress:
    """Requests finished so far, for the driver to fire its events by."""

    done: int = 0
    all_done: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def finished(self) -> None:
        with self.lock:
            self.done += 1

    def wait(self, at_least: int, timeout: float = SETTLE_S) -> None:
        poll(
            lambda: self.all_done or self.done >= at_least,
            timeout=timeout,
            what=f"{at_least} requests to finish",
        )


@dataclass
class ChaosLog:
    events: list[str] = field(default_factory=list)
    kills: int = 0
    freezes: int = 0
    detected: int = 0  # freezes the edge found out (the node left its list)


def drive_chaos(
    rng: random.Random, nodes: list[ChaosNode], progress: Progress, log: ChaosLog
) -> None:
    """``EVENTS`` events, each on a random node while at least one other is up.

    Event i fires once ``i * REQUESTS / (EVENTS + 1)`` requests have finished.
    It kills the node (restarted after ``hold`` more requests finish) or
    freezes it: a blip (thawed after ``BLIP_S``, before the edge can tell), or
    until the edge drops the node (then thawed after ``hold`` more requests).
    A restore is sometimes put off until after the next event, so two nodes
    are down at once.
    """
    pending: list[ChaosNode] = []
    for i in range(1, EVENTS + 1):
        progress.wait(i * REQUESTS // (EVENTS + 1))
        up = [n for n in nodes if n.up]
        if len(up) < 2:
            for n in pending:
                n.restore()
            pending.clear()
            up = [n for n in nodes if n.up]
        victim = rng.choice(up)
        action = rng.choices(("kill", "freeze", "blip"), weights=(2, 2, 1))[0]
        hold = rng.randint(1, 4)
        defer = rng.random() < 0.3
        log.events.append(
            f"#{i} at {progress.done} done: {action} {victim.spec.node_id}"
            f" (hold {hold}{', deferred' if defer else ''})"
        )
        if action == "blip":
            victim.freeze()
            time.sleep(BLIP_S)  # the point of a blip is its brevity: shorter than the timeout
            victim.thaw()
            log.freezes += 1
            continue
        if action == "kill":
            victim.kill()
            log.kills += 1
        else:
            victim.freeze()
            log.freezes += 1
            poll(
                partial(ChaosNode.gone, victim),
                timeout=SETTLE_S,
                what=f"the edge to drop frozen node {victim.spec.node_id}",
            )
            log.detected += 1
        for n in pending:
            n.restore()
        pending.clear()
        progress.wait(progress.done + hold)
        if defer:
            pending.append(victim)
        else:
            victim.restore()
    for n in pending:
        n.restore()


# --- the edge's counts ----------------------------------------------------------------


def fd_links(pid: int) -> list[str]:
    fd_dir = Path(f"/proc/{pid}/fd")
    links = []
    for name in os.listdir(fd_dir):
        try:
            links.append(os.readlink(fd_dir / name))
        except FileNotFoundError:
            continue  # closed while listed
    return links


def admin_get(edge: Edge, path: str) -> dict[str, Any]:
    """An admin JSON page on a connection of its own, closed after the answer:
    no connection of the test's lingers in the edge's counts."""
    resp = httpx.get(
        f"{edge.url}{path}", headers={"Connection": "close"}, timeout=5.0, trust_env=False
    )
    resp.raise_for_status()
    data: dict[str, Any] = resp.json()
    return data


def admin(edge: Edge) -> dict[str, Any]:
    return admin_get(edge, "/admin/nodes")


def counts(edge: Edge) -> dict[str, int]:
    """The edge's live trio tasks, open fds and sockets (the fds first: the
    admin request opens a connection, which the task count includes)."""
    links = fd_links(edge.proc.pid)
    return {
        "fds": len(links),
        "sockets": sum(link.startswith("socket:") for link in links),
        "tasks": int(admin(edge)["tasks"]),
    }


def steady_counts(edge: Edge) -> dict[str, int]:
    """The counts once three looks in a row agree (the last admin request's
    connection closed, nothing else in flight)."""
    seen: list[dict[str, int]] = []

    def steady() -> dict[str, int] | None:
        seen.append(counts(edge))
        return seen[-1] if len(seen) >= 3 and seen[-1] == seen[-2] == seen[-3] else None

    return poll(steady, timeout=SETTLE_S, what="the edge's counts to hold still")


def settle(edge: Edge, nodes: list[ChaosNode]) -> None:
    """Every node listed, no run on the edge, nothing queued."""

    def quiet() -> bool:
        a = admin(edge)
        listed = {n["id"] for n in a["nodes"]}
        return (
            listed == {n.spec.node_id for n in nodes}
            and a["runs"] == []
            and all(n["runs"] == [] for n in a["nodes"])
            and a["queued"] == 0
            and all(i["in_flight"] == 0 for n in a["nodes"] for i in n["instances"])
        )

    poll(quiet, timeout=SETTLE_S, what="every node back and no run left on the edge")


def warm_up(edge: Edge) -> None:
    """One of each kind of request on every node, so that what the edge opens
    on first use is in the baseline."""
    plans = [Plan(-1 - i, kind, 4, 1) for i, kind in enumerate(["stream", "json", "hangup"] * 4)]
    threads = [threading.Thread(target=run_client, args=(edge, p)) for p in plans]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


# --- the test -------------------------------------------------------------------------


def check_outcome(out: Outcome, by_id: dict[str, NodeSpec]) -> list[str]:
    """Everything one client saw, against the run's timeline; the problems found."""
    problems: list[str] = []
    plan, stream = out.plan, out.stream
    where = f"request {plan.index} ({plan.kind}, {plan.output_tokens} tokens, run {out.run_id})"
    bound = hang_bound(plan, out.attempts)
    if out.overran or out.elapsed_s > bound:
        problems.append(f"{where}: waited {out.elapsed_s:.1f} s, past its bound of {bound:.1f} s")
    n, names = count_terminals(stream)
    hung_up = stream.end is StreamEnd.HUNG_UP
    if hung_up:
        if n > 1:
            problems.append(f"{where}: hung up, but saw {names}")
    elif n != 1:
        problems.append(f"{where}: {n} terminal events {names}: {stream.describe()}")
    elif stream.sse and not stream.done:
        problems.append(f"{where}: terminal {names[0]} without [DONE]: {stream.describe()}")
    elif stream.end is not StreamEnd.CLOSED:
        problems.append(f"{where}: ended {stream.end.value}: {stream.describe()}")
    if out.run_id is None:
        if stream.sse and stream.status == 200:
            problems.append(f"{where}: a stream without a run id: {stream.describe()}")
        return problems
    tl = out.timeline
    placements = tl.get("placements") or []
    outcome = tl.get("outcome") or ""
    # The edge's outcome matches what the client saw.
    if not hung_up and n == 1:
        name = names[0]
        if name.startswith("finish_reason="):
            want = "complete:" + name.removeprefix("finish_reason=")
            if outcome != want:
                problems.append(f"{where}: client saw {name}, the edge recorded {outcome}")
        elif not outcome.endswith(":" + name.removeprefix("error=")):
            problems.append(f"{where}: client saw {name}, the edge recorded {outcome}")
    elif hung_up and not (outcome.startswith("complete:") or outcome.startswith("cancelled:")):
        problems.append(f"{where}: the client hung up, the edge recorded {outcome}")
    # Failover only before first output.
    first = tl.get("first_output_ms")
    if len(placements) > 1:
        if first is not None and first < placements[-1]["at_ms"]:
            problems.append(
                f"{where}: first output at {first} ms, before its last attempt "
                f"at {placements[-1]['at_ms']} ms: {placements}"
            )
        for p in placements[:-1]:
            if not str(p.get("result")).startswith(("retry:", "lost:")):
                problems.append(f"{where}: attempt {p['attempt']} left as {p.get('result')}")
    # Everything the client received came from the last attempt's node.
    text = out.text
    if text:
        if not placements:
            problems.append(f"{where}: content but no placement: {tl}")
        else:
            spec = by_id[placements[-1]["node"]]
            want = expected_text(plan, spec)
            complete = n == 1 and names[0].startswith("finish_reason=")
            ok = text == want if complete else want.startswith(text)
            if not ok:
                others = [s.node_id for s in NODES if expected_text(plan, s).startswith(text)]
                problems.append(
                    f"{where}: text {text!r} is not node {spec.node_id}'s "
                    f"{want!r} (a prefix of: {others or 'no node'}); placements {placements}"
                )
    return problems


def test_chaos(procs: Procs) -> None:
    print(f"\n{SEED_ENV}={SEED}")
    rng = random.Random(SEED)
    started = time.monotonic()
    edge = procs.edge(EDGE_CONFIG)
    by_id = {s.node_id: s for s in NODES}
    nodes: list[ChaosNode] = []
    for spec in NODES:
        backend = None
        if spec.http:
            backend = procs.sim(
                f"sim-{spec.node_id}",
                "--ttft",
                str(spec.ttft_s),
                "--tokens-per-s",
                str(spec.tokens_per_s),
                "--seed",
                str(spec.seed),
            )
        nodes.append(ChaosNode(spec, edge, procs, backend))
    sims = [s for s in procs._closers if isinstance(s, Sim)]
    for n in nodes:
        edge.wait_ready(node_id=n.spec.node_id)
    edge.close()  # its keep-alive connection would be in the baseline, not at the end
    warm_up(edge)
    settle(edge, nodes)
    before = steady_counts(edge)
    node_fds = {n.spec.node_id: n.fds() for n in nodes}
    outcomes_before = admin(edge)["outcomes"]

    plans = []
    for i in range(REQUESTS):
        kind = rng.choices(("stream", "hangup", "json"), weights=(5, 2, 3))[0]
        plans.append(Plan(i, kind, rng.choice(OUTPUT_TOKENS), rng.randint(1, 3)))
    todo = list(reversed(plans))
    results: list[Outcome] = []
    lock = threading.Lock()
    progress = Progress()
    chaos = ChaosLog()
    errors: list[BaseException] = []

    def worker() -> None:
        while True:
            with lock:
                if not todo:
                    return
                plan = todo.pop()
            try:
                out = run_client(edge, plan)
            except BaseException as exc:
                errors.append(exc)
                raise
            with lock:
                results.append(out)
            progress.finished()

    def driver() -> None:
        try:
            drive_chaos(random.Random(rng.random()), nodes, progress, chaos)
        except BaseException as exc:
            errors.append(exc)
            raise

    clients = [threading.Thread(target=worker, name=f"client-{i}") for i in range(CONCURRENCY)]
    chaos_thread = threading.Thread(target=driver, name="chaos")
    chaos_thread.start()
    for t in clients:
        t.start()
    for t in clients:
        t.join(REQUESTS * CLIENT_BOUND_S)
    progress.all_done = True
    chaos_thread.join(SETTLE_S * (EVENTS + 1))
    load_s = time.monotonic() - started
    print("\n".join(chaos.events))
    if errors:
        fail(f"a client or the chaos driver failed: {errors!r}")
    assert len(results) == REQUESTS
    for n in nodes:
        n.restore()
    for n in nodes:
        n.ready()
    settle(edge, nodes)

    # Every run as its client saw it and as the edge recorded it: the list of
    # runs has each one's outcome, first output and last node; a run that
    # failed over is read whole, for its placements.
    recent = {r["run_id"]: r for r in admin_get(edge, "/admin/runs?limit=1000")["recent"]}
    for out in results:
        summary = recent.get(out.run_id or "")
        if summary is None:
            continue
        if summary["attempts"] > 1:
            out.timeline = admin_get(edge, f"/admin/runs/{out.run_id}")
        else:
            one = [{"attempt": 1, "node": summary["node"]}] if summary["attempts"] else []
            out.timeline = {**summary, "placements": one}
        out.attempts = max(1, len(out.timeline["placements"]))
    problems = [
        p for out in sorted(results, key=lambda o: o.plan.index) for p in check_outcome(out, by_id)
    ]
    missing = [o.plan.index for o in results if o.run_id is not None and not o.timeline]
    if missing:
        problems.append(f"no timeline on the edge for requests {missing}")
    ended = {
        k: v - outcomes_before.get(k, 0)
        for k, v in admin(edge)["outcomes"].items()
        if v != outcomes_before.get(k, 0)
    }
    # The edge's counters, by kind, against the runs the clients saw. A JSON
    # error carries no run id: its code must match a counted run's reason or
    # code (the edge counts a lost run "cancelled:node_lost", the client
    # reads code node_lost).
    expected: dict[str, int] = {}
    unnamed: list[str] = []
    for out in results:
        if out.timeline:
            kind, _, detail = str(out.timeline.get("outcome")).partition(":")
            key = kind if kind == "complete" else f"{kind}:{detail}"
            expected[key] = expected.get(key, 0) + 1
        else:
            unnamed.append(str((out.stream.errors or [{}])[0].get("code")))
    rest = {k: v - expected.get(k, 0) for k, v in ended.items()}
    for code in unnamed:
        key = next((k for k, v in rest.items() if v > 0 and k.partition(":")[2] == code), None)
        if key is not None:
            rest[key] -= 1
    if any(rest.values()) or sum(ended.values()) != REQUESTS:
        problems.append(
            f"{REQUESTS} requests: runs ending {expected} and errors without a run id "
            f"{unnamed}, but the edge counted {ended}"
        )
    seen: dict[str, int] = {}
    for out in results:
        key = "hung_up" if out.stream.end is StreamEnd.HUNG_UP else out.terminal
        seen[key] = seen.get(key, 0) + 1
    print(f"clients saw {seen}; the edge counted {ended}")
    failovers = sum(1 for o in results if o.attempts > 1)
    ran_on: dict[str, int] = {}
    for o in results:
        for p in o.timeline.get("placements") or ():
            ran_on[p["node"]] = ran_on.get(p["node"], 0) + 1
    print(f"placements by node: {ran_on}")
    worst = max(results, key=lambda o: o.elapsed_s / hang_bound(o.plan, o.attempts))
    print(
        f"mean request {sum(o.elapsed_s for o in results) / len(results):.2f} s; closest to "
        f"its bound: request {worst.plan.index}, {worst.elapsed_s:.2f} of "
        f"{hang_bound(worst.plan, worst.attempts):.2f} s ({worst.terminal})"
    )
    print(
        f"{chaos.kills} kills, {chaos.freezes} freezes ({chaos.detected} detected), "
        f"{failovers} runs failed over; load and chaos took {load_s:.1f} s"
    )

    # Nothing left over: every killed process reaped, the edge's counts back.
    for n in nodes:
        for proc in n.killed:
            if proc.alive or proc.returncode != -signal.SIGKILL:
                problems.append(f"{proc.name} was killed but not reaped ({proc.returncode})")
    left: dict[str, int] = {}

    def back() -> bool:
        left.update(counts(edge))
        return left == before

    try:
        poll(back, timeout=SETTLE_S, what="the edge's counts to return")
    except AssertionError:
        problems.append(f"the edge's counts did not return: before {before}, after {left}")
    node_left: dict[str, int] = {}

    def nodes_back() -> bool:
        node_left.update({n.spec.node_id: n.fds() for n in nodes})
        return node_left == node_fds

    try:
        poll(nodes_back, timeout=SETTLE_S, what="the nodes' fds to return")
    except AssertionError:
        problems.append(f"the nodes' fds did not return: before {node_fds}, after {node_left}")
    for sim in sims:
        try:
            sim.wait_idle(SETTLE_S)
        except AssertionError:
            problems.append(f"{sim.proc.name} still answering: {sim.stats()}")
    print(f"node fds before {node_fds}, after {node_left}")
    print(f"edge counts before {before}, after {left}; took {time.monotonic() - started:.1f} s")
    if problems:
        fail(
            f"{len(problems)} problem(s):\n"
            + "\n".join(problems)
            + "\nchaos:\n"
            + "\n".join(chaos.events)
        )


def test_hang_bound_is_not_request_timeout() -> None:
    """The hang bound of a one-attempt request is set by the phase deadlines,
    not only by the total: a run stuck past them is caught."""
    plan = Plan(0, "stream", max(OUTPUT_TOKENS))
    assert hang_bound(plan, 1) < REQUEST_TIMEOUT_S + HANG_SLACK_S
