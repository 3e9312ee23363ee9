"""Several edges sharing their tenants' limits in Valkey (``[cluster]``).

Theory of operation. Each edge is stateless per request: what the edges
must agree on lives in one Valkey (or Redis) server, written only by the
Lua scripts of ``iop.edge.tenancy._cluster_scripts``, each one atomic on the server and one round trip:

* ``RESERVE`` at admission: refill the tenant's request and token buckets
  (the same token buckets as ``iop.edge.tenancy._tenants.Bucket``: capacity
  *limit*, refilled at *limit / 60* per second, full when absent), count
  the concurrency slots held by *live* edges, and take 1 request, the
  estimated tokens and a slot, all or nothing. The clock is the server's
  (``TIME``), so the edges' clocks need not agree.
* ``SETTLE`` when the run ends: give back (or charge further) the tokens
  the run did not use (or overran), release the slot.
* ``HEARTBEAT`` every third of ``membership_ttl_s``: refresh this edge's
  membership key (with a TTL) and count the live edges.
* ``BUDGET_RESERVE`` at admission of a tenant with budgets (``budget_per_day``,
  ``budget_per_month``): check every period's spend against its limit and
  add the estimated cost to each, all or nothing; ``BUDGET_SETTLE`` when
  the run ends adds what it cost beyond (or below) its reservation. A
  period's key expires a day after the period ends, so a new period starts
  at 0 (the edges name the periods by UTC date: their wall clocks must
  agree to within what a budget may overrun at a period's turn).

Keys (``P`` is ``key_prefix``)::

    P b:{tenant}   hash  rl, ra, tl, ta: the request and token buckets'
                         levels and when they were last written; expires
                         once the buckets would be full again
    P c:{tenant}   hash  edge id -> concurrency slots it holds
    P m:{edge id}  string, with TTL membership_ttl_s: the edge is live
    P members      sorted set edge id -> membership expiry (ms)
    P u:{tenant}:{period}  integer: micro-units spent and reserved in the
                         period (``2026-12-04``, ``2026-12``)

A slot cannot leak when an edge dies: ``RESERVE`` counts only the slots of
edges whose membership key exists and deletes the others, so a killed
edge's slots are free ``membership_ttl_s`` after its last heartbeat. Nor
when a reservation times out on a live edge (Valkey may have taken the slot
with no ticket here to release it), nor when a partition outlasts the
membership (the other edges drop the slots this edge still holds): once
Valkey answers again, ``RESYNC`` sets the edge's slots to the ones its
tickets hold. (The
scripts touch keys they are not passed, so this works on one Valkey, not on
a Valkey Cluster.)

Fail-open. A Valkey fault turns the edge to *local* buckets sized
*limit / live edges* (the last count the heartbeat saw), logs the
transition once (naming the script and the fault), sets
``iop_cluster_valkey_up`` to 0 and counts each admission so decided
(``iop_cluster_fail_open_total``). A fault is whatever keeps a script from
a usable answer, all mapped in ``_call``: an error reply, a socket error, a
round trip past ``command_timeout_s``, anything coredis raises (garbage
that is not RESP, say), and a reply of another shape than the script's
(each script's reply has one decoder in ``iop.edge.tenancy._cluster_replies``).
The next probe is ``retry_interval_s`` after the fault, on a fresh client:
a fault may leave a connection out of step (a timed-out command's reply
still to come, a reply that never ends), so the client and its pool are
dropped whole. A probe that succeeds turns the edge back to the shared
counters. No request is ever answered 5xx because of Valkey, and the edge
never stops for it. Settlements that could not be written wait (bounded)
and are written when Valkey is back; those of tickets admitted locally are
settled locally. The local share is kept across outages (its buckets go on
refilling), and sized anew only when the live edge count changed.

State. ``up`` (counting in Valkey, or on the local share) changes in two
places only: ``_came_up`` on a heartbeat's count, ``_went_down`` on a
fault. The loop (``run``) heartbeats at ``_next_beat``: every third of
``membership_ttl_s`` while up, every ``retry_interval_s`` while down, and
``_went_down`` brings it forward to ``retry_interval_s`` from the fault.

Session-affinity pins stay in each edge's memory (``iop.edge.scheduler._placement``):
a pin only picks the node with a warm prompt cache, a miss costs a cold
prefill, not a wrong answer, and sharing it would add a round trip to the
hot path (docs/operations.md, "Running several edges").
"""

