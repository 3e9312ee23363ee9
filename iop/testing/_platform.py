"""A whole IOP platform on loopback, as real processes, for users' own tests.

``start_platform`` starts three processes with ``Proc`` (``_processes.py``),
each on free ports, each stopped by PID: a backend (the scriptable fake
backend, ``_replay_server.py``, or ``iop sim``), ``iop edge`` and ``iop node``
with one ``vllm`` instance on that backend. The ``LoopbackPlatform`` it
returns is synchronous (plain sockets and ``httpx.Client``), so it serves a
test of any kind, and has three jobs:

* **drive the backend**: ``replay`` / ``replay_stream`` queue what the fake
  backend answers to the next chat request, a transcript or a synthetic
  stream, with a ``Fault`` (stall, truncate, reset, stall before headers,
  HTTP error, paced); with ``iop sim`` a fault travels in the request
  (``Fault.sim_overrides``);
* **be a client**: ``stream_chat`` streams an answer into a ``ClientStream``
  and may hang up after N chunks or read slowly; ``slow_reader`` opens a
  socket that never reads;
* **say what happened**, from a ``mark()`` taken before: the edge's run
  outcomes (``/admin/nodes``), what the backend saw (every request and when
  its connection closed, on the machine's monotonic clock), and the
  processes' open file descriptors (``/proc``, so Linux), for the
  assertions ``assert_one_terminal``, ``assert_backend_closed_within`` and
  ``assert_no_leaks``.

Every wait has a deadline (``poll``); nothing sleeps to "wait for" a fact.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal
from urllib.parse import urlsplit

import httpx
import msgspec

from iop.testing._fake_backend import CHAT_COMPLETIONS_PATH, Reply
from iop.testing._faults import Fault, synthetic_stream
from iop.testing._processes import (
    EDGE_READY,
    NODE_READY,
    SIM_READY,
    STOP_GRACE_S,
    Proc,
    free_port,
    poll,
    toml_dumps,
)
from iop.testing._replay_server import (
    CONTROL_REQUESTS,
    CONTROL_SCRIPT,
    DEFAULT_TRANSCRIPT,
    FAKE_READY,
    RequestRecord,
    ScriptCommand,
)
from iop.testing._streams import ClientStream, StreamEnd, assert_one_terminal, chat_body
from iop.testing._transcripts import transcript_body

__all__ = [
    "FAKE_MODEL",
    "NODE_TOKEN",
    "BackendKind",
    "LoopbackPlatform",
    "PlatformMark",
    "SlowReader",
    "loopback_platform",
    "start_platform",
]

BackendKind = Literal["fake", "sim"]
FAKE_MODEL: Final = "iop-fake"
SIM_MODEL: Final = "iop-sim"
NODE_TOKEN: Final = "iop-testing-node-token"
# How long facts that follow a client's action may take to show (a run's
# outcome, a socket's close, fds released): generous for a loaded 2-core
# machine; a wait returns as soon as the fact holds.
SETTLE_TIMEOUT_S: Final = 10.0
# A look at the fake backend's records (one control request) takes well
# under this; a close stamped within the bound is seen by then.
RECORD_SLACK_S: Final = 1.0
# One read of a streamed body.
_READ_BYTES: Final = 64 * 1024
# The smallest receive buffer the kernel grants a slow reader (it clamps up).
SLOW_READER_RCVBUF: Final = 1024
# A cut-off slow reader's buffer while it drains to the close: many segments.
_DRAIN_RCVBUF: Final = 1024 * 1024
# /proc/net/tcp state of an established connection.
_TCP_ESTABLISHED: Final = "01"


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _socket_peers() -> dict[str, int]:
    """Socket inode -> remote port, for established TCP connections (Linux)."""
    peers: dict[str, int] = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and cols[3] == _TCP_ESTABLISHED:
                peers[cols[9]] = int(cols[2].rsplit(":", 1)[1], 16)
    return peers


def _fds(pid: int, exclude_peer_port: int | None = None) -> int:
    """Open file descriptors of ``pid``, leaving out sockets to ``exclude_peer_port``."""
    fd_dir = Path(f"/proc/{pid}/fd")
    try:
        names = os.listdir(fd_dir)
    except OSError:  # the process is gone
        return -1
    links = []
    for name in names:
        try:
            links.append(os.readlink(fd_dir / name))
        except OSError:
            # Closed between the listing and the read: not open any more.
            # (Counting the whole process as unknown here once made a mark
            # of -1, and every later count "a leak", on a busy machine.)
            continue
    if exclude_peer_port is None:
        return len(links)
    peers = _socket_peers()
    pooled = 0
    for link in links:
        if link.startswith("socket:[") and peers.get(link[8:-1]) == exclude_peer_port:
            pooled += 1
    return len(links) - pooled


@dataclass(frozen=True)
class PlatformMark:
    """The platform's counters at one moment; assertions count from one.

    Attributes:
        at: ``time.monotonic()`` when it was taken.
        outcomes: The edge's ended runs by outcome (``/admin/nodes``).
        fds: Open fds per process (the node's without its backend pool).
        requests: Requests the backend had received.
        sim_disconnects: ``iop sim``'s ``client_disconnects`` (sim only).
    """

    at: float
    outcomes: dict[str, int]
    fds: dict[str, int]
    requests: int
    sim_disconnects: int = 0


@dataclass
class SlowReader:
    """A streaming request on a socket that reads nothing (see ``LoopbackPlatform.slow_reader``).

    Attributes:
        sock: The client's socket.
        opened_at: ``time.monotonic()`` when the request was sent.
        cut_off: True once the edge counts a ``slow_client`` run since the
            request was sent (how the reader learns it was cut off, without
            reading: the edge's close waits behind the bytes it buffered).
        closed_by_server_at: When the socket was seen closed (EOF or RST).
    """

    sock: socket.socket
    opened_at: float
    cut_off: Callable[[], bool]
    closed_by_server_at: float | None = None

    def read_available(self) -> int:
        """Read what the kernel holds now; returns the bytes read (0 at EOF)."""
        self.sock.settimeout(0)
        total = 0
        try:
            while data := self.sock.recv(_READ_BYTES):
                total += len(data)
            self.closed_by_server_at = self.closed_by_server_at or time.monotonic()
        except BlockingIOError:
            pass
        except OSError:  # a reset
            self.closed_by_server_at = self.closed_by_server_at or time.monotonic()
        return total

    def wait_closed_by_server(self, timeout: float = SETTLE_TIMEOUT_S) -> float:
        """Wait, reading nothing, until the edge ends the run as ``slow_client``;
        then read what it had buffered until it closes the socket.

        Returns:
            When the close was seen (``time.monotonic()``).

        Raises:
            AssertionError: Not cut off, or not closed, within ``timeout`` seconds each.
        """
        poll(
            self.cut_off,
            timeout=timeout,
            what="the edge to end the slow reader's run (slow_client)",
        )

        # What the edge had written is still in its kernel's send buffer
        # behind the close, and the tiny receive window lets through a few
        # KiB per read: read without pause until the close. And open the
        # window first: with a buffer smaller than a segment, a read never
        # announces the space it frees, so the edge's kernel learns of it
        # only from its zero-window probes, whose interval can double from
        # one window to the next (0.2 s, 0.4 s, ...: a close seen 12 s after
        # the cut-off on a loaded machine, past the timeout).
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _DRAIN_RCVBUF)
        deadline = time.monotonic() + timeout
        while self.closed_by_server_at is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(
                    f"timed out after {timeout:g}s waiting for the edge to close "
                    "the slow reader's connection"
                )
            self.sock.settimeout(min(left, 0.5))
            try:
                if not self.sock.recv(_READ_BYTES):
                    self.closed_by_server_at = time.monotonic()
            except TimeoutError:
                continue
            except OSError:  # a reset
                self.closed_by_server_at = time.monotonic()
        return self.closed_by_server_at

    def close(self) -> None:
        self.sock.close()


class LoopbackPlatform:
    """Backend, edge and node as processes on loopback (see the module doc).

    Attributes:
        backend_kind: ``"fake"`` (scriptable) or ``"sim"``.
        model: The model the node serves.
        url: The edge's ``http://127.0.0.1:PORT``.
        base_url: The OpenAI API's base URL (``url + "/v1"``), for any SDK.
        backend_url: The backend's ``http://127.0.0.1:PORT``.
        procs: The processes, in start order (backend, edge, node).
        test_mark: The mark the assertions count from by default (the
            ``iop_platform`` fixture takes one as each test starts).
        started_at: ``time.time()`` when its first process started.
    """

    def __init__(
        self,
        *,
        backend_kind: BackendKind,
        model: str,
        backend: Proc,
        backend_url: str,
        control_url: str | None,
        edge: Proc,
        url: str,
        node: Proc,
        api_key: str | None,
        admin_key: str | None = None,
    ) -> None:
        self.backend_kind = backend_kind
        self.model = model
        self.backend_url = backend_url
        self._control_url = control_url
        self.url = url
        self.base_url = f"{url}/v1"
        self.api_key = api_key
        # What opens /admin* once clients have keys (a client key never does).
        self.admin_key = admin_key
        self.procs = [backend, edge, node]
        self.backend_proc, self.edge_proc, self.node_proc = backend, edge, node
        self.test_mark: PlatformMark | None = None
        self.started_at = backend.started_at

    def __repr__(self) -> str:
        return f"<LoopbackPlatform {self.backend_kind} {self.base_url} model={self.model!r}>"

    # --- the backend ----------------------------------------------------------------------

    def _control(self) -> str:
        if self._control_url is None:
            raise RuntimeError(
                "this platform's backend is iop sim: send faults in the request "
                "(extra iop_sim object, Fault.sim_overrides()) instead of scripting it"
            )
        return self._control_url

    def _script(self, cmd: ScriptCommand) -> None:
        resp = httpx.post(
            self._control() + CONTROL_SCRIPT, content=msgspec.msgpack.encode(cmd), timeout=5.0
        )
        resp.raise_for_status()

    def reset_backend(self) -> None:
        """Drop the chat replies still queued and put back the default transcript
        (the ``iop_platform`` fixture does it as each test starts)."""
        if self.backend_kind == "fake":
            self._script(ScriptCommand(reset=True))

    def script(self, *replies: Reply, default: Reply | None = None) -> None:
        """Queue raw ``Reply``s (``iop.testing.Reply``) for the next chat requests."""
        self._script(ScriptCommand(replies=list(replies), default=default))

    def replay(
        self,
        transcript: str | bytes = DEFAULT_TRANSCRIPT,
        fault: Fault | None = None,
        *,
        times: int = 1,
    ) -> None:
        """Answer the next ``times`` chat requests with a transcript and a fault.

        Args:
            transcript: A transcript's name (``iop.testing.list_transcripts()``)
                or a whole SSE body.
            fault: How the backend misbehaves (None: it does not).
            times: How many requests get this answer.
        """
        body = transcript if isinstance(transcript, bytes) else transcript_body(transcript)
        self.script(*[(fault or Fault.none()).reply(body)] * times)

    def replay_stream(self, chunks: int, fault: Fault | None = None, *, times: int = 1) -> None:
        """Answer the next chat requests with a synthetic stream of ``chunks`` content chunks."""
        self.replay(synthetic_stream(chunks, model=self.model), fault, times=times)

    def backend_requests(
        self, since: PlatformMark | None = None, path: str | None = CHAT_COMPLETIONS_PATH
    ) -> list[RequestRecord]:
        """What the fake backend received on ``path`` (every path: None) since ``since``."""
        resp = httpx.get(self._control() + CONTROL_REQUESTS, timeout=5.0)
        resp.raise_for_status()
        records = msgspec.msgpack.decode(resp.content, type=list[RequestRecord])
        start = since.requests if since is not None else 0
        return [r for r in records[start:] if path is None or r.path == path]

    def sim_stats(self) -> dict[str, Any]:
        """``iop sim``'s ``/sim/stats`` (sim backend only)."""
        resp = httpx.get(self.backend_url + "/sim/stats", timeout=5.0)
        resp.raise_for_status()
        data: dict[str, Any] = resp.json()
        return data

    def _request_count(self) -> int:
        if self.backend_kind == "sim":
            stats = self.sim_stats()
            return int(stats["requests"])
        return len(self.backend_requests(path=None))

    # --- the client -----------------------------------------------------------------------

    def _headers(self) -> dict[str, str]:
        headers = {"Connection": "close"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def _admin_headers(self) -> dict[str, str]:
        headers = {"Connection": "close"}
        if self.admin_key:
            headers["Authorization"] = f"Bearer {self.admin_key}"
        return headers

    def chat_body(
        self, prompt: str = "Hello!", *, stream: bool = True, **body: Any
    ) -> dict[str, Any]:
        """A Chat Completions body for the platform's model."""
        return chat_body(self.model, prompt, stream=stream, **body)

    def stream_chat(
        self,
        prompt: str = "Hello!",
        *,
        hang_up_after: int | None = None,
        read_delay_s: float = 0.0,
        fault: Fault | None = None,
        timeout: float = 30.0,
        **body: Any,
    ) -> ClientStream:
        """Stream one Chat Completions answer from the edge into a ``ClientStream``.

        Args:
            prompt: The user message.
            hang_up_after: Hang up (close the connection) once this many
                content chunks have arrived: a client that goes away mid-stream.
            read_delay_s: Sleep this long between two reads (a slow reader
                that does read).
            fault: With ``iop sim``: the fault, sent as its ``iop_sim`` object.
            timeout: httpx's timeouts (connect, read, write, pool).
            **body: More request fields (``stream_options``, ``max_tokens``...).
        """
        if fault is not None:
            if self.backend_kind != "sim":
                raise ValueError("with the fake backend, script the fault: replay(..., fault)")
            body = {**body, "iop_sim": {**body.get("iop_sim", {}), **fault.sim_overrides()}}
        stream = ClientStream(started_at=time.monotonic())
        with httpx.Client(timeout=timeout, trust_env=False) as client:
            try:
                with client.stream(
                    "POST",
                    self.base_url + "/chat/completions",
                    json=self.chat_body(prompt, **body),
                    headers=self._headers(),
                ) as resp:
                    stream.status = resp.status_code
                    if not resp.headers.get("content-type", "").startswith("text/event-stream"):
                        stream.feed_body(resp.read())
                    else:
                        for data in resp.iter_raw():  # as it comes (a chunk_size would buffer)
                            if stream.take(data, hang_up_after, at=time.monotonic()):
                                break
                            if read_delay_s > 0:
                                time.sleep(read_delay_s)
            except httpx.TransportError as exc:
                stream.finish(StreamEnd.TRANSPORT_ERROR, at=time.monotonic(), error=repr(exc))
        stream.finish(StreamEnd.CLOSED, at=time.monotonic())
        return stream

    def chat(self, prompt: str = "Hello!", *, timeout: float = 30.0, **body: Any) -> httpx.Response:
        """One non-streamed Chat Completions request; the edge's response."""
        return httpx.post(
            self.base_url + "/chat/completions",
            json=self.chat_body(prompt, stream=False, **body),
            headers=self._headers(),
            timeout=timeout,
            trust_env=False,
        )

    def slow_reader(
        self,
        prompt: str = "Tell me a long story.",
        *,
        rcvbuf: int = SLOW_READER_RCVBUF,
        **body: Any,
    ) -> SlowReader:
        """Send a streaming request on a socket with a tiny receive buffer that never reads.

        The edge's ``server.write_stall_timeout_s`` must end the run as
        ``slow_client`` and close the socket (``SlowReader.wait_closed_by_server``);
        the answer must be longer than the socket buffers hold
        (``replay_stream(20_000)``, or ``iop_sim={"output_tokens": 20_000}``).
        """
        url = urlsplit(self.url)
        assert url.hostname is not None
        assert url.port is not None
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        # Before connect, so the advertised window is small from the start.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        mark = self.mark()
        sock.settimeout(10)
        sock.connect((url.hostname, url.port))
        payload = json.dumps(self.chat_body(prompt, **body)).encode()
        auth = f"Authorization: Bearer {self.api_key}\r\n" if self.api_key else ""
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: iop\r\n"
            b"Content-Type: application/json\r\n"
            + f"{auth}Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        return SlowReader(
            sock, time.monotonic(), lambda: "cancelled:slow_client" in self.outcomes_since(mark)
        )

    # --- the edge -------------------------------------------------------------------------

    def admin(self) -> dict[str, Any]:
        """The edge's ``/admin/nodes`` (nodes, runs, outcomes)."""
        resp = httpx.get(
            self.url + "/admin/nodes", headers=self._admin_headers(), timeout=5.0, trust_env=False
        )
        resp.raise_for_status()
        data: dict[str, Any] = resp.json()
        return data

    def outcomes(self) -> dict[str, int]:
        """The edge's ended runs by outcome: ``complete``, ``error:<code>``, ``cancelled:<reason>``."""
        return {k: int(v) for k, v in self.admin()["outcomes"].items()}

    def fd_counts(self) -> dict[str, int]:
        """Open fds of the edge and the node (the node's backend pool left out)."""
        port = urlsplit(self.backend_url).port
        return {
            "edge": _fds(self.edge_proc.pid),
            "node": _fds(self.node_proc.pid, exclude_peer_port=port),
        }

    def mark(self) -> PlatformMark:
        """The counters now, for the assertions to count from."""
        # The fds first: the admin requests below open (and close) a
        # connection to the edge each, which must not be in the baseline.
        fds = self.fd_counts()
        disconnects = 0
        if self.backend_kind == "sim":
            disconnects = int(self.sim_stats()["client_disconnects"])
        return PlatformMark(
            at=time.monotonic(),
            outcomes=self.outcomes(),
            fds=fds,
            requests=self._request_count(),
            sim_disconnects=disconnects,
        )

    def outcomes_since(self, since: PlatformMark | None = None) -> dict[str, int]:
        """Runs ended since ``since`` (default: ``test_mark``), by outcome."""
        base = self._since(since).outcomes
        now = self.outcomes()
        return {k: v - base.get(k, 0) for k, v in now.items() if v - base.get(k, 0)}

    def _since(self, since: PlatformMark | None) -> PlatformMark:
        mark = since or self.test_mark
        if mark is None:
            raise ValueError("no mark: pass since=platform.mark() taken before the run")
        return mark

    def wait_idle(self, timeout: float = SETTLE_TIMEOUT_S) -> None:
        """Wait until the edge has no run, on itself or on any node."""

        def idle() -> bool:
            a = self.admin()
            return a["runs"] == [] and all(n["runs"] == [] for n in a["nodes"]) and a["queued"] == 0

        poll(idle, timeout=timeout, what="the edge to have no run left")

    # --- assertions -----------------------------------------------------------------------

    def assert_one_terminal(
        self, stream: ClientStream, *, kind: str | None = None, since: PlatformMark | None = None
    ) -> str:
        """Exactly one terminal event, as the client saw it and as the edge counted it.

        The client's side is ``iop.testing.assert_one_terminal``; the edge's is
        its outcome counters: exactly one run ended since ``since``.

        Returns:
            The client-side terminal's name (``finish_reason=stop``...).
        """
        __tracebackhide__ = True  # pytest: show the caller's line
        name = assert_one_terminal(stream, kind=kind)
        self.assert_one_outcome(since=since)
        return name

    def assert_one_outcome(
        self, *, since: PlatformMark | None = None, timeout: float = SETTLE_TIMEOUT_S
    ) -> str:
        """Exactly one run ended on the edge since ``since``; returns its outcome key."""
        __tracebackhide__ = True  # pytest: show the caller's line
        mark = self._since(since)
        ended = poll(
            lambda: (d := self.outcomes_since(mark)) and d,
            timeout=timeout,
            what="the edge to count the run's outcome",
        )
        self.wait_idle(timeout)
        ended = self.outcomes_since(mark)
        if sum(ended.values()) != 1:
            raise AssertionError(f"expected exactly one run to end on the edge, outcomes: {ended}")
        return next(iter(ended))

    def assert_backend_closed_within(
        self,
        ms: float,
        *,
        after: float | None = None,
        since: PlatformMark | None = None,
        by_client: bool = True,
    ) -> RequestRecord:
        """The backend saw the run's connection close within ``ms`` milliseconds.

        With the fake backend the close time is the backend's own record; with
        ``iop sim`` (which counts disconnects, with no time) it is when this
        check first saw the count go up, an upper bound. Fails as soon as the
        bound has passed without a close.

        Args:
            ms: The bound, in milliseconds.
            after: From when (``time.monotonic()``); default: when the last
                request since ``since`` was received.
            since: Count requests from this mark (default: ``test_mark``).
            by_client: Also require that the node closed it (not the backend).

        Returns:
            The request's record (fake backend; a synthetic one with ``iop sim``).
        """
        __tracebackhide__ = True  # pytest: show the caller's line
        mark = self._since(since)
        limit_s = ms / 1000.0
        if self.backend_kind == "sim":
            start = time.monotonic() if after is None else after
            try:
                poll(
                    lambda: self.sim_stats()["client_disconnects"] > mark.sim_disconnects,
                    timeout=max(start + limit_s - time.monotonic(), 0.0),
                    what="iop sim to see its client go away",
                    interval=0.005,
                )
            except AssertionError:
                raise AssertionError(
                    f"iop sim still had its client {ms:g} ms after the start"
                ) from None
            seen = time.monotonic()
            return RequestRecord(
                index=-1,
                method="POST",
                path=CHAT_COMPLETIONS_PATH,
                body=b"",
                received_at=start,
                connection=-1,
                connection_state="closed",
                closed_at=seen,
            )
        requests = self.backend_requests(mark)
        if not requests:
            raise AssertionError("the backend received no chat request since the mark")
        start = requests[-1].received_at if after is None else after

        def closed() -> RequestRecord | None:
            record = self.backend_requests(mark)[-1]
            return record if record.closed_at is not None else None

        # The backend stamps the close itself: past the bound (and the time a
        # look at its records takes), the answer is known.
        wait = max(start + limit_s - time.monotonic(), 0.0) + RECORD_SLACK_S
        try:
            record = poll(closed, timeout=wait, what="the backend connection to close")
        except AssertionError:
            last = self.backend_requests(mark)[-1]
            raise AssertionError(
                f"the backend's connection was still open ({last.connection_state}) "
                f"{ms:g} ms after the start"
            ) from None
        assert record.closed_at is not None
        took = record.closed_at - start
        if took > limit_s:
            raise AssertionError(
                f"the backend saw its socket close {1000 * took:.1f} ms after the start, more than "
                f"{ms:g} ms (closed while {record.closed_in}, by {record.close_cause})"
            )
        if by_client and record.close_cause not in ("client_eof", "client_reset"):
            raise AssertionError(
                f"the backend's connection was closed by {record.close_cause}, not by the node"
            )
        return record

    def assert_no_leaks(
        self, *, since: PlatformMark | None = None, timeout: float = SETTLE_TIMEOUT_S
    ) -> None:
        """No run, task or socket left over since ``since``.

        Checked until ``timeout``: the edge has no run (itself or on a node);
        the edge's and the node's open fds are back to the mark's (the node's
        idle keep-alive connections to the backend left out); and the backend
        has no request still being answered (fake: every connection since the
        mark is idle or closed; sim: no open stream or answer).
        """
        __tracebackhide__ = True  # pytest: show the caller's line
        mark = self._since(since)
        problems: list[str] = []

        def clean() -> bool:
            problems.clear()
            admin = self.admin()
            runs = admin["runs"] + [r for n in admin["nodes"] for r in n["runs"]]
            if runs:
                problems.append(f"runs still on the edge: {runs}")
            for name, count in self.fd_counts().items():
                if count > mark.fds[name]:
                    problems.append(f"{name} has {count} open fds, {mark.fds[name]} at the mark")
            if self.backend_kind == "sim":
                stats = self.sim_stats()
                if stats["open_streams"] or stats["open_completions"]:
                    problems.append(f"iop sim still answering: {stats}")
            else:
                # A connection the backend stopped reading is its own fault:
                # it cannot see the node leave (the close waits behind the
                # unread bytes) until its stall ends.
                busy = [
                    r
                    for r in self.backend_requests(mark, path=None)
                    if r.connection_state not in ("idle", "closed") and not r.reading_stopped
                ]
                if busy:
                    problems.append(
                        "backend connections still busy: "
                        + ", ".join(f"{r.path} ({r.connection_state})" for r in busy)
                    )
            return not problems

        try:
            poll(clean, timeout=timeout, what="the platform to release everything")
        except AssertionError:
            raise AssertionError("leaked: " + "; ".join(problems)) from None

    # --- processes ------------------------------------------------------------------------

    def logs(self, tail: int = 120) -> str:
        """The log tail of every process of the platform."""
        return "\n".join(p.logs(tail) for p in self.procs)

    def stop(self) -> None:
        """Stop the node, the edge, then the backend (by PID; idempotent)."""
        for proc in reversed(self.procs):
            proc.stop(STOP_GRACE_S)


def _wait_ready(url: str, model: str, timeout: float, procs: list[Proc]) -> None:
    def ready() -> bool:
        for proc in procs:
            if not proc.alive:
                raise AssertionError(f"{proc.name} exited ({proc.returncode})\n{proc.logs()}")
        try:
            if httpx.get(url + "/readyz", timeout=2.0, trust_env=False).status_code != 200:
                return False
            models = httpx.get(url + "/v1/models", timeout=2.0, trust_env=False).json()["data"]
        except (httpx.TransportError, ValueError, KeyError):
            return False
        return any(m["id"] == model for m in models)

    poll(ready, timeout=timeout, what=f"the edge at {url} to serve {model!r}")


def start_platform(
    log_dir: Path,
    *,
    backend: BackendKind = "fake",
    model: str | None = None,
    edge_config: Mapping[str, Any] | None = None,
    node_config: Mapping[str, Any] | None = None,
    instance: Mapping[str, Any] | None = None,
    sim_args: tuple[str, ...] = (),
    python: str | None = None,
    start_timeout: float = 60.0,
) -> LoopbackPlatform:
    """Start backend, ``iop edge`` and ``iop node`` on loopback; ready to serve ``model``.

    Args:
        log_dir: Where the configs and the processes' stdout/stderr go.
        backend: ``"fake"``: the scriptable fake backend; ``"sim"``: ``iop sim``.
        model: The model name (default ``iop-fake`` / ``iop-sim``).
        edge_config: Edge config (TOML keys as dicts), merged over the defaults.
        node_config: Keys of the node's ``[node]`` table, merged over the defaults.
        instance: Keys of the node's ``vllm`` instance, merged over the defaults.
        sim_args: More ``iop sim`` flags (``--tokens-per-s 50``...).
        python: The interpreter to run the processes with (default: this one).
        start_timeout: Deadline for the whole start.

    Raises:
        AssertionError: A process exited or the platform was not ready in
            time (with the processes' logs); what started is stopped.
    """
    py = python or sys.executable
    name = model or (SIM_MODEL if backend == "sim" else FAKE_MODEL)
    started: list[Proc] = []
    try:
        control_url: str | None = None
        if backend == "sim":
            proc = Proc(
                "sim", ["sim", "--port", "0", "--model", name, *sim_args], log_dir, python=py
            )
            started.append(proc)
            backend_url = proc.wait_stdout(SIM_READY, start_timeout).group(1)
        else:
            proc = Proc(
                "backend",
                [],
                log_dir,
                argv=[py, "-m", "iop.testing._replay_server", "--model", name],
            )
            started.append(proc)
            m = proc.wait_stdout(FAKE_READY, start_timeout)
            backend_url, control_url = m.group(1), m.group(2)
        edge_cfg = _merge({"server": {"port": free_port()}}, edge_config or {})
        (log_dir / "edge.toml").write_text(toml_dumps(edge_cfg))
        edge = Proc(
            "edge",
            [
                "edge",
                "--port",
                str(edge_cfg["server"]["port"]),
                "--node-token",
                NODE_TOKEN,
                "--config",
                str(log_dir / "edge.toml"),
            ],
            log_dir,
            python=py,
        )
        started.append(edge)
        m = edge.wait_stdout(EDGE_READY, start_timeout)
        url, link_url = m.group(1), m.group(2)
        node_cfg = {
            "node": _merge(
                {"id": "iop-testing-node", "reconnect_min_s": 0.1, "reconnect_max_s": 1.0},
                {**(node_config or {}), "edges": [{"url": link_url, "token": NODE_TOKEN}]},
            ),
            "instances": [
                _merge(
                    {"adapter": "vllm", "name": "backend", "endpoint": backend_url}, instance or {}
                )
            ],
        }
        (log_dir / "node.toml").write_text(toml_dumps(node_cfg))
        node = Proc("node", ["node", "--config", str(log_dir / "node.toml")], log_dir, python=py)
        started.append(node)
        node.wait_stdout(NODE_READY, start_timeout)
        _wait_ready(url, name, start_timeout, started)
    except BaseException:
        for proc in reversed(started):
            proc.stop()
        raise
    server = edge_cfg.get("server") or {}
    keys = server.get("api_keys") or [None]
    admin_keys = server.get("admin_keys") or [None]
    return LoopbackPlatform(
        backend_kind=backend,
        model=name,
        backend=started[0],
        backend_url=backend_url,
        control_url=control_url,
        edge=edge,
        url=url,
        node=node,
        api_key=keys[0],
        admin_key=admin_keys[0],
    )


@contextmanager
def loopback_platform(log_dir: Path, **options: Any) -> Iterator[LoopbackPlatform]:
    """``start_platform(log_dir, **options)``, stopped on exit."""
    platform = start_platform(log_dir, **options)
    try:
        yield platform
    finally:
        platform.stop()
