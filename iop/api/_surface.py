"""What every API surface offers the edge (sans-IO).

An *API surface* is one HTTP API that clients speak: OpenAI Chat
Completions, OpenAI Responses, Anthropic Messages, legacy completions,
embeddings. Each lives in its own package under ``iop.api`` and turns

* request bytes into a :class:`Call` (the run's request plus what the surface
  needs to answer), or a typed 4xx (``iop.errors.RequestError``);
* a run's ``RuntimeEvent`` s into response bytes: a :class:`StreamEncoder` for
  streaming responses, a :class:`Collector` for one body;
* any error into the surface's own error body (:meth:`Surface.error_body`).

None of them does I/O or imports trio, httpx or quart
(``tests/test_layers.py``): the edge's HTTP layer (``iop.edge.routes``) reads
the body, starts the run, and writes whatever bytes come back, the same way
for every surface. So each surface inherits the run machinery as it is:
cancellation in every window, failover before the first output, keep-alives,
deadlines and credit flow control.

Lifecycle, as the HTTP layer drives it::

    call = surface.parse(body, headers, tenant=name)  # RequestError -> error_body
    run  = core.start_run(ExecutionSpec(run_id, call.request, ...))
    if call.stream:
        enc = surface.stream(call, ctx)
        enc.start(); enc.feed_many(events) ...; enc.keepalive() while idle
    else:
        col = surface.collector(call, ctx)
        col.feed(event) ...; status, body = col.result()

A run that ends before any output gets a real HTTP status from
``error_body`` (the edge commits headers only with the first output), with
the status, code and message of ``iop.api._output.shape_failure``. An
encoder or collector that also has a ``summary()`` method gets it logged
(at debug) when the response closes.

The edge routes a surface with one line in ``iop.edge.routes.surface_routes``::

    SurfaceRoute("/v1/chat/completions", CHAT)                 # Bearer key
    SurfaceRoute("/v1/messages", MESSAGES, key_of=some_reader)  # e.g. x-api-key

where ``key_of`` reads the client's API key from the (lower-cased) headers.
The key's tenant (``iop.edge.tenancy._tenants``) is passed to ``parse`` by name: what
a surface keeps between requests (the Responses store) is kept per tenant,
so no tenant reaches another's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

import msgspec

from iop.config import OutputPolicy
from iop.errors import InvariantError
from iop.events import RuntimeEvent
from iop.spec import ChatRequest, OperationRequest

__all__ = ["Call", "Collector", "RunContext", "StreamEncoder", "Surface"]


class Call(msgspec.Struct, frozen=True, kw_only=True):
    """A parsed, valid request of some surface.

    Attributes:
        request: What the run executes: for chat-like surfaces the request
            translated to a ``ChatRequest``; legacy completions,
            embeddings and token counts have their own operation requests
            (``iop.spec.OperationRequest``).
        stream: The client asked for a streaming response.
        model: The model name the client asked for (shown back to it).
        native: The surface's own typed request, for its encoder and
            collector (e.g. the Responses ``input`` items to store).
    """

    request: OperationRequest
    stream: bool
    model: str
    native: object = None

    @property
    def chat(self) -> ChatRequest:
        """``request`` of a chat-like surface (chat, Responses, Messages).

        Raises:
            InvariantError: The call carries another operation's request.
        """
        if not isinstance(self.request, ChatRequest):
            raise InvariantError(f"a {type(self.request).__name__} is not a chat request")
        return self.request


class RunContext(msgspec.Struct, frozen=True, kw_only=True):
    """What an encoder or collector knows of the run it answers.

    Attributes:
        run_id: The run's id (response ids are derived from it).
        created: Unix time of the response, constant over a stream.
        policy: The output policy of the model (``iop.config.OutputPolicy``).
    """

    run_id: str
    created: int
    policy: OutputPolicy


class StreamEncoder(Protocol):
    """One streaming response: events in, bytes out; never raises on valid input."""

    @property
    def finished(self) -> bool:
        """True once the stream's last bytes were returned."""
        ...

    def start(self) -> bytes:
        """The stream's opening bytes (sent with the headers)."""
        ...

    def feed_many(self, events: Iterable[RuntimeEvent]) -> bytes:
        """Bytes for ``events``, in order (possibly ``b""``)."""
        ...

    def keepalive(self) -> bytes:
        """A keep-alive the client ignores (an SSE comment, Anthropic's ``ping``)."""
        ...


class Collector(Protocol):
    """One non-streaming response: events in, ``(status, body)`` out."""

    @property
    def finished(self) -> bool: ...

    def feed(self, event: RuntimeEvent) -> None: ...

    def result(self) -> tuple[int, bytes]:
        """The response's status and body, once a terminal event was fed."""
        ...


class Surface(Protocol):
    """One API surface (see the module docstring)."""

    @property
    def name(self) -> str:
        """Short name for logs and metrics (``chat``, ``responses``, ``messages``...)."""
        ...

    def parse(self, body: bytes, headers: Mapping[str, str], *, tenant: str) -> Call:
        """Decode and check a request body.

        ``headers`` are the request's headers, names lower-cased
        (``anthropic-version``, ``anthropic-beta``...). The API key was
        checked before (the route's key reader, ``iop.edge.routes``) and
        ``tenant`` is the name of its tenant: state a surface keeps between
        requests is that tenant's alone.

        Raises:
            RequestError: A 4xx with the surface's wording and ``param``.
        """
        ...

    def error_body(
        self, status: int, message: str, *, code: str | None = None, param: str | None = None
    ) -> tuple[int, bytes]:
        """The surface's error response for an IOP status and code.

        Returns the status to send (a surface may map statuses: Anthropic
        answers an overloaded server with 529) and the body.
        """
        ...

    def stream(self, call: Call, ctx: RunContext) -> StreamEncoder: ...

    def collector(self, call: Call, ctx: RunContext) -> Collector: ...