from __future__ import annotations

import contextlib
import logging
import math
import secrets
import socket
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from functools import partial
from typing import Any, Final, TypeVar

import msgspec
import trio
from prometheus_client import CollectorRegistry, Counter, Gauge

from iop._extras import Extra, install_line
from iop.config import ClusterSettings, TenancySettings, TenantSettings
from iop.edge.tenancy._cluster_replies import (
    BadReply,
    Reservation,
    decode_budget,
    decode_done,
    decode_heartbeat,
    decode_reserve,
)
from iop.edge.tenancy._cluster_scripts import BUDGET_KEY_GRACE_S, SCRIPTS
from iop.edge.tenancy._tenants import (
    Limited,
    RateLimited,
    Tenant,
    Tenants,
    Ticket,
    Via,
    _human,
)
from iop.errors import ConfigError, InvariantError
from iop.events import Usage
from iop.ledger import period_end

__all__ = [
    "SharedLimits",
    "default_edge_id",
]

log = logging.getLogger("iop.edge.cluster")

# Settlements kept while Valkey is unreachable (each is a tenant name and two
# numbers): a minute of a busy edge; past it the oldest are dropped (their
# tokens stay charged, their slots are freed with the edge's membership).
MAX_PENDING_SETTLEMENTS: Final = 10_000

_T = TypeVar("_T")


def default_edge_id(port: int) -> str:
    """``hostname:port``; with no fixed port, ``hostname:`` and a random suffix."""
    host = socket.gethostname()
    return f"{host}:{port}" if port else f"{host}:{secrets.token_hex(4)}"


def limited(tenant: Tenant) -> bool:
    """Whether ``tenant`` has a limit to share (else admission is local and exact)."""
    return tenant.requests is not None or tenant.tokens is not None or tenant.max_concurrent > 0


class _Settlement(msgspec.Struct, frozen=True):
    tenant: str
    tpm: int
    give: float
    release: bool


class _BudgetSettlement(msgspec.Struct, frozen=True):
    keys: list[str]
    add: list[int]
    expire: list[int]


