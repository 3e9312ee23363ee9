"""OpenAI's Files and Batches routes (docs/api.md, "Batches and files").

``POST /v1/files`` is served below quart (``iop.edge.server._surface_asgi``)
with a body limit of its own (``batches.max_file_bytes`` and the multipart
envelope); the other routes are quart's. A file or batch is its tenant's:
every lookup is by id *and* tenant, so another tenant's id is the same 404
as an id that does not exist. The upload is read and checked whole
(``iop.batches.read_batch_file``, each body by its endpoint's own parser)
before it is stored; running is ``iop.edge.batches``'.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from functools import partial
from typing import Any, Final

import msgspec
import trio
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import RequestEntityTooLarge
from werkzeug.formparser import MultiPartParser
from werkzeug.http import parse_options_header

from iop.batches import ENDPOINTS, BadTransition, BatchRow, FileRow, check_line, read_batch_file
from iop.config import MAX_BATCH_LINES
from iop.edge._core import EdgeCore
from iop.edge.batches import COMPLETION_WINDOW_S, LineCheck
from iop.edge.routes._errors import (
    bearer_key,
    error,
    error_answer,
    exc_answer,
    from_exc,
    json_answer,
    json_response,
    key_refused,
    request_headers,
)
from iop.edge.server._surface_asgi import Answer, BodyReader, SurfaceAnswer
from iop.edge.tenancy._tenants import Tenant, no_access
from iop.errors import ErrorCode, RequestError

__all__ = ["FILES_PATH", "MULTIPART_ENVELOPE_BYTES", "add_batch_routes"]

FILES_PATH: Final = "/v1/files"

# What a multipart upload adds around its file: the boundaries, the part
# headers and the purpose field (a few hundred bytes); 64 KiB is generous.
MULTIPART_ENVELOPE_BYTES: Final = 64 * 1024
# The parts an upload has: ``file`` and ``purpose`` (and the SDK's
# ``expires_after`` pair); more is not an upload of ours.
_MAX_PARTS: Final = 8

# OpenAI's metadata bounds (openai.types.shared.Metadata): 16 pairs, keys of
# at most 64 characters, values of at most 512.
_METADATA_PAIRS: Final = 16
_METADATA_KEY_CHARS: Final = 64
_METADATA_VALUE_CHARS: Final = 512

# Bodies checked between two checkpoints at upload: a chat body parses in
# tens of microseconds, so 256 hold the event loop some milliseconds.
_CHECKS_PER_TURN: Final = 256

# List pages: OpenAI's defaults and bounds (files: 10,000; batches: 20, 1..100).
_FILES_PAGE: Final = 10_000
_BATCHES_PAGE: Final = 20
_BATCHES_PAGE_MAX: Final = 100


class _CreateBatch(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    # Accepted for the SDK's sake; output files are kept with the batch.
    output_expires_after: dict[str, Any] | None = None


def _not_found(kind: str, the_id: str, param: str) -> RequestError:
    return RequestError(
        f"No such {kind} object: {the_id}", status=404, code=ErrorCode.NOT_FOUND, param=param
    )


def _listing(data: list[dict[str, Any]], more: bool) -> bytes:
    return msgspec.json.encode(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": more,
        }
    )


def _limit(raw: str | None, default: int, top: int) -> int:
    if raw is None:
        return default
    if not raw.isdigit() or not 1 <= int(raw) <= top:
        raise RequestError(
            f"limit must be an integer between 1 and {top}",
            status=400,
            code=ErrorCode.INVALID_VALUE,
            param="limit",
        )
    return int(raw)


class _BatchRoutes:
    def __init__(self, core: EdgeCore) -> None:
        self.core = core
        self.batches = core.batches

    def _tenant(self, headers: Mapping[str, str]) -> Tenant | None:
        return self.core.tenants.identify(bearer_key(headers))

    def _refused(self, headers: Mapping[str, str]) -> Response:
        message = key_refused(bearer_key(headers), "Incorrect API key provided.")
        return error(401, message, code=ErrorCode.INVALID_API_KEY)

    # --- files ------------------------------------------------------------------

    async def upload(self, headers: Mapping[str, str], read_body: BodyReader) -> Answer:
        """``POST /v1/files``: a batch file, multipart, checked whole."""
        tenant = self._tenant(headers)
        if tenant is None:
            message = key_refused(bearer_key(headers), "Incorrect API key provided.")
            return error_answer(401, message, code=ErrorCode.INVALID_API_KEY)
        kind, options = parse_options_header(headers.get("content-type", ""))
        if kind != "multipart/form-data" or "boundary" not in options:
            return error_answer(
                415,
                "Upload a file as multipart/form-data (fields 'file' and 'purpose').",
                code=ErrorCode.UNSUPPORTED_MEDIA_TYPE,
            )
        body = await read_body()
        try:
            row = await self._store_upload(tenant, body, options["boundary"].encode("latin-1"))
        except RequestError as exc:
            return exc_answer(exc)
        return json_answer(msgspec.json.encode(row.to_openai()))

    async def _store_upload(self, tenant: Tenant, body: bytes, boundary: bytes) -> FileRow:
        settings = self.core.config.batches
        # No form-memory limit: werkzeug's counts a file part of many short
        # lines against it (a 300 KB file of them was refused), and the
        # body is bounded already (max_file_bytes and the envelope).
        parser = MultiPartParser(max_form_memory_size=None, max_form_parts=_MAX_PARTS)
        try:
            form, files = parser.parse(io.BytesIO(body), boundary, len(body))
        except (ValueError, RequestEntityTooLarge) as exc:
            raise RequestError(
                f"The multipart body cannot be read ({exc}).",
                status=400,
                code=ErrorCode.INVALID_REQUEST_ERROR,
            ) from exc
        purpose = form.get("purpose")
        if not purpose:
            raise RequestError(
                "purpose is missing",
                status=400,
                code=ErrorCode.MISSING_REQUIRED_PARAMETER,
                param="purpose",
            )
        if purpose != "batch":
            raise RequestError(
                f"purpose {purpose!r} is not supported: this server takes files for 'batch'",
                status=400,
                code=ErrorCode.UNSUPPORTED_VALUE,
                param="purpose",
            )
        upload = files.get("file")
        if upload is None:
            raise RequestError(
                "file is missing",
                status=400,
                code=ErrorCode.MISSING_REQUIRED_PARAMETER,
                param="file",
            )
        data = upload.stream.read(settings.max_file_bytes + 1)
        if len(data) > settings.max_file_bytes:
            raise RequestError(
                f"The file is larger than {settings.max_file_bytes} bytes (batches.max_file_bytes).",
                status=413,
                code=ErrorCode.REQUEST_ENTITY_TOO_LARGE,
                param="file",
            )
        # Up to max_file_bytes of JSON read: in a worker thread, so that the
        # event loop goes on serving meanwhile...
        lines = await trio.to_thread.run_sync(
            partial(read_batch_file, data, max_lines=settings.max_lines)
        )
        check = self.batches.check
        if check is not None:
            # ...then each body by its endpoint's parser, here: a surface's
            # parse may touch state the event loop owns (the Responses
            # store, which a lookup reorders and expires). A checkpoint every
            # _CHECKS_PER_TURN lines lets other requests in between.
            for i, line in enumerate(lines, start=1):
                check_line(line, partial(_check_as, check, tenant.name))
                if i % _CHECKS_PER_TURN == 0:
                    await trio.lowlevel.checkpoint()
        return await self.batches.add_file(
            tenant.name, upload.filename or "batch.jsonl", purpose, data
        )

    async def list_files(self) -> Response:
        headers = request_headers()
        tenant = self._tenant(headers)
        if tenant is None:
            return self._refused(headers)
        args = request.args
        order = args.get("order", "desc")
        try:
            limit = _limit(args.get("limit"), _FILES_PAGE, _FILES_PAGE)
            if order not in ("asc", "desc"):
                raise RequestError(
                    "order must be 'asc' or 'desc'",
                    status=400,
                    code=ErrorCode.INVALID_VALUE,
                    param="order",
                )
        except RequestError as exc:
            return from_exc(exc)
        rows, more = await self.batches.files(
            tenant.name,
            purpose=args.get("purpose"),
            after=args.get("after"),
            limit=limit,
            newest_first=order == "desc",
        )
        return json_response(_listing([r.to_openai() for r in rows], more))

    async def get_file(self, file_id: str) -> Response:
        headers = request_headers()
        tenant = self._tenant(headers)
        if tenant is None:
            return self._refused(headers)
        row = await self.batches.file(tenant.name, file_id)
        if row is None:
            return from_exc(_not_found("File", file_id, "file_id"))
        return json_response(msgspec.json.encode(row.to_openai()))

    async def file_content(self, file_id: str) -> Response:
        headers = request_headers()
        tenant = self._tenant(headers)
        if tenant is None:
            return self._refused(headers)
        data = await self.batches.content(tenant.name, file_id)
        if data is None:
            return from_exc(_not_found("File", file_id, "file_id"))
        return Response(data, status=200, content_type="application/jsonl")

    async def delete_file(self, file_id: str) -> Response:
        headers = request_headers()
        tenant = self._tenant(headers)
        if tenant is None:
            return self._refused(headers)
        if not await self.batches.delete_file(tenant.name, file_id):
            return from_exc(_not_found("File", file_id, "file_id"))
        return json_response(
            msgspec.json.encode({"id": file_id, "object": "file", "deleted": True})
        )

    # --- batches ----------------------------------------------------------------

    async def create_batch(self) -> Response:
        headers = request_headers()
        tenant = self._tenant(headers)
        if tenant is None:
            return self._refused(headers)
        body = await request.get_data(cache=False)
        assert isinstance(body, bytes)
        try:
            row = await self._create(tenant, bearer_key(headers), body)
        except RequestError as exc:
            return from_exc(exc)
        return json_response(await self._object(row))

    async def _create(self, tenant: Tenant, key: str, body: bytes) -> BatchRow:
        try:
            asked = msgspec.json.decode(body, type=_CreateBatch)
        except msgspec.ValidationError as exc:
            raise RequestError(str(exc), status=400, code=ErrorCode.INVALID_VALUE) from exc
        except msgspec.DecodeError as exc:
            raise RequestError(
                f"The body is not valid JSON ({exc})", status=400, code=ErrorCode.INVALID_JSON
            ) from exc
        if asked.endpoint not in ENDPOINTS:
            raise RequestError(
                f"endpoint {asked.endpoint!r} is not supported: one of {', '.join(ENDPOINTS)}",
                status=400,
                code=ErrorCode.UNSUPPORTED_VALUE,
                param="endpoint",
            )
        if asked.completion_window not in COMPLETION_WINDOW_S:
            raise RequestError(
                f"completion_window {asked.completion_window!r} is not supported: '24h'",
                status=400,
                code=ErrorCode.UNSUPPORTED_VALUE,
                param="completion_window",
            )
        _check_metadata(asked.metadata)
        file = await self.batches.file(tenant.name, asked.input_file_id)
        data = await self.batches.content(tenant.name, asked.input_file_id)
        if file is None or data is None:
            raise _not_found("File", asked.input_file_id, "input_file_id")
        if file.purpose != "batch":
            raise RequestError(
                f"File {file.id} has purpose {file.purpose!r}, not 'batch'",
                status=400,
                code=ErrorCode.INVALID_VALUE,
                param="input_file_id",
            )
        # Checked at upload; read again for its lines (a reload may have
        # lowered max_lines: the file as it was taken is what counts).
        lines = await trio.to_thread.run_sync(
            partial(read_batch_file, data, max_lines=MAX_BATCH_LINES)
        )
        if lines[0].url != asked.endpoint:
            raise RequestError(
                f"The requests of file {file.id} go to {lines[0].url}, not to the batch's "
                f"endpoint {asked.endpoint}",
                status=400,
                code=ErrorCode.INVALID_VALUE,
                param="endpoint",
            )
        if not tenant.may_use(lines[0].model):
            raise no_access(lines[0].model)
        return await self.batches.create(
            tenant=tenant.name,
            key_name=self.core.tenants.key_name(key),
            endpoint=asked.endpoint,
            input_file_id=file.id,
            completion_window=asked.completion_window,
            metadata=asked.metadata,
            lines=lines,
        )

    async def _object(self, row: BatchRow) -> bytes:
        progress = await self.batches.progress(row.id)
        obj = {
            "id": row.id,
            "object": "batch",
            "endpoint": row.endpoint,
            "model": row.model,
            "errors": None if not row.errors else {"object": "list", "data": row.errors},
            "input_file_id": row.input_file_id,
            "completion_window": row.completion_window,
            "status": row.status.value,
            "output_file_id": row.output_file_id,
            "error_file_id": row.error_file_id,
            "created_at": row.created_at,
            "in_progress_at": row.in_progress_at,
            "expires_at": row.expires_at,
            "finalizing_at": row.finalizing_at,
            "completed_at": row.completed_at,
            "failed_at": row.failed_at,
            "expired_at": row.expired_at,
            "cancelling_at": row.cancelling_at,
            "cancelled_at": row.cancelled_at,
            "request_counts": {
                "total": progress.total,
                "completed": progress.completed,
                "failed": progress.failed,
            },
            "usage": {
                "input_tokens": progress.input_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": progress.output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": progress.input_tokens + progress.output_tokens,
            },
            "metadata": row.metadata,
            # IOP's own (the SDK keeps unknown fields): the pace and what is left.
            "iop": self.batches.pace(row, progress),
        }
        return msgspec.json.encode(obj)

    async def get_batch(self, batch_id: str) -> Response:
        headers = request_headers()
        tenant = self._tenant(headers)
        if tenant is None:
            return self._refused(headers)
        row = await self.batches.batch(tenant.name, batch_id)
        if row is None:
            return from_exc(_not_found("Batch", batch_id, "batch_id"))
        return json_response(await self._object(row))

    async def list_batches(self) -> Response:
        headers = request_headers()
        tenant = self._tenant(headers)
        if tenant is None:
            return self._refused(headers)
        try:
            limit = _limit(request.args.get("limit"), _BATCHES_PAGE, _BATCHES_PAGE_MAX)
        except RequestError as exc:
            return from_exc(exc)
        rows, more = await self.batches.batches(
            tenant.name, after=request.args.get("after"), limit=limit
        )
        data = [msgspec.json.decode(await self._object(r)) for r in rows]
        return json_response(_listing(data, more))

    async def cancel_batch(self, batch_id: str) -> Response:
        headers = request_headers()
        tenant = self._tenant(headers)
        if tenant is None:
            return self._refused(headers)
        try:
            row = await self.batches.cancel(tenant.name, batch_id)
        except BadTransition as exc:
            return from_exc(exc)
        if row is None:
            return from_exc(_not_found("Batch", batch_id, "batch_id"))
        return json_response(await self._object(row))


def _check_as(check: LineCheck, tenant: str, url: str, body: bytes) -> None:
    check(url, tenant, body)


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > _METADATA_PAIRS:
        raise RequestError(
            f"metadata holds at most {_METADATA_PAIRS} pairs",
            status=400,
            code=ErrorCode.OBJECT_ABOVE_MAX_PROPERTIES,
            param="metadata",
        )
    for key, value in metadata.items():
        if len(key) > _METADATA_KEY_CHARS or len(value) > _METADATA_VALUE_CHARS:
            raise RequestError(
                f"metadata keys hold at most {_METADATA_KEY_CHARS} characters, values "
                f"{_METADATA_VALUE_CHARS}",
                status=400,
                code=ErrorCode.STRING_ABOVE_MAX_LENGTH,
                param=f"metadata.{key[:_METADATA_KEY_CHARS]}",
            )


def add_batch_routes(
    app: QuartTrio, core: EdgeCore
) -> tuple[dict[str, SurfaceAnswer], dict[str, int]]:
    """The Files and Batches routes: quart's, and ``POST /v1/files`` (returned:
    its answer and its body limit, served below quart)."""
    routes = _BatchRoutes(core)
    app.add_url_rule(FILES_PATH, "files_list", routes.list_files, methods=["GET"])
    app.add_url_rule(f"{FILES_PATH}/<file_id>", "file_get", routes.get_file, methods=["GET"])
    app.add_url_rule(
        f"{FILES_PATH}/<file_id>", "file_delete", routes.delete_file, methods=["DELETE"]
    )
    app.add_url_rule(
        f"{FILES_PATH}/<file_id>/content", "file_content", routes.file_content, methods=["GET"]
    )
    app.add_url_rule("/v1/batches", "batch_create", routes.create_batch, methods=["POST"])
    app.add_url_rule("/v1/batches", "batch_list", routes.list_batches, methods=["GET"])
    app.add_url_rule("/v1/batches/<batch_id>", "batch_get", routes.get_batch, methods=["GET"])
    app.add_url_rule(
        "/v1/batches/<batch_id>/cancel", "batch_cancel", routes.cancel_batch, methods=["POST"]
    )
    limit = core.config.batches.max_file_bytes + MULTIPART_ENVELOPE_BYTES
    return {FILES_PATH: routes.upload}, {FILES_PATH: limit}
