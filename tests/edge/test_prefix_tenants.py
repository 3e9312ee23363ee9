"""Prefix caches kept per tenant (docs/operations.md, "Tenants and limits",
"Prefix caches"): another tenant's identical prompt is a different
conversation to the edge's affinity and prefix index, and a different
``cache_salt`` to the backend, unless the config says the tenants share.

The keys and salts are checked directly; where runs go is checked on an
edge core with two nodes over in-memory links, in virtual time.
"""

from __future__ import annotations

import hashlib
from typing import Final

import msgspec
import pytest
import trio
import trio.testing

from iop.config import EdgeConfig, TenancySettings, TenantSettings
from iop.edge import EdgeCore, open_edge_core
from iop.edge.scheduler import affinity_key
from iop.edge.scheduler._prefix import prompt_blocks
from iop.edge.tenancy._tenants import Tenants
from iop.events import CancelReason
from iop.runtime import Run
from iop.spec import ChatRequest, CompletionRequest, ExecutionSpec, Message
from tests.edge.test_core import FakeNode, caps, config, connect, drain_events

KEY_A: Final = "key-of-tenant-alice"
KEY_B: Final = "key-of-tenant-bob"
SECRET: Final = "You are the support agent of ACME; the refund code is 7731. " * 12


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def two_tenants(share: bool = False) -> list[TenantSettings]:
    return [
        TenantSettings(name="alice", key_sha256=[sha(KEY_A)], share_prefix_cache=share),
        TenantSettings(name="bob", key_sha256=[sha(KEY_B)], share_prefix_cache=share),
    ]


def chat(system: str = SECRET, user: str = "hi", **extra: object) -> ChatRequest:
    return ChatRequest(
        model="m",
        messages=[Message(role="system", content=system), Message(role="user", content=user)],
        extra_body=dict(extra) or None,
    )


# --- keys and salts ------------------------------------------------------------------


def test_two_tenants_identical_prompts_get_distinct_keys_blocks_and_salts() -> None:
    tenants = Tenants(two_tenants(), (), TenancySettings())
    alice, bob = tenants.all["alice"], tenants.all["bob"]
    request = chat()
    salt_a, salt_b = tenants.cache_salt(alice, request), tenants.cache_salt(bob, request)
    assert salt_a
    assert salt_b
    assert salt_a != salt_b
    # vLLM's advice for a salt: 256 bits, 43 characters of base64
    # (https://github.com/vllm-project/vllm/pull/17045); nothing of the
    # tenant's name in it.
    assert len(salt_a) == 43
    assert "alice" not in salt_a
    assert tenants.cache_salt(alice, chat(user="another turn")) == salt_a

    assert affinity_key(request, salt_a) != affinity_key(request, salt_b)
    blocks_a, blocks_b = prompt_blocks(request, 64, salt_a), prompt_blocks(request, 64, salt_b)
    assert len(blocks_a) == len(blocks_b) >= 10
    assert not set(blocks_a) & set(blocks_b)
    # Within a tenant, a conversation is still one conversation.
    later = ChatRequest(
        model="m",
        messages=[
            *request.messages,
            Message(role="assistant", content="Hello."),
            Message(role="user", content="And the refund code?"),
        ],
    )
    assert affinity_key(later, salt_a) == affinity_key(request, salt_a)
    assert prompt_blocks(later, 64, salt_a)[: len(blocks_a)] == blocks_a
    # A completion prompt and an explicit session (``user``) are scoped too.
    prompt = CompletionRequest(model="m", prompt=SECRET)
    assert affinity_key(prompt, salt_a) != affinity_key(prompt, salt_b)
    session = ChatRequest(model="m", messages=[Message(role="user", content="x")], user="u1")
    assert affinity_key(session, salt_a) != affinity_key(session, salt_b)


def test_tenants_that_share_get_the_unscoped_keys_and_no_salt() -> None:
    tenants = Tenants(two_tenants(share=True), (), TenancySettings())
    request = chat()
    for name in ("alice", "bob"):
        salt = tenants.cache_salt(tenants.all[name], request)
        assert salt == ""
        assert affinity_key(request, salt) == affinity_key(request)
        assert prompt_blocks(request, 64, salt) == prompt_blocks(request, 64)


def test_one_tenant_edges_send_no_salt_and_default_is_isolated_among_tenants() -> None:
    request = chat()
    open_edge = Tenants((), (), TenancySettings())
    assert open_edge.cache_salt(open_edge.all["anonymous"], request) == ""
    keys_only = Tenants((), ("operator-key",), TenancySettings())
    assert keys_only.cache_salt(keys_only.all["default"], request) == ""
    mixed = Tenants(two_tenants(), ("operator-key",), TenancySettings())
    default = mixed.cache_salt(mixed.all["default"], request)
    assert default
    assert default != mixed.cache_salt(mixed.all["alice"], request)