class SharedLimits:
    """The tenants' limits of every edge, in Valkey, with a local fail-open share.

    Args:
        settings: ``[cluster]`` (``valkey_url`` set).
        tenants: The edge's tenants (their settings and counters).
        tenant_settings: ``[[tenants]]``: the fail-open share is sized from them.
        tenancy: ``[tenancy]``.
        edge_id: This edge's id (``settings.edge_id`` or ``default_edge_id``).
        registry: The edge's metrics registry.
    """

    def __init__(
        self,
        settings: ClusterSettings,
        tenants: Tenants,
        tenant_settings: Sequence[TenantSettings],
        tenancy: TenancySettings,
        edge_id: str,
        registry: CollectorRegistry,
    ) -> None:
        self.settings = settings
        self.tenants = tenants
        self.edge_id = edge_id
        self._settings = list(tenant_settings)
        self._tenancy = tenancy
        self.up = False  # until the first heartbeat: the local share
        self.live_edges = 1
        self._share = self._local_share(1)
        self._share_edges = 1
        self._pending: deque[_Settlement] = deque()
        self._wake = trio.Event()
        self._changed = trio.Event()  # set, and replaced, when ``up`` changes
        self._scripts: dict[str, Any] = {}
        # When the loop next heartbeats (trio time); see the module docstring.
        self._next_beat = -math.inf
        # A fault was seen on the current client: the loop opens a fresh one.
        self._stale = False
        self._generation = 0  # of the current client
        p = settings.key_prefix
        self._members = f"{p}members"
        self._member = f"{p}m:{edge_id}"
        self.gauge_up = Gauge(
            "iop_cluster_valkey_up",
            "1 while this edge counts its tenants' limits in the shared Valkey, 0 while it "
            "uses its local share (limit / live edges).",
            registry=registry,
        )
        self.gauge_edges = Gauge(
            "iop_cluster_edges", "Live edges seen in Valkey (last count).", registry=registry
        )
        self.fail_open = Counter(
            "iop_cluster_fail_open",
            "Admissions decided by the local share because Valkey was unreachable.",
            registry=registry,
        )
        self.dropped = 0
        # The concurrency slots this edge holds in Valkey, per tenant: what
        # a resync writes back after a reservation timed out (it may have
        # been taken in Valkey with no ticket here to release it).
        self._held: dict[str, int] = {}
        self.last_limits: dict[str, tuple[Limited, ...]] = {}
        self._resync = False
        # Budget settlements not yet written (the same bound as the others).
        self._budget_pending: deque[_BudgetSettlement] = deque()

    # --- keys -----------------------------------------------------------------

    def _bucket_key(self, tenant: str) -> str:
        return f"{self.settings.key_prefix}b:{tenant}"

    def _slots_key(self, tenant: str) -> str:
        return f"{self.settings.key_prefix}c:{tenant}"

    def _scaled(self, edges: int) -> list[TenantSettings]:
        def share(limit: int) -> int:
            return max(1, math.ceil(limit / edges)) if limit else 0

        return [
            msgspec.structs.replace(
                t,
                requests_per_minute=share(t.requests_per_minute),
                tokens_per_minute=share(t.tokens_per_minute),
                max_concurrent_runs=share(t.max_concurrent_runs),
            )
            for t in self._settings
        ]

    def _local_share(self, edges: int) -> Tenants:
        return Tenants(self._scaled(edges), [], self._tenancy)

    def reconfigure(
        self, tenant_settings: Sequence[TenantSettings], tenancy: TenancySettings, now: float
    ) -> None:
        """A reloaded config's tenants (``Tenants.reconfigure`` says what stays):
        the limits sent to Valkey are read from the tenants at each admission;
        the local share is resized, keeping its levels."""
        self._settings = list(tenant_settings)
        self._tenancy = tenancy
        self._share.reconfigure(self._scaled(self.live_edges), [], tenancy, now=now)

    # --- admission ------------------------------------------------------------

    async def admit(self, tenant: Tenant, tokens: int, now: float) -> Ticket:
        """Admit one request of ``tenant`` reserving ``tokens``: one round trip.

        Raises:
            RateLimited: Over a limit (shared, or the local share while
                Valkey is unreachable): nothing is taken.
        """
        if not limited(tenant):
            return self.tenants.admit(tenant, tokens, now)
        if self.up:
            try:
                reply = await self._call(
                    "reserve",
                    [self._bucket_key(tenant.name), self._slots_key(tenant.name)],
                    [
                        self.edge_id,
                        tenant.requests.capacity if tenant.requests else 0,
                        tenant.tokens.capacity if tenant.tokens else 0,
                        tenant.max_concurrent,
                        tokens,
                        f"{self.settings.key_prefix}m:",
                    ],
                    partial(
                        decode_reserve,
                        requests=tenant.requests is not None,
                        tokens=tenant.tokens is not None,
                        concurrency=tenant.max_concurrent > 0,
                    ),
                )
            except _Fault as exc:
                self._went_down(exc)
            else:
                return self._decide(tenant, tokens, reply)
        self.fail_open.inc()
        share = self._share.all.get(tenant.name)
        if share is None:  # a tenant of api_keys: unlimited
            return self.tenants.admit(tenant, tokens, now)
        try:
            inner = self._share.admit(share, tokens, now)
        except RateLimited:
            tenant.refused += 1
            raise
        tenant.running += 1
        tenant.admitted += 1
        return Ticket(tenant, tokens, inner.limits, via=Via.FAIL_OPEN, inner=inner)

    def _hold(self, tenant: Tenant) -> bool:
        if not tenant.max_concurrent:
            return False
        self._held[tenant.name] = self._held.get(tenant.name, 0) + 1
        return True

    def _decide(self, tenant: Tenant, tokens: int, r: Reservation) -> Ticket:
        limits: list[Limited] = []
        if tenant.requests is not None:
            cap = tenant.requests.capacity
            limits.append(
                Limited("requests", cap, max(0, math.floor(r.requests_left)), r.requests_refill_s)
            )
        if tenant.tokens is not None:
            cap = tenant.tokens.capacity
            limits.append(
                Limited("tokens", cap, max(0, math.floor(r.tokens_left)), r.tokens_refill_s)
            )
        # What /admin shows for the tenant: the shared buckets as this edge
        # last saw them (its own Bucket objects are not used with a cluster).
        self.last_limits[tenant.name] = tuple(limits)
        if r.admitted:
            tenant.running += 1
            tenant.admitted += 1
            return Ticket(
                tenant,
                tokens,
                tuple(limits),
                via=Via.SHARED,
                holds_slot=self._hold(tenant),
            )
        tenant.refused += 1
        # decode_reserve saw to it that at least one applies.
        waits: list[tuple[float, str, str]] = []
        if r.concurrency_full and tenant.max_concurrent:
            waits.append(
                (
                    1.0,
                    "concurrency",
                    f"Rate limit reached for tenant {tenant.name}: {r.running} of "
                    f"{tenant.max_concurrent} concurrent runs in use.",
                )
            )
        wr, wt = r.requests_wait_s, r.tokens_wait_s
        if wr > 0 and tenant.requests is not None:
            waits.append(
                (
                    wr,
                    "requests",
                    f"Rate limit reached for tenant {tenant.name} on requests per minute: "
                    f"limit {tenant.requests.capacity}. Please try again in {_human(wr)}.",
                )
            )
        if wt != 0 and tenant.tokens is not None:
            cap = tenant.tokens.capacity
            if wt < 0:
                waits.append(
                    (
                        math.inf,
                        "tokens",
                        f"Request too large for tenant {tenant.name} on tokens per minute: "
                        f"limit {cap}, requested {tokens} (the prompt's estimate plus "
                        "max_tokens). Lower max_tokens or shorten the prompt.",
                    )
                )
            else:
                waits.append(
                    (
                        wt,
                        "tokens",
                        f"Rate limit reached for tenant {tenant.name} on tokens per minute: "
                        f"limit {cap}, requested {tokens}. "
                        f"Please try again in {_human(wt)}.",
                    )
                )
        wait, limit, message = max(waits)
        raise RateLimited(message, limit=limit, retry_after_s=wait, limits=tuple(limits))

    def finish(self, ticket: Ticket, usage: Usage | None, now: float) -> None:
        """Settle ``ticket`` where it was reserved; a second call does nothing.

        A shared settlement is written by ``run`` (this is called from the
        run supervisor's callback, which cannot wait)."""
        if ticket.via is Via.LOCAL:
            self.tenants.finish(ticket, usage, now)
            return
        if ticket.settled:
            return
        ticket.settled = True
        tenant = ticket.tenant
        tenant.running -= 1
        if usage is not None:
            tenant.tokens_in += usage.input_tokens
            tenant.tokens_out += usage.output_tokens
        if ticket.via is Via.FAIL_OPEN:
            assert ticket.inner is not None
            self._share.finish(ticket.inner, usage, now)
            return
        give = 0.0
        if usage is not None and tenant.tokens is not None:
            give = ticket.reserved_tokens - (usage.input_tokens + usage.output_tokens)
        if ticket.holds_slot:
            self._held[tenant.name] -= 1
        if give == 0 and not ticket.holds_slot:
            return
        if len(self._pending) >= MAX_PENDING_SETTLEMENTS:
            self._pending.popleft()
            self.dropped += 1
        tpm = tenant.tokens.capacity if tenant.tokens is not None else 0
        self._pending.append(_Settlement(tenant.name, tpm, give, ticket.holds_slot))
        self._wake.set()

    # --- Valkey ---------------------------------------------------------------

    async def _call(
        self,
        which: str,
        keys: list[str],
        args: list[Any],
        decode: Callable[[object], _T],
    ) -> _T:
        """One script, within ``command_timeout_s``, its reply decoded.

        The one place Valkey's faults are mapped: whatever keeps the script
        from a usable answer is ``_Fault``, and the client is marked stale
        (see the module docstring). Cancellation is no fault: it propagates.
        """
        script, generation = self._scripts[which], self._generation
        try:
            with trio.fail_after(self.settings.command_timeout_s):
                reply = await script(keys=keys, args=args)
            return decode(reply)
        except Exception as exc:
            # coredis turns a cancellation that lands while it sets up a
            # connection into its ConnectionError (docs/architecture.md,
            # "coredis"): this task cancelled is no Valkey fault.
            await trio.lowlevel.checkpoint_if_cancelled()
            if isinstance(exc, trio.TooSlowError):
                reason = "no answer in command_timeout_s"
            elif isinstance(exc, BadReply):
                reason = f"a reply of the wrong shape: {exc}"
            else:
                # coredis's RedisError (an error reply; its ProtocolError on
                # bytes that are not RESP), OSError, the anyio stream errors
                # of a connection torn down under a command, RuntimeError
                # from a client whose pool was dropped: all the same here.
                reason = f"{type(exc).__name__}: {exc}"
            current = generation == self._generation
            if current:
                self._stale = True
            raise _Fault(f"{which}: {reason}", current=current) from exc

    def _went_down(self, exc: _Fault) -> None:
        # Once back, rewrite this edge's slots: a reservation may have been
        # taken unanswered, and a partition longer than membership_ttl_s
        # lets the other edges drop the slots this edge still holds.
        self._resync = True
        if not exc.current:
            return
        # The next probe: retry_interval_s from the fault, whatever was due.
        self._next_beat = trio.current_time() + self.settings.retry_interval_s
        self._wake.set()
        if self._share_edges != self.live_edges:
            self._share = self._local_share(self.live_edges)
            self._share_edges = self.live_edges
        if self.up:
            self.up = False
            self._changed.set()
            self._changed = trio.Event()
            self.gauge_up.set(0)
            log.warning(
                "cluster: Valkey failed (%s): limits fail open to this edge's share "
                "(limit / %d live edges) until it is back",
                exc,
                self.live_edges,
            )

    def _came_up(self, edges: int) -> None:
        self.live_edges = edges
        self.gauge_edges.set(edges)
        self._next_beat = trio.current_time() + self.settings.membership_ttl_s / 3
        if not self.up:
            self.up = True
            self._changed.set()
            self._changed = trio.Event()
            self.gauge_up.set(1)
            log.info("cluster: Valkey reachable: shared limits across %d live edges", edges)

    def _client(self) -> Callable[[], contextlib.AbstractAsyncContextManager[None]]:
        """A factory of fresh clients, each installing its scripts while open."""
        try:
            import coredis
            from coredis.retry import NoRetryPolicy
        except ImportError as exc:
            raise ConfigError(
                f"cluster.valkey_url needs the Valkey client: {install_line(Extra.CLUSTER)}"
            ) from exc
        s = self.settings

        @contextlib.asynccontextmanager
        async def fresh() -> AsyncIterator[None]:
            client = coredis.Redis.from_url(
                s.valkey_url,
                retry_policy=NoRetryPolicy(),
                connect_timeout=s.connect_timeout_s,
                stream_timeout=s.command_timeout_s,
            )
            async with client:
                self._scripts = {n: client.register_script(t) for n, t in SCRIPTS.items()}
                self._generation += 1
                self._stale = False
                yield

        return fresh

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep the membership, write settlements, probe Valkey while down.

        Started in the edge core's nursery; returns only when cancelled,
        after leaving the cluster while Valkey answers (a shielded last
        round trip, bounded by ``command_timeout_s``)."""
        fresh = self._client()
        slots = [self._slots_key(t.name) for t in self._settings]
        leave = [self._member, self._members, *slots]
        self.gauge_up.set(0)
        try:
            async with fresh():
                try:
                    # A restarted edge of the same id holds nothing yet;
                    # then, before the first request, count the edges.
                    await self._call("leave", leave, [self.edge_id], decode_done)
                    edges = await self._call("heartbeat", *self._beat(), decode_heartbeat)
                except _Fault as exc:
                    self._went_down(exc)
                    log.warning(
                        "cluster: Valkey failed at start (%s): limits fail open to this edge's "
                        "share until it is back",
                        exc,
                    )
                else:
                    self._came_up(edges)
                task_status.started()
                await self._loop()
            while True:  # a fresh client after each fault
                async with fresh():
                    await self._loop()
        finally:
            # On a client of its own (the loop's is cancelled with it), and
            # only while Valkey answers: else the membership's TTL frees the
            # slots, and stopping need not wait command_timeout_s for it.
            with trio.move_on_after(self.settings.command_timeout_s) as cleanup:
                cleanup.shield = True
                if self.up:
                    async with fresh():
                        with contextlib.suppress(_Fault):
                            await self._call("leave", leave, [self.edge_id], decode_done)

    def _beat(self) -> tuple[list[str], list[Any]]:
        ttl_ms = math.ceil(self.settings.membership_ttl_s * 1000)
        return [self._member, self._members], [self.edge_id, ttl_ms]

    async def _loop(self) -> None:
        """Heartbeat, flush, resync; return once a fault made the client stale."""
        while not self._stale:
            if trio.current_time() >= self._next_beat:
                await self._heartbeat()
                continue
            if self.up:
                await self._flush()
            if self.up:
                await self._flush_budgets()
            if self.up and self._resync and not self._pending:
                await self._write_held()
            # A fault in either set _wake: no wait, the while sees it.
            with trio.move_on_at(self._next_beat):
                await self._wake.wait()
            self._wake = trio.Event()

    async def _heartbeat(self) -> None:
        """Refresh the membership and count the live edges (up or down)."""
        try:
            edges = await self._call("heartbeat", *self._beat(), decode_heartbeat)
        except _Fault as exc:
            self._went_down(exc)
        else:
            self._came_up(edges)

    async def _flush(self) -> None:
        while self._pending and self.up:
            item = self._pending[0]
            try:
                await self._call(
                    "settle",
                    [self._bucket_key(item.tenant), self._slots_key(item.tenant)],
                    [self.edge_id, item.tpm, item.give, 1 if item.release else 0],
                    decode_done,
                )
            except _Fault as exc:
                # Written or not: it is retried, and the slots rewritten after.
                self._went_down(exc)
                return
            self._pending.popleft()

    # --- budgets ----------------------------------------------------------------

    def _budget_key(self, tenant: str, period_key: str) -> str:
        return f"{self.settings.key_prefix}u:{tenant}:{period_key}"

    async def reserve_budget(self, ticket: Ticket, cost: int, wall: float, now: float) -> None:
        """Reserve ``cost`` from the budgets of ``ticket``'s tenant, in Valkey
        (every edge's spend); while Valkey is unreachable, from this edge's
        own view (``Tenants.check_budget``). Call before the rate limits
        take anything: a refusal here takes nothing.

        Raises:
            RateLimited: A budget is spent or cannot hold ``cost``.
        """
        tenant = ticket.tenant
        if self.up:
            budgets = list(tenant.budgets.values())
            keys = [self._budget_key(tenant.name, b.roll(wall)) for b in budgets]
            expire = [math.ceil(period_end(b.period, wall)) + BUDGET_KEY_GRACE_S for b in budgets]
            try:
                ok, spent = await self._call(
                    "budget_reserve",
                    keys,
                    [cost, *(b.limit for b in budgets), *expire],
                    partial(decode_budget, periods=len(budgets)),
                )
            except _Fault as exc:
                self._went_down(exc)
            else:
                for b, value in zip(budgets, spent, strict=True):
                    # What /admin shows: the shared spend as last seen.
                    b.spent = value
                if not ok:
                    # Refused by the shared spend: the same message as alone.
                    self.tenants.check_budget(tenant, cost, wall, now)
                    raise InvariantError("a budget Valkey refused fits its own spend")
                ticket.reserved_micros = cost
                ticket.periods = {b.period: b.key for b in budgets}
                ticket.budget_shared = True
                return
        self.tenants.check_budget(tenant, cost, wall, now)
        self.tenants.take_budget(ticket, cost, wall)

    def settle_budget(self, ticket: Ticket, cost: int | None, wall: float) -> None:
        """Settle a reservation of ``reserve_budget`` to the run's ``cost``
        (None: it stands); written by ``run`` (this cannot wait)."""
        if not ticket.budget_shared:
            self.tenants.settle_budget(ticket, cost, wall)
            return
        tenant = ticket.tenant
        charged = ticket.reserved_micros if cost is None else cost
        keys: list[str] = []
        add: list[int] = []
        expire: list[int] = []
        for budget in tenant.budgets.values():
            reserved = ticket.periods.pop(budget.period, None)
            if reserved is None:
                continue
            key = budget.roll(wall)
            delta = charged - ticket.reserved_micros if reserved == key else charged
            if delta:
                budget.spent += delta
                keys.append(self._budget_key(tenant.name, key))
                add.append(delta)
                expire.append(math.ceil(period_end(budget.period, wall)) + BUDGET_KEY_GRACE_S)
        if not keys:
            return
        if len(self._budget_pending) >= MAX_PENDING_SETTLEMENTS:
            self._budget_pending.popleft()
            self.dropped += 1
        self._budget_pending.append(_BudgetSettlement(keys, add, expire))
        self._wake.set()

    async def _flush_budgets(self) -> None:
        while self._budget_pending and self.up:
            item = self._budget_pending[0]
            try:
                await self._call("budget_settle", item.keys, [*item.add, *item.expire], decode_done)
            except _Fault as exc:
                self._went_down(exc)
                return
            self._budget_pending.popleft()

    async def _write_held(self) -> None:
        """Set this edge's slots in Valkey to the ones it holds (after a
        reservation timed out: it may hold one in Valkey that no ticket
        will release). A reservation in flight meanwhile is counted once
        it is answered: at worst one slot is under-counted until it ends."""
        names = [t.name for t in self._settings if t.max_concurrent_runs]
        try:
            await self._call(
                "resync",
                [self._slots_key(n) for n in names],
                [self.edge_id, *(self._held.get(n, 0) for n in names)],
                decode_done,
            )
        except _Fault as exc:
            self._went_down(exc)
            return
        self._resync = False

    async def wait_until(self, *, up: bool) -> None:
        """Return once the edge counts in Valkey (``up``) or on its local
        share (not ``up``); the caller puts the deadline on it."""
        while self.up is not up:
            await self._changed.wait()

    @property
    def pending(self) -> int:
        """Settlements not yet written to Valkey."""
        return len(self._pending) + len(self._budget_pending)

    def tenant_limits(self, tenants: list[dict[str, object]]) -> None:
        """Put the shared buckets' last seen state into ``Tenants.snapshot``'s rows."""
        for row in tenants:
            seen = self.last_limits.get(str(row["name"]))
            if seen is not None:
                row["limits"] = {
                    lim.kind: {"limit": lim.limit, "remaining": lim.remaining} for lim in seen
                }

    def snapshot(self) -> dict[str, object]:
        """For ``/admin``: the cluster's state as this edge sees it."""
        return {
            "edge_id": self.edge_id,
            "valkey_up": self.up,
            "live_edges": self.live_edges,
            "pending_settlements": len(self._pending),
            "dropped_settlements": self.dropped,
        }


class _Fault(Exception):
    """Valkey gave a script no usable answer (``SharedLimits._call``).

    ``current``: on the client in use (a fault of a client already dropped
    fails its own call, and changes no state)."""

    def __init__(self, reason: str, *, current: bool) -> None:
        super().__init__(reason)
        self.current = current
