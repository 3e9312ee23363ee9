"""A backend that lies in numbers cannot cut its node's link.

One ``iop node`` with two ``vllm`` instances: the sim, and a server that
lies:

* its KV cache events (``kv_events_path``, docs/operations.md "What the
  caches hold") claim blocks of 2**64 - 1 tokens. The node's one load
  report carries every instance's figures to the edge; a count that
  msgpack cannot carry must not make that report unsendable, or every run
  on the node (the sim's too) is lost with the link, again at each scrape;
* its answers report usage of 2**70 tokens: that run alone ends with
  ``backend_protocol_error`` (502), the sim's stream beside it completes;
* its answers report -5 or 2**64 - 1 output tokens: the edge, which counts
  them (``/metrics``, the usage ledger), keeps serving and writes every
  run.

The tests share one edge and node (``lied_to``): each checks what one lie
does, and the checks of the stack (no crash, no error line) cover the lies
of the tests before it too.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar, Final

import msgspec
import openai
import pytest

from tests.e2e._platform import MODEL, Edge, Procs, Sim, poll, read_stream

pytestmark = pytest.mark.timeout(120)

LIAR_MODEL: Final = "kv-liar"
# More blocks, each of more tokens, than any cache holds: their product is
# past what msgpack carries (2**64 - 1).
HUGE_BLOCK: Final = 2**64 - 1


# The usage the liar reports, by the request's last message.
_USAGE: Final = {
    "huge": {"prompt_tokens": 2**70, "completion_tokens": 2**70},
    "negative": {"prompt_tokens": 1, "completion_tokens": -5},
    "past-int64": {"prompt_tokens": 2**64 - 1, "completion_tokens": 2**64 - 1},
}


class _Liar(BaseHTTPRequestHandler):
    """``/v1/models`` and ``/metrics`` as vLLM; ``/kv_events`` lies (counted)."""

    protocol_version = "HTTP/1.1"
    scrapes: ClassVar[int] = 0
    seq: ClassVar[int] = -1

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, body: bytes, ctype: str) -> None:
        self.send_response(200)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path.startswith("/kv_events"):
            type(self).seq += 1
            type(self).scrapes += 1
            stored = ["BlockStored", [1, 2, 3], None, [1], HUGE_BLOCK, None, None]
            batch = msgspec.msgpack.encode([1.0, [stored], None])
            self._send(msgspec.msgpack.encode([[self.seq, batch]]), "application/msgpack")
        elif self.path.startswith("/metrics"):
            self._send(b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n", "text/plain")
        else:
            models = {"object": "list", "data": [{"id": LIAR_MODEL, "object": "model"}]}
            self._send(json.dumps(models).encode(), "application/json")

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
        usage = _USAGE[request["messages"][-1]["content"]]
        head = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": LIAR_MODEL}
        chunks = [
            {**head, "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]},
            {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
            {**head, "choices": [], "usage": usage},
        ]
        body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        self._send(body.encode(), "text/event-stream")


@pytest.fixture(scope="module")
def liar() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Liar)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def _start(procs: Procs, sim: Sim, liar: str, ledger: Path | None = None) -> Edge:
    """An edge whose one node serves the sim and the liar; with a usage
    ``ledger`` directory, prices and the ledger too."""
    config: dict[str, Any] = {"server": {"keepalive_interval_s": 0.5}}
    if ledger is not None:
        config["usage"] = {"ledger_path": str(ledger / "usage.db")}
        config["prices"] = {"*": {"input": 1.0, "output": 2.0}}
    edge = procs.edge(config)
    procs.node(
        [edge],
        sim,
        node_id="n-liar",
        more_instances=[
            {
                "adapter": "vllm",
                "name": "liar",
                "endpoint": liar,
                "kv_events_path": "/kv_events",
                "load_scrape_interval_s": 0.1,
            }
        ],
    )
    edge.wait_ready(node_id="n-liar")
    edge.wait_ready(LIAR_MODEL, node_id="n-liar")
    return edge


@pytest.fixture(scope="module")
def lied_to(
    sim: Sim, liar: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Procs, Edge]]:
    """The module's edge, with prices and a usage ledger, and its node."""
    procs = Procs(tmp_path_factory.mktemp("lying"))
    try:
        yield procs, _start(procs, sim, liar, tmp_path_factory.mktemp("ledger"))
    finally:
        procs.stop_all()


def _story(client: openai.OpenAI) -> openai.Stream[Any]:
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me a story."}],
        stream=True,
        extra_body={"iop_sim": {"output_tokens": 20, "tokens_per_s": 20.0}},
    )


def test_absurd_kv_events_do_not_cut_the_link(lied_to: tuple[Procs, Edge]) -> None:
    procs, edge = lied_to
    with (
        edge.openai() as client,
        _story(client) as stream,
    ):
        first = _Liar.scrapes
        # Several of the liar's pages are read (and reported) while the sim streams.
        poll(lambda: _Liar.scrapes >= first + 5, timeout=20, what="the node to scrape the liar")
        r = read_stream(stream)
    assert r.finish_reason == "stop"
    assert len(r.content_deltas) == 20
    assert edge.outcome("cancelled:node_lost") == 0
    assert "crashed" not in procs._owned[-1].stderr()


def test_usage_past_64_bits_ends_that_run_alone(lied_to: tuple[Procs, Edge], sim: Sim) -> None:
    procs, edge = lied_to
    with edge.openai() as client, _story(client) as stream:
        sim.wait_open()
        with pytest.raises(openai.APIStatusError) as refused:
            client.chat.completions.create(
                model=LIAR_MODEL, messages=[{"role": "user", "content": "huge"}]
            )
        assert refused.value.status_code == 502
        assert "backend_protocol_error" in str(refused.value.body)
        # Streamed, the error ends the stream (docs/api.md, "The stream").
        with pytest.raises(openai.APIError) as ended:
            for _ in client.chat.completions.create(
                model=LIAR_MODEL, messages=[{"role": "user", "content": "huge"}], stream=True
            ):
                pass
        assert "backend_protocol_error" in str(ended.value.body)
        r = read_stream(stream)
    assert r.finish_reason == "stop"
    assert len(r.content_deltas) == 20
    assert edge.outcome("cancelled:node_lost") == 0
    assert "crashed" not in procs._owned[-1].stderr()


@pytest.mark.parametrize("usage", ["negative", "past-int64"])
def test_absurd_usage_is_answered_and_the_edge_keeps_serving(
    lied_to: tuple[Procs, Edge], usage: str
) -> None:
    _, edge = lied_to
    with edge.openai() as client:
        for streamed in (False, True):
            answer = client.chat.completions.create(
                model=LIAR_MODEL, messages=[{"role": "user", "content": usage}], stream=streamed
            )
            if streamed:
                for _ in answer:  # type: ignore[union-attr]
                    pass
        with _story(client) as stream:
            r = read_stream(stream)
    assert r.finish_reason == "stop"
    assert edge.proc.popen.poll() is None
    assert edge.admin_get("/metrics").status_code == 200
    # Every run was counted and written: no error in the edge's log.
    assert [line for line in edge.proc.stderr().splitlines() if " ERROR " in line] == []