def test_the_salt_is_the_same_on_every_edge_and_a_key_changes_it() -> None:
    request = chat()
    key = TenancySettings(cache_salt_key="a-shared-secret-of-the-edges")
    one, two = Tenants(two_tenants(), (), key), Tenants(two_tenants(), (), key)
    assert one.cache_salt(one.all["alice"], request) == two.cache_salt(two.all["alice"], request)
    other = Tenants(two_tenants(), (), TenancySettings(cache_salt_key="another-secret-entirely"))
    assert other.cache_salt(other.all["alice"], request) != one.cache_salt(
        one.all["alice"], request
    )
    # Without a key every edge (and a restarted one) derives the same salts,
    # from a public key: still one per tenant, and not the keyed ones.
    fresh, again = (
        Tenants(two_tenants(), (), TenancySettings()),
        Tenants(two_tenants(), (), TenancySettings()),
    )
    unkeyed = fresh.cache_salt(fresh.all["alice"], request)
    assert unkeyed == again.cache_salt(again.all["alice"], request)
    assert unkeyed != fresh.cache_salt(fresh.all["bob"], request)
    assert unkeyed != one.cache_salt(one.all["alice"], request)


def test_a_clients_own_salt_is_folded_into_its_tenants() -> None:
    """A client's ``cache_salt`` still splits its own tenant's cache, and can
    never name another tenant's (or the unsalted) namespace."""
    tenants = Tenants(two_tenants(), (), TenancySettings())
    alice, bob = tenants.all["alice"], tenants.all["bob"]
    plain = tenants.cache_salt(alice, chat())
    mine = tenants.cache_salt(alice, chat(cache_salt="session-1"))
    assert mine not in ("", plain, "session-1")
    assert tenants.cache_salt(alice, chat(cache_salt="session-2")) != mine
    assert tenants.cache_salt(alice, chat(cache_salt="session-1")) == mine
    # Bob sending Alice's salt as his own gets a salt of his own.
    assert tenants.cache_salt(bob, chat(cache_salt=plain)) not in (plain, mine)


# --- where runs go ----------------------------------------------------------------------


def tenant_config(share: bool, **sched: object) -> EdgeConfig:
    base = config()
    return msgspec.structs.replace(
        base,
        tenants=two_tenants(share),
        scheduler=msgspec.structs.replace(base.scheduler, max_queue=8, **sched),  # type: ignore[arg-type]
    )


def start(core: EdgeCore, name: str, run_id: str) -> Run:
    tenant = core.tenants.all[name]
    ticket = core.tenants.admit(tenant, 10, trio.current_time())
    return core.start_run(ExecutionSpec(run_id=run_id, request=chat()), ticket=ticket)


async def place_guess(core: EdgeCore, a: FakeNode, b: FakeNode) -> tuple[str, str, list[Run]]:
    """Alice's prompt, then Bob's identical guess: the node of each."""
    runs = [start(core, "alice", "r-alice")]
    await trio.testing.wait_all_tasks_blocked()
    runs.append(start(core, "bob", "r-bob"))
    await trio.testing.wait_all_tasks_blocked()
    where = {r: ("a" if r in a.assigned else "b") for r in ("r-alice", "r-bob")}
    return where["r-alice"], where["r-bob"], runs


PLACEMENTS: Final = [
    pytest.param({"placement": "least_loaded"}, id="affinity"),
    pytest.param({"placement": "prefix"}, id="prefix"),
]


@pytest.mark.parametrize("sched", PLACEMENTS)
async def test_another_tenants_guess_is_not_drawn_to_the_warm_instance(
    autojump_clock: trio.testing.MockClock, sched: dict[str, object]
) -> None:
    async with open_edge_core(tenant_config(False, **sched)) as core, trio.open_nursery() as n:
        a = await connect(core, n, [caps(slots=4)], "a")
        b = await connect(core, n, [caps(slots=4)], "b")
        alice_at, bob_at, runs = await place_guess(core, a, b)
        # Alice's instance is busier, and nothing of Bob's is cached there.
        assert bob_at != alice_at
        placed = runs[1].timeline.placements[0]
        assert placed.why != "affinity"
        if placed.scores:
            assert placed.scores[f"{alice_at}/i0"] < placed.scores[f"{bob_at}/i0"]
        # The backends are told to keep the two apart.
        salts = {}
        for node in (a, b):
            while True:
                try:
                    got = node.assigns.receive_nowait()
                except trio.WouldBlock:
                    break
                salts[got.assign.run_id] = got.assign.spec.cache_salt
        tenants = core.tenants
        assert salts == {
            "r-alice": tenants.cache_salt(tenants.all["alice"], chat()),
            "r-bob": tenants.cache_salt(tenants.all["bob"], chat()),
        }
        assert salts["r-alice"]
        assert salts["r-bob"]
        assert salts["r-alice"] != salts["r-bob"]
        for r in runs:
            r.cancel(CancelReason.CLIENT_DISCONNECT)
            await drain_events(r)
        n.cancel_scope.cancel()


@pytest.mark.parametrize("sched", PLACEMENTS)
async def test_tenants_that_share_follow_each_others_prefixes(
    autojump_clock: trio.testing.MockClock, sched: dict[str, object]
) -> None:
    async with open_edge_core(tenant_config(True, **sched)) as core, trio.open_nursery() as n:
        a = await connect(core, n, [caps(slots=4)], "a")
        b = await connect(core, n, [caps(slots=4)], "b")
        alice_at, bob_at, runs = await place_guess(core, a, b)
        assert bob_at == alice_at
        for node in (a, b):
            while True:
                try:
                    assert node.assigns.receive_nowait().assign.spec.cache_salt == ""
                except trio.WouldBlock:
                    break
        for r in runs:
            r.cancel(CancelReason.CLIENT_DISCONNECT)
            await drain_events(r)
        n.cancel_scope.cancel()
