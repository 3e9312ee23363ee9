"""OpenAI's Batch API on real processes, with the official SDK (docs/api.md, "Batches and files").

An edge, a node and ``iop sim``; clients are ``openai.OpenAI``. Each test
starts its own edge (``procs``), with two tenants and a store in its tmp dir:

* the round trip: files.create, batches.create, retrieve until completed,
  files.content, list; each custom_id answered once, usage in the ledger;
* the wall: another tenant's file or batch is the same 404 as none;
* cancel: cancelling -> cancelled, the lines not run in the error file;
* spare capacity: lines the scheduler sheds are run again, not failed;
* kill -9 mid-batch and a restart on the same store: every custom_id
  answered exactly once.
"""

from __future__ import annotations

import hashlib
import json
import signal
from pathlib import Path
from typing import Any, Final

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e._platform import MODEL, Edge, Procs, Sim, free_port, poll

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

KEY_A: Final = "iop-e2e-batch-tenant-a"
KEY_B: Final = "iop-e2e-batch-tenant-b"
ADMIN: Final = "iop-e2e-batch-admin"


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _config(tmp: Path, **batches: Any) -> dict[str, Any]:
    return {
        "server": {
            "keepalive_interval_s": 0.5,
            "api_keys": ["iop-e2e-batch-client"],
            "admin_keys": [ADMIN],
            "drain_timeout_s": 1,
        },
        "scheduler": {"max_queue_delay_s": 0},
        "usage": {"ledger_path": str(tmp / "ledger.sqlite3"), "flush_interval_s": 0.1},
        "tenants": [
            {"name": "a", "key_sha256": [_digest(KEY_A)]},
            {"name": "b", "key_sha256": [_digest(KEY_B)]},
        ],
        "batches": {"retry_initial_s": 0.05, "retry_max_s": 0.5, **batches},
    }


def _client(edge: Edge, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{edge.url}/v1", api_key=key, max_retries=0, timeout=30)


def _lines(n: int, *, tokens: int = 3, tokens_per_s: float | None = None, pad: int = 0) -> bytes:
    sim: dict[str, Any] = {"output_tokens": tokens}
    if tokens_per_s is not None:
        sim["tokens_per_s"] = tokens_per_s
    return b"".join(
        json.dumps(
            {
                "custom_id": f"req-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": f"line {i} " + "x" * pad}],
                    "iop_sim": sim,
                },
            }
        ).encode()
        + b"\n"
        for i in range(n)
    )


def _start(procs: Procs, sim: Sim, config: dict[str, Any], *, port: int = 0, **node: Any) -> Edge:
    edge = procs.edge(config, port=port)
    procs.node([edge], sim, node_id="n1", **node)
    edge.wait_ready(node_id="n1")
    return edge


def _wait_status(client: openai.OpenAI, batch_id: str, *want: str, timeout: float = 60) -> Any:
    return poll(
        lambda: (b := client.batches.retrieve(batch_id)).status in want and b,
        timeout=timeout,
        what=f"batch {batch_id} to be {' or '.join(want)}",
    )


def _answers(client: openai.OpenAI, batch: Any) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for file_id in (batch.output_file_id, batch.error_file_id):
        if file_id:
            text = client.files.content(file_id).text
            out += [json.loads(x) for x in text.splitlines()]
    return out


def _said(exc: openai.APIStatusError) -> str:
    """The error's own message (the SDK's ``message`` adds "Error code: ...")."""
    body = exc.body
    assert isinstance(body, dict)
    return str(body["message"])


