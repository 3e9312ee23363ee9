"""Stored responses are the tenant's own, on real processes: ``iop edge`` with
two tenants (keys by digest) and an operator key, ``iop node``, ``iop sim``,
and the official ``openai`` SDK as each tenant's client.

Tenant B naming tenant A's response in ``previous_response_id`` must learn
nothing from the answer: it is byte for byte the answer to an id that was
never issued (the id in the message aside), and A's conversation stays A's.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterator
from typing import Any, Final

import httpx
import openai
import pytest

from tests.e2e._platform import MODEL, Cluster

pytestmark = pytest.mark.timeout(120)

KEY_A: Final = "iop-e2e-store-tenant-a"
KEY_B: Final = "iop-e2e-store-tenant-b"
OPERATOR: Final = "iop-e2e-store-operator"
ADMIN: Final = "iop-e2e-store-admin"


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


EDGE_CONFIG: dict[str, Any] = {
    # The operator's client key (the tenant "default") reads /v1/models; its
    # admin key reads /admin.
    "server": {"keepalive_interval_s": 0.5, "api_keys": [OPERATOR], "admin_keys": [ADMIN]},
    "tenants": [
        {"name": "a", "key_sha256": [_digest(KEY_A)]},
        {"name": "b", "key_sha256": [_digest(KEY_B)]},
    ],
}


@pytest.fixture
def clients(cluster: Cluster) -> Iterator[tuple[openai.OpenAI, openai.OpenAI]]:
    url = f"{cluster.edge.url}/v1"
    with (
        openai.OpenAI(base_url=url, api_key=KEY_A, max_retries=0, timeout=30) as a,
        openai.OpenAI(base_url=url, api_key=KEY_B, max_retries=0, timeout=30) as b,
    ):
        yield a, b


def _unknown_id_like(response_id: str) -> str:
    """An id never issued, of the same shape and length as ``response_id``."""
    suffix = secrets.token_hex(len(response_id))[: len(response_id) - len("resp_")]
    return "resp_" + suffix


def _refused(client: openai.OpenAI, previous: str) -> httpx.Response:
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="hi", previous_response_id=previous)
    assert info.value.code == "previous_response_not_found"
    return info.value.response


def _same_answer(theirs: httpx.Response, unknown: httpx.Response, their_id: str, id_: str) -> None:
    """Status, headers (but the date) and body equal, once the id named is swapped."""
    assert theirs.status_code == unknown.status_code
    skip = {"date"}
    assert {k: v for k, v in theirs.headers.items() if k not in skip} == {
        k: v for k, v in unknown.headers.items() if k not in skip
    }
    assert theirs.content == unknown.content.replace(id_.encode(), their_id.encode())


def test_another_tenants_response_is_answered_as_an_unknown_id(
    cluster: Cluster, clients: tuple[openai.OpenAI, openai.OpenAI]
) -> None:
    a, b = clients
    first = a.responses.create(model=MODEL, input="a secret of tenant a " * 20)
    assert first.status == "completed"
    alone = b.responses.create(model=MODEL, input="hi")

    taken = _refused(b, first.id)
    unknown_id = _unknown_id_like(first.id)
    unknown = _refused(b, unknown_id)
    assert taken.status_code == 400
    assert taken.json()["error"] == {
        "message": f"Previous response with id '{first.id}' not found.",
        "type": "invalid_request_error",
        "param": "previous_response_id",
        "code": "previous_response_not_found",
    }
    _same_answer(taken, unknown, first.id, unknown_id)

    # A continues its own conversation: the model gets it whole.
    again = a.responses.create(model=MODEL, input="hi", previous_response_id=first.id)
    assert again.status == "completed"
    assert again.previous_response_id == first.id
    assert again.usage is not None
    assert alone.usage is not None
    assert first.usage is not None
    assert again.usage.input_tokens > first.usage.input_tokens > alone.usage.input_tokens

    # B's own store works as before.
    b_again = b.responses.create(model=MODEL, input="more", previous_response_id=alone.id)
    assert b_again.status == "completed"
    # And A cannot take B's.
    _same_answer(_refused(a, alone.id), _refused(a, unknown_id), alone.id, unknown_id)


def test_reading_or_deleting_another_tenants_response_is_answered_as_an_unknown_id(
    cluster: Cluster, clients: tuple[openai.OpenAI, openai.OpenAI]
) -> None:
    a, _ = clients
    first = a.responses.create(model=MODEL, input="hi")
    unknown_id = _unknown_id_like(first.id)
    with httpx.Client(
        base_url=cluster.edge.url, headers={"Authorization": f"Bearer {KEY_B}"}, trust_env=False
    ) as b:
        for method in ("GET", "DELETE"):
            taken = b.request(method, f"/v1/responses/{first.id}")
            unknown = b.request(method, f"/v1/responses/{unknown_id}")
            assert taken.status_code >= 400, (method, taken.status_code)
            _same_answer(taken, unknown, first.id, unknown_id)


def test_a_response_id_is_not_the_run_id_that_logs_and_admin_show(
    cluster: Cluster, clients: tuple[openai.OpenAI, openai.OpenAI]
) -> None:
    a, _ = clients
    first = a.responses.create(model=MODEL, input="hi")
    runs = httpx.get(
        f"{cluster.edge.url}/admin/runs?limit=100",
        headers={"Authorization": f"Bearer {ADMIN}"},
        trust_env=False,
    )
    runs.raise_for_status()
    run_ids = {r["run_id"] for r in runs.json()["recent"]}
    assert run_ids
    assert first.id.startswith("resp_")
    assert not any(run_id in first.id for run_id in run_ids)
    # The output items still carry the run id: an operator can find the run.
    (item,) = first.output
    assert item.id is not None
    assert any(run_id in item.id for run_id in run_ids)