def _metric(edge: Edge, name: str, **labels: str) -> float:
    r = httpx.get(f"{edge.url}/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
    r.raise_for_status()
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return 0.0


def test_a_batch_round_trip_with_the_sdk(procs: Procs, sim: Sim, tmp_path: Path) -> None:
    edge = _start(procs, sim, _config(tmp_path))
    n = 20
    # 300 KB of short lines (blank ones are skipped): werkzeug's
    # multipart parser refused that as too large for its form memory.
    data = _lines(n) + b"\n" * 300_000
    with _client(edge, KEY_A) as client:
        up = client.files.create(file=("in.jsonl", data), purpose="batch")
        assert (up.object, up.purpose, up.bytes, up.filename) == (
            "file",
            "batch",
            len(data),
            "in.jsonl",
        )
        assert client.files.retrieve(up.id).id == up.id
        assert client.files.content(up.id).content == data
        batch = client.batches.create(
            input_file_id=up.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            metadata={"job": "nightly"},
        )
        assert batch.status == "in_progress"
        assert batch.in_progress_at is not None
        assert batch.expires_at == batch.created_at + 24 * 3600
        assert batch.metadata == {"job": "nightly"}
        done = _wait_status(client, batch.id, "completed")
        assert done.request_counts is not None
        assert (done.request_counts.total, done.request_counts.completed) == (n, n)
        assert done.request_counts.failed == 0
        assert done.completed_at is not None
        assert done.finalizing_at is not None
        assert done.error_file_id is None
        answers = _answers(client, done)
        # The batch's usage is its lines' (what each answer says).
        assert done.usage is not None
        assert done.usage.output_tokens == sum(
            a["response"]["body"]["usage"]["completion_tokens"] for a in answers
        )
        assert done.usage.input_tokens == sum(
            a["response"]["body"]["usage"]["prompt_tokens"] for a in answers
        )
        assert sorted(a["custom_id"] for a in answers) == sorted(f"req-{i}" for i in range(n))
        for a in answers:
            assert a["id"].startswith("batch_req_")
            assert a["error"] is None
            assert a["response"]["status_code"] == 200
            assert a["response"]["request_id"]
            body = a["response"]["body"]
            assert body["object"] == "chat.completion"
            assert body["usage"]["completion_tokens"] > 0
        assert [b.id for b in client.batches.list()] == [batch.id]
        names = {f.id: f.purpose for f in client.files.list()}
        assert names == {up.id: "batch", done.output_file_id: "batch_output"}
        deleted = client.files.delete(up.id)
        assert deleted.deleted
        # A batch is done with its input file once created.
        assert client.batches.retrieve(batch.id).status == "completed"
    assert _metric(edge, "iop_batch_lines_total", outcome="completed") == n
    assert _metric(edge, "iop_batches", status="completed") == 1
    # Charged in the ledger as its tenant's runs (the usage report by tenant).
    poll(
        lambda: _tenant_runs(edge, "a") == n,
        timeout=10,
        what="the ledger to hold the batch's runs",
    )


def _tenant_runs(edge: Edge, tenant: str) -> int:
    r = httpx.get(f"{edge.url}/admin/usage?by=tenant", headers={"Authorization": f"Bearer {ADMIN}"})
    r.raise_for_status()
    rows = r.json()["rows"]
    return sum(int(row["runs"]) for row in rows if row.get("tenant") == tenant)


def test_another_tenants_ids_are_the_same_404_as_none(
    procs: Procs, sim: Sim, tmp_path: Path
) -> None:
    edge = _start(procs, sim, _config(tmp_path))
    with _client(edge, KEY_A) as a, _client(edge, KEY_B) as b:
        up = a.files.create(file=("in.jsonl", _lines(2)), purpose="batch")
        batch = a.batches.create(
            input_file_id=up.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        calls = {
            "files.retrieve": lambda c, f, _: c.files.retrieve(f),
            "files.content": lambda c, f, _: c.files.content(f),
            "files.delete": lambda c, f, _: c.files.delete(f),
            "batches.retrieve": lambda c, _, x: c.batches.retrieve(x),
            "batches.cancel": lambda c, _, x: c.batches.cancel(x),
            "batches.create": lambda c, f, _: c.batches.create(
                input_file_id=f, endpoint="/v1/chat/completions", completion_window="24h"
            ),
        }
        for name, call in calls.items():
            with pytest.raises(openai.NotFoundError) as theirs:
                call(b, up.id, batch.id)
            with pytest.raises(openai.NotFoundError) as none:
                call(b, "file-" + "0" * 24, "batch_" + "0" * 24)
            # The same answer but for the id it names.
            mine, other = theirs.value.body, none.value.body
            assert isinstance(mine, dict), name
            assert isinstance(other, dict), name
            assert mine["message"].replace(up.id, "X").replace(batch.id, "X") == other[
                "message"
            ].replace("file-" + "0" * 24, "X").replace("batch_" + "0" * 24, "X"), name
            assert (mine["code"], mine["param"]) == (other["code"], other["param"]), name
        assert list(b.files.list()) == []
        assert list(b.batches.list()) == []
        # Tenant a's are untouched.
        assert a.files.retrieve(up.id).id == up.id
        _wait_status(a, batch.id, "completed")


def test_a_bad_file_is_a_400_naming_its_line(procs: Procs, sim: Sim, tmp_path: Path) -> None:
    edge = _start(procs, sim, _config(tmp_path, max_file_bytes=4096, max_lines=3))
    good = _lines(1).decode()
    bad = json.loads(good)
    bad["custom_id"] = "req-0"
    with _client(edge, KEY_A) as client:
        with pytest.raises(openai.BadRequestError) as info:
            client.files.create(
                file=("x.jsonl", (good + json.dumps(bad)).encode()), purpose="batch"
            )
        assert _said(info.value).startswith("Line 2: ")
        assert info.value.code == "duplicate_custom_id"
        bad["custom_id"] = "other"
        bad["body"]["messages"] = "not a list"
        with pytest.raises(openai.BadRequestError) as info:
            client.files.create(
                file=("x.jsonl", (good + json.dumps(bad)).encode()), purpose="batch"
            )
        assert _said(info.value).startswith("Line 2: ")
        assert info.value.param == "body.messages"
        with pytest.raises(openai.BadRequestError) as info:
            client.files.create(file=("x.jsonl", _lines(4)), purpose="batch")
        assert "batches.max_lines" in info.value.message
        with pytest.raises(openai.APIStatusError) as big:
            client.files.create(file=("x.jsonl", b" " * 4097 + _lines(1)), purpose="batch")
        assert big.value.status_code == 413
        # A Responses line is checked as /v1/responses checks its body: an
        # unknown previous_response_id is refused naming the line.
        prior = {
            "custom_id": "p",
            "method": "POST",
            "url": "/v1/responses",
            "body": {"model": MODEL, "input": "hi", "previous_response_id": "resp_nope"},
        }
        with pytest.raises(openai.BadRequestError) as info:
            client.files.create(file=("x.jsonl", json.dumps(prior).encode()), purpose="batch")
        assert _said(info.value).startswith("Line 1: Previous response")
        assert info.value.param == "body.previous_response_id"
        up = client.files.create(file=("x.jsonl", _lines(3)), purpose="batch")
        with pytest.raises(openai.BadRequestError) as info:
            client.batches.create(
                input_file_id=up.id, endpoint="/v1/embeddings", completion_window="24h"
            )
        assert info.value.param == "endpoint"
        assert list(client.batches.list()) == []


def test_cancel_ends_the_lines_in_flight(procs: Procs, sim: Sim, tmp_path: Path) -> None:
    edge = _start(procs, sim, _config(tmp_path, max_concurrent_per_batch=2))
    n = 12
    with _client(edge, KEY_A) as client:
        up = client.files.create(
            file=("in.jsonl", _lines(n, tokens=400, tokens_per_s=40.0)), purpose="batch"
        )
        batch = client.batches.create(
            input_file_id=up.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        sim.wait_open(2)  # two lines in flight
        # The operator sees it run: /admin/nodes and the admin page.
        (running,) = edge.admin()["batches"]
        assert (running["id"], running["tenant"], running["total"]) == (batch.id, "a", n)
        page = edge.admin_get("/admin")
        assert page.status_code == 200
        assert "<h2>Batches</h2>" in page.text
        assert batch.id in page.text
        cancelling = client.batches.cancel(batch.id)
        assert cancelling.status in ("cancelling", "cancelled")
        done = _wait_status(client, batch.id, "cancelled")
        assert done.cancelling_at is not None
        assert done.cancelled_at is not None
        answers = _answers(client, done)
        assert sorted(a["custom_id"] for a in answers) == sorted(f"req-{i}" for i in range(n))
        codes = [a["error"]["code"] for a in answers if a["error"]]
        assert codes
        assert set(codes) == {"batch_cancelled"}
        with pytest.raises(openai.ConflictError):
            client.batches.cancel(batch.id)
    sim.wait_idle()  # the runs in flight were stopped on the backend
    assert _metric(edge, "iop_batch_lines_total", outcome="cancelled") == len(codes)


def test_lines_the_scheduler_sheds_run_again(procs: Procs, sim: Sim, tmp_path: Path) -> None:
    # One slot, a queue of 2 of which sheddable runs may hold 1: most of the
    # batch's 4 lines in flight are refused at admission, again and again.
    config = _config(tmp_path, max_concurrent_per_batch=4)
    config["scheduler"] = {"max_queue": 2, "shed_queue_fraction": 0.5, "max_queue_delay_s": 0}
    edge = _start(procs, sim, config, instance={"max_concurrency": 1})
    n = 10
    with _client(edge, KEY_A) as client:
        up = client.files.create(
            file=("in.jsonl", _lines(n, tokens=5, tokens_per_s=100.0)), purpose="batch"
        )
        batch = client.batches.create(
            input_file_id=up.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        done = _wait_status(client, batch.id, "completed")
        assert done.request_counts is not None
        assert (done.request_counts.completed, done.request_counts.failed) == (n, 0)
        assert all(a["response"]["status_code"] == 200 for a in _answers(client, done))
    assert _metric(edge, "iop_batch_line_retries_total") > 0


def test_kill_9_mid_batch_answers_every_line_once(procs: Procs, sim: Sim, tmp_path: Path) -> None:
    port = free_port()
    config = _config(tmp_path, path=str(tmp_path / "batches.sqlite3"), max_concurrent_per_batch=4)
    edge = _start(procs, sim, config, port=port)
    n = 40
    sent = sim.stats()["requests"]
    with _client(edge, KEY_A) as client:
        up = client.files.create(
            file=("in.jsonl", _lines(n, tokens=20, tokens_per_s=100.0)), purpose="batch"
        )
        batch = client.batches.create(
            input_file_id=up.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        poll(
            lambda: (
                (c := client.batches.retrieve(batch.id).request_counts) is not None
                and c.completed >= 8
            ),
            timeout=60,
            what="a few lines to be done",
        )
        sim.wait_open(1)  # and some in flight
        # IOP's progress beside OpenAI's fields (the SDK keeps it as an extra).
        running = client.batches.retrieve(batch.id)
        assert running.model_extra is not None
        progress = running.model_extra["iop"]
        assert progress["output_tokens"] > 0
        assert progress["lines_per_s"] > 0
        assert progress["eta_s"] > 0
    edge.proc.send(signal.SIGKILL)
    assert edge.proc.wait(5) == -signal.SIGKILL
    edge = procs.edge(config, port=port, name="edge-2")
    edge.wait_ready(node_id="n1")
    with _client(edge, KEY_A) as client:
        done = _wait_status(client, batch.id, "completed", timeout=120)
        assert done.request_counts is not None
        assert (done.request_counts.total, done.request_counts.completed) == (n, n)
        answers = _answers(client, done)
    ids = [a["custom_id"] for a in answers]
    assert sorted(ids) == sorted(f"req-{i}" for i in range(n))  # each exactly once
    assert all(a["response"]["status_code"] == 200 for a in answers)
    # Lines with a stored result never ran again: the backend saw each line
    # once, and again only those in flight at the kill (at most 4).
    assert n <= sim.stats()["requests"] - sent <= n + 4


def test_interactive_runs_go_before_queued_batch_lines(
    procs: Procs, sim: Sim, tmp_path: Path
) -> None:
    # One slot: one line runs, three wait in the edge's queue as the batch
    # objective; a client's request that arrives then is served next.
    edge = _start(
        procs, sim, _config(tmp_path, max_concurrent_per_batch=4), instance={"max_concurrency": 1}
    )
    with _client(edge, KEY_A) as client:
        up = client.files.create(
            file=("in.jsonl", _lines(8, tokens=20, tokens_per_s=20.0)), purpose="batch"
        )
        batch = client.batches.create(
            input_file_id=up.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        poll(lambda: edge.admin()["queued"] >= 3, timeout=30, what="three lines queued")
        before = client.batches.retrieve(batch.id).request_counts
        assert before is not None
        # The same tenant's: its fair share does not decide, the objective does.
        answer = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "now"}],
            extra_body={"iop_sim": {"output_tokens": 2}},
        )
        assert answer.choices[0].finish_reason == "stop"
        after = client.batches.retrieve(batch.id).request_counts
        assert after is not None
        # At most the line that held the slot ended meanwhile; in arrival
        # order the three queued lines would have gone first.
        assert after.completed <= before.completed + 1
        client.batches.cancel(batch.id)
        _wait_status(client, batch.id, "cancelled")


@pytest.mark.parametrize(
    ("endpoint", "body", "object_"),
    [
        ("/v1/responses", {"input": "hello"}, "response"),
        ("/v1/completions", {"prompt": "hello", "max_tokens": 4}, "text_completion"),
        ("/v1/embeddings", {"input": ["hello", "world"]}, "list"),
    ],
)
def test_a_batch_of_another_endpoint(
    procs: Procs, sim: Sim, tmp_path: Path, endpoint: str, body: dict[str, Any], object_: str
) -> None:
    # The sim serves every operation; its vllm instance advertises
    # embeddings only when told (docs/configuration.md, `operations`).
    operations = ["chat", "completion", "embedding"]
    edge = _start(procs, sim, _config(tmp_path), instance={"operations": operations})
    data = b"".join(
        json.dumps(
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": endpoint,
                "body": {"model": MODEL, **body, "iop_sim": {"output_tokens": 3}},
            }
        ).encode()
        + b"\n"
        for i in range(3)
    )
    with _client(edge, KEY_A) as client:
        up = client.files.create(file=("in.jsonl", data), purpose="batch")
        with pytest.raises(openai.BadRequestError) as info:
            client.batches.create(
                input_file_id=up.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
        assert info.value.param == "endpoint"
        batch = client.batches.create(
            input_file_id=up.id,
            endpoint=endpoint,  # type: ignore[arg-type]
            completion_window="24h",
        )
        done = _wait_status(client, batch.id, "completed")
        answers = _answers(client, done)
    assert sorted(a["custom_id"] for a in answers) == ["r0", "r1", "r2"]
    for a in answers:
        assert a["response"]["status_code"] == 200, a
        assert a["response"]["body"]["object"] == object_


def test_a_tenants_limits_hold_its_batch_back(procs: Procs, sim: Sim, tmp_path: Path) -> None:
    # Tenant a may run one request at a time: three of the batch's four
    # lines in flight are refused by its limit, and wait, every time.
    config = _config(tmp_path, max_concurrent_per_batch=4)
    config["tenants"][0]["max_concurrent_runs"] = 1
    edge = _start(procs, sim, config)
    n = 6
    with _client(edge, KEY_A) as client:
        up = client.files.create(
            file=("in.jsonl", _lines(n, tokens=5, tokens_per_s=100.0)), purpose="batch"
        )
        batch = client.batches.create(
            input_file_id=up.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        done = _wait_status(client, batch.id, "completed")
        assert done.request_counts is not None
        assert (done.request_counts.completed, done.request_counts.failed) == (n, 0)
    assert _metric(edge, "iop_tenant_rate_limited_total", tenant="a", limit="concurrency") > 0
    assert _metric(edge, "iop_batch_line_retries_total") > 0


def test_separate_limits_leave_the_tenants_own_to_its_requests(
    procs: Procs, sim: Sim, tmp_path: Path
) -> None:
    # The same tenant of one run at a time, its batch's lines apart from its
    # limits (tenant_limits = "separate") and under a token minute of their
    # own: lines run at once without a refusal by the tenant's concurrency,
    # an interactive request beside them is not refused either, and the
    # batch minute (three lines' worth: each reserves its prompt's estimate
    # and [tenancy] default_max_tokens, 1,024) holds the rest back.
    config = _config(
        tmp_path, max_concurrent_per_batch=4, tenant_limits="separate", tokens_per_minute=3_200
    )
    config["tenants"][0]["max_concurrent_runs"] = 1
    edge = _start(procs, sim, config)
    n = 6
    with _client(edge, KEY_A) as client:
        up = client.files.create(
            file=("in.jsonl", _lines(n, tokens=5, tokens_per_s=20.0)), purpose="batch"
        )
        batch = client.batches.create(
            input_file_id=up.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        _wait_status(client, batch.id, "in_progress", "completed")
        answer = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert answer.choices[0].message.content
        done = _wait_status(client, batch.id, "completed")
        assert done.request_counts is not None
        assert (done.request_counts.completed, done.request_counts.failed) == (n, 0)
    assert _metric(edge, "iop_tenant_rate_limited_total", tenant="a", limit="concurrency") == 0
    assert _metric(edge, "iop_tenant_rate_limited_total", tenant="a", limit="batch_tokens") > 0


def _shape(obj: Any, model: Any, extra: frozenset[str] = frozenset()) -> None:
    """``obj`` (the edge's JSON) as the SDK's model of OpenAI's object: every
    field it requires present, each of its declared type (pydantic, strict),
    and no top-level field OpenAI's object lacks but ``extra``."""
    fields = model.model_fields
    required = {name for name, f in fields.items() if f.is_required()}
    assert required <= set(obj), sorted(required - set(obj))
    assert set(obj) - set(fields) <= extra, sorted(set(obj) - set(fields) - extra)
    model.model_validate(obj, strict=True)


def test_files_and_batches_have_openais_shapes(procs: Procs, sim: Sim, tmp_path: Path) -> None:
    """The raw JSON of every object and list, against the official SDK's
    models of OpenAI's API (its types are generated from OpenAI's OpenAPI
    document; tests/data/openai-schemas.json has no files or batches)."""
    from openai.types import Batch, FileDeleted, FileObject

    edge = _start(procs, sim, _config(tmp_path))
    headers = {"Authorization": f"Bearer {KEY_A}"}
    with (
        _client(edge, KEY_A) as client,
        httpx.Client(base_url=f"{edge.url}/v1", headers=headers, timeout=30) as http,
    ):
        up = client.files.create(file=("in.jsonl", _lines(3)), purpose="batch")
        _shape(http.get(f"/files/{up.id}").json(), FileObject)
        files = http.get("/files").json()
        assert files["object"] == "list"
        for f in files["data"]:
            _shape(f, FileObject)
        batch = client.batches.create(
            input_file_id=up.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        _wait_status(client, batch.id, "completed")
        # The batch object: IOP's progress rides in one extra field.
        _shape(http.get(f"/batches/{batch.id}").json(), Batch, frozenset({"iop"}))
        listed = http.get("/batches").json()
        assert (listed["object"], listed["has_more"]) == ("list", False)
        assert listed["first_id"] == listed["last_id"] == batch.id
        for b in listed["data"]:
            _shape(b, Batch, frozenset({"iop"}))
        _shape(http.delete(f"/files/{up.id}").json(), FileDeleted)
