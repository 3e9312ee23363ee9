"""Placement: which instance a run goes to, among those with a free slot.

``Placement.pick`` chooses among the instances that serve the run's model
and its operation (``Capabilities.operations``: chat, completion, embedding,
tokenize) and have a free slot (``in_flight < max_concurrency``), by
``[scheduler] placement``: ``least_loaded`` (the default) takes the least
loaded one, unless the run's conversation was served before by an instance
that still has a free slot: then it goes there again (session affinity, so
the backend's prefix cache holds the prompt's head; see ``affinity_key``; a
conversation is its tenant's alone unless tenants share their caches);
``prefix`` scores each by the share of the prompt it is expected to hold
(``iop.edge.scheduler._prefix``), minus its load, minus the room the rest
of the prompt takes in its cache (``PrefixIndex.fill``), plus affinity;
``random`` is a baseline. Runs of sheddable objectives hold at most an
instance's slots but its reserve (``reserved_slot_fraction`` of them,
rounded down: ``reserve``): while they hold that many, the other slots are
for runs that may not be shed, which thus find one free at once as long as
fewer of them than the reserve run. *Overflow seats* (``pick_overflow``,
``priority_overflow_slots``): a run of an objective that may not be shed
that finds no free slot may take a seat beyond an instance's slots when the
instance's engine preempts by priority (it advertises ``engine_priority``)
and holds sheddable runs of a lower objective priority: at most the key's
seats beyond its slots and never more seats beyond them than such runs held
there, so the engine always has a lower run to preempt for each (docs/operations.md, "Engine
priority"). Nothing here waits: when no instance has a free slot the
scheduler queues the run (``iop/edge/scheduler/_scheduler.py``).

Waiters are kept by what they wait for (model, operation, excluded nodes),
each group in arrival order: a pick that fails for a group's oldest waiter
fails for all of them (they need a free slot on the same candidates), so a
dispatch costs one pick per group and per slot handed out, not one per
waiter. With one FIFO scanned whole, every finished run cost a pick for
each of up to ``max_queue`` waiters, and an overloaded edge spent its CPU
there.

Load reports (``iop.edge.runs._nodes.ReportedLoad``): placement scores an
instance by the larger of the edge's own count and the node's in-flight
plus queued, plus the engine's waiting requests (``Placement.occupancy``);
with ``prefix`` placement the engine's KV-cache usage costs ``kv_weight``.
A report is a hint and only orders the candidates: a free slot is still the
edge's own count, so a report older than ``load_stale_s`` (ignored: the
edge's own count again), a missing one, or an absurd one (clamped) can
never make an instance look full and hold runs back; the node's own
admission (``iop.node._slots``) refuses what it cannot take, and the run
fails over (docs/operations.md, "How a run is placed"). Reading stale or
missing metrics as saturation is the failure this avoids: llm-d's router
scored such endpoints as full, and when metrics collection failed across
the fleet it stopped dispatching altogether
(https://github.com/llm-d/llm-d-router/pull/2165).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Final, NamedTuple

import trio

from iop.config import SchedulerSettings
from iop.edge.scheduler._prefix import PrefixIndex, prompt_blocks
from iop.edge.scheduler._queue import Excluded
from iop.spec import OperationRequest

if TYPE_CHECKING:
    from iop.edge.runs._nodes import InstanceState, NodeConnection, NodeRegistry

__all__ = ["PLACEMENT_CANDIDATES_KEPT", "HomeWait", "Placed", "Placement"]

# Candidates a placement keeps for the run's timeline: every instance of a
# cluster of a few nodes; a bigger one's timeline must not grow with it.
PLACEMENT_CANDIDATES_KEPT: Final = 32


class Placed(NamedTuple):
    """Where a run goes (its slot already counted), why, and what was weighed."""

    conn: NodeConnection
    inst: InstanceState
    why: str
    scores: dict[str, float]
    candidates: list[tuple[str, str, int, int]]


class HomeWait(NamedTuple):
    """A run worth holding for its prefix's homes (``prefix_wait_s``): they
    hold ``prefix_wait_share`` of its prompt or more, and none can take it
    now (no free slot, or the balance rule sends it away)."""

    homes: frozenset[tuple[str, str]]
    why: str


def _least_loaded(
    free: list[tuple[NodeConnection, InstanceState]],
    preferred: tuple[str, str] | None,
    occupancy: Callable[[InstanceState], float],
) -> tuple[NodeConnection, InstanceState, str]:
    """The conversation's instance if it is free, else the least loaded one."""
    best: tuple[float, NodeConnection, InstanceState] | None = None
    for conn, inst in free:
        if preferred == (conn.node_id, inst.caps.instance):
            # The instance that served this conversation before: its
            # prefix cache likely holds the prompt's head.
            return conn, inst, "affinity"
        load = occupancy(inst) / max(inst.caps.max_concurrency, 1)
        if best is None or load < best[0]:
            best = (load, conn, inst)
    assert best is not None
    _, conn, inst = best
    return conn, inst, "least-loaded"


class Placement:
    """Least-loaded, prefix-aware or random placement over the node registry."""

    def __init__(self, registry: NodeRegistry, settings: SchedulerSettings) -> None:
        self.registry = registry
        self.settings = settings
        # Conversation key -> (node, instance) that last served it; LRU-bounded.
        self._affinity: OrderedDict[str, tuple[str, str]] = OrderedDict()
        # What each instance's prefix cache probably holds (``placement = "prefix"``).
        # What an engine's count may lack is what was routed since it was
        # taken; a count older than load_stale_s is not used.
        self.prefixes = PrefixIndex(
            settings.prefix_index_bytes,
            settings.load_stale_s,
            count_slack_s=settings.prefix_count_slack_s,
            demand_half_life=settings.prefix_demand_half_life,
            trim_share=settings.prefix_trim_share,
        )
        self._random = random.Random()
        # Replicas made, and dropped as their prefix's demand fell (``_tend_homes``).
        self.replicas_made = 0
        self.replicas_dropped = 0

    def occupancy(self, inst: InstanceState, now: float) -> float:
        """The runs ``inst`` is busy with, as placement scores it.

        The larger of the edge's own count and the node's reported in-flight
        plus queued runs (the node may serve other edges), plus the engine's
        waiting requests; a report older than ``load_stale_s`` counts as
        none (the edge's own count), engine figures older than that too.
        """
        own = float(inst.in_flight)
        rep = inst.reported
        stale = self.settings.load_stale_s
        if rep is None or now - rep.at > stale:
            return own
        load = max(own, float(rep.in_flight + rep.queued))
        if rep.waiting is not None and now - rep.engine_at <= stale:
            load += rep.waiting
        return load

    def kv_usage(self, inst: InstanceState, now: float) -> float:
        """The engine's reported KV-cache usage (0 when unknown or stale)."""
        rep = inst.reported
        stale = self.settings.load_stale_s
        if rep is None or rep.kv_usage is None or now - min(rep.at, rep.engine_at) > stale:
            return 0.0
        return rep.kv_usage

    def is_stale(self, inst: InstanceState, now: float) -> bool:
        """Whether ``inst``'s report, or the engine figures in it, are too old
        to be used (``iop_load_stale_instances``); never reported: False."""
        rep = inst.reported
        if rep is None:
            return False
        stale = self.settings.load_stale_s
        if now - rep.at > stale:
            return True
        has_engine = rep.running is not None or rep.waiting is not None or rep.kv_usage is not None
        return has_engine and now - rep.engine_at > stale

    def stale_instances(self) -> int:
        """Instances whose load report is ignored as stale right now."""
        now = trio.current_time()
        return sum(1 for _, inst in self.registry.instances() if self.is_stale(inst, now))

    def candidates(
        self, model: str, exclude: Excluded = frozenset(), operation: str = "chat"
    ) -> Iterator[tuple[NodeConnection, InstanceState]]:
        """Instances that may run ``operation`` on ``model``: live, neither
        draining nor drained, not excluded, up, and advertising the operation."""
        drained = self.registry.drained
        for conn, inst in self.registry.instances():
            if conn.draining or conn.node_id in exclude or conn.node_id in drained:
                continue
            if exclude and (conn.node_id, inst.caps.instance) in exclude:
                continue  # its backend failed this run before any output
            if not inst.usable:
                continue
            if model in inst.caps.targets and inst.caps.serves(operation):
                yield conn, inst

    def prompt_blocks(self, request: OperationRequest, scope: str = "") -> list[bytes]:
        """``request``'s prompt blocks in ``scope`` (the run's cache salt)
        when placement looks at them, else none."""
        if self.settings.placement != "prefix":
            return []
        return prompt_blocks(request, self.settings.prefix_block_chars, scope)

    def reserve(self, inst: InstanceState) -> int:
        """The slots of ``inst`` sheddable runs may not hold."""
        return int(self.settings.reserved_slot_fraction * inst.caps.max_concurrency)

    def fits(self, inst: InstanceState, sheddable: bool) -> bool:
        """Whether ``inst`` has a free slot for a run (a sheddable one: and
        sheddable runs hold fewer than its slots but its reserve)."""
        if inst.free <= 0:
            return False
        limit = inst.caps.max_concurrency - self.reserve(inst)
        return not sheddable or inst.sheddable_in_flight < limit

    def pick(
        self,
        model: str,
        exclude: Excluded,
        affinity: str | None = None,
        operation: str = "chat",
        prefix: Sequence[bytes] = (),
        *,
        sheddable: bool = False,
        hold: bool = False,
        homes: frozenset[tuple[str, str]] = frozenset(),
    ) -> Placed | HomeWait | None:
        """The instance for a run, its slot counted (``in_flight``), or None
        when no candidate has a free slot (for a ``sheddable`` run, beyond
        the instance's reserve).

        With ``hold``, for a run worth holding for its prefix's homes
        (``prefix_wait_s``) that would go elsewhere now: a home's free slot
        if one has one (the balance rule aside), else ``HomeWait``, nothing
        counted. With ``homes`` (a run held for them): only those, by
        score, the balance rule aside.
        """
        pool = list(self.candidates(model, exclude, operation))
        if homes:
            pool = [(c, i) for c, i in pool if (c.node_id, i.caps.instance) in homes]
        free = [(conn, inst) for conn, inst in pool if self.fits(inst, sheddable)]
        wait = self._home_wait(pool, prefix) if hold else None
        if not free:
            return wait
        # As plain tuples: the timeline's JSON formats them, when someone looks.
        candidates = [
            (c.node_id, i.caps.instance, i.in_flight, i.caps.max_concurrency)
            for c, i in free[:PLACEMENT_CANDIDATES_KEPT]
        ]
        preferred = self._affinity.get(affinity) if affinity is not None else None
        placement = self.settings.placement
        scores: dict[str, float] = {}
        if placement == "random":
            conn, inst = self._random.choice(free)
            why = "random"
        elif placement == "prefix":
            conn, inst, why, scores = self._by_prefix(free, prefix, preferred, balance=not homes)
            if wait is not None and (conn.node_id, inst.caps.instance) not in wait.homes:
                # A home with a free slot that the balance rule found too
                # busy takes it now: that is the slot a held run would take.
                at_home = [(c, i) for c, i in free if (c.node_id, i.caps.instance) in wait.homes]
                if not at_home:
                    return wait
                conn, inst, why, _ = self._by_prefix(at_home, prefix, preferred, balance=False)
                why += "; its home, the balance rule aside (scheduler.prefix_wait_s)"
        else:
            now = trio.current_time()
            conn, inst, why = _least_loaded(free, preferred, lambda i: self.occupancy(i, now))
        inst.in_flight += 1
        where = (conn.node_id, inst.caps.instance)
        if affinity is not None:
            self._remember(affinity, where)
        if prefix:
            # The runs in flight, this one counted: with the prompts' shares,
            # how many runs each prefix keeps busy (``PrefixIndex.runs``).
            busy = sum(i.in_flight for _, i in self.registry.instances())
            self.prefixes.routed(where, prefix, trio.current_time(), busy)
            if placement == "prefix":
                self._tend_homes(model, operation, prefix)
        return Placed(conn, inst, why, scores, candidates)

    def pick_overflow(
        self, model: str, exclude: Excluded, operation: str, rank: int
    ) -> Placed | None:
        """An overflow seat for a run of objective priority ``rank`` that may
        not be shed and found no free slot, its seat counted (``in_flight``
        and ``overflow_in_flight``), or None (module docstring).

        The bound is on the seats beyond the slots (``in_flight`` past
        ``max_concurrency``), not on the runs once placed on overflow
        seats: when a lower run ends, an overflow run holds one of the slots,
        and the engine (a batch of the slots) has a lower run to pause for
        each seat beyond them as long as there are no more of those than
        lower runs. Among the instances that have one, the one with the most
        lower runs per seat beyond its slots: the most to preempt."""
        cap = self.settings.priority_overflow_slots
        if cap <= 0:
            return None
        best: tuple[float, NodeConnection, InstanceState, int] | None = None
        for conn, inst in self.candidates(model, exclude, operation):
            if not inst.caps.engine_priority:
                continue
            beyond = inst.in_flight - inst.caps.max_concurrency + 1  # with this one
            lower = sum(n for r, n in inst.sheddable_ranks.items() if r < rank)
            if beyond > min(cap, lower):
                continue
            room = lower / max(beyond, 1)
            if best is None or room > best[0]:
                best = (room, conn, inst, lower)
        if best is None:
            return None
        _, conn, inst, lower = best
        inst.in_flight += 1
        inst.overflow_in_flight += 1
        beyond = inst.in_flight - inst.caps.max_concurrency
        why = (
            f"overflow: every slot busy; {beyond} of at most {min(cap, lower)} beyond "
            f"{inst.caps.max_concurrency} slots, for the engine to preempt one of {lower} "
            "lower-priority sheddable run(s)"
        )
        candidates = [
            (conn.node_id, inst.caps.instance, inst.in_flight - 1, inst.caps.max_concurrency)
        ]
        return Placed(conn, inst, why, {}, candidates)

    def _home_wait(
        self, candidates: list[tuple[NodeConnection, InstanceState]], prefix: Sequence[bytes]
    ) -> HomeWait | None:
        """The instances a run is worth holding for (``HomeWait``): those
        expected to hold ``prefix_wait_share`` of its prompt or more."""
        s = self.settings
        if s.placement != "prefix" or not prefix or s.prefix_wait_s <= 0:
            return None
        homes: list[tuple[str, str]] = []
        shares: list[str] = []
        for conn, inst in candidates:
            where = (conn.node_id, inst.caps.instance)
            share = self.prefixes.matched(where, prefix) / len(prefix)
            if share >= s.prefix_wait_share:
                homes.append(where)
                shares.append(
                    f"{where[0]}/{where[1]} ({share:.0%} of the prompt, "
                    f"{inst.in_flight}/{inst.caps.max_concurrency} in flight)"
                )
        if not homes:
            return None
        why = (
            f"waits up to {s.prefix_wait_s:g}s (scheduler.prefix_wait_s) for a slot on its "
            f"prefix's home: {', '.join(shares[:8])}"
        )
        return HomeWait(frozenset(homes), why)

    def _tend_homes(self, model: str, operation: str, prefix: Sequence[bytes]) -> None:
        """Give the prompt's prefix another home, or take its newest replica
        away, as its demand wants (``PrefixIndex.homes_wanted``, on the
        slots of its first home): a replica goes where its copy evicts the
        least that matters and the load is lowest (the placement score's
        room and load terms, for a prompt held nowhere)."""
        s = self.settings
        homes = self.prefixes.homes(prefix)
        if not homes:
            return
        now = trio.current_time()
        others: list[tuple[tuple[str, str], InstanceState]] = []
        slots = 0
        for conn, inst in self.candidates(model, frozenset(), operation):
            where = (conn.node_id, inst.caps.instance)
            if where == homes[0]:
                slots = inst.caps.max_concurrency
            elif where not in homes:
                others.append((where, inst))
        if not slots:
            return  # its first home is gone or drained: it is placed anew
        want = self.prefixes.homes_wanted(
            prefix, slots, s.replica_load, s.replica_drop, s.replica_min_prompts
        )
        if want < len(homes):
            self.prefixes.drop_home(prefix)
            self.replicas_dropped += 1
            return
        if want <= len(homes) or not others:
            return
        fills = [self.prefixes.fill(where) for where, _ in others]
        known = [f for f in fills if f is not None]
        usual = sum(known) / len(known) if known else 0.0

        def score(k: int) -> float:
            inst = others[k][1]
            fill = fills[k]
            return (
                -s.room_weight * (usual if fill is None else fill)
                - s.load_weight * self.occupancy(inst, now) / max(inst.caps.max_concurrency, 1)
                - s.kv_weight * self.kv_usage(inst, now)
            )

        # Ties go to the first candidate (the registry's order).
        best = max(range(len(others)), key=lambda k: (score(k), -k))
        if self.prefixes.add_home(prefix, others[best][0]):
            self.replicas_made += 1

    def _by_prefix(
        self,
        free: list[tuple[NodeConnection, InstanceState]],
        prefix: Sequence[bytes],
        preferred: tuple[str, str] | None,
        *,
        balance: bool = True,
    ) -> tuple[NodeConnection, InstanceState, str, dict[str, float]]:
        """The best scored candidate: the expected cached share of the prompt,
        minus its load, minus the share it lacks times how full its cache is
        with what matters, plus affinity (weights in ``[scheduler]``); or,
        when that one is too much busier than the idlest, the best scored of
        those that are not (the idlest always is).

        The balance rule weighs the instance the score chose against the
        idlest, not the busiest against the idlest (SGLang's cache-aware
        router's rule), and in shares of their slots (load, as the score
        has it), not in runs: one hot instance elsewhere is no reason to
        send a prompt away from the instance that holds its prefix, at the
        price of a whole prefill there and a second copy of the prefix in
        the caches; and 4 runs more is a pile on 8 slots but not on 64
        (docs/benchmarks.md, "Placement: prefix-aware against least-loaded").
        """
        s = self.settings
        now = trio.current_time()
        # Each candidate's load: its occupancy (the edge's count, or the
        # node's fresh report when larger) over its slots.
        loads = [self.occupancy(inst, now) / max(inst.caps.max_concurrency, 1) for _, inst in free]
        wheres = [(conn.node_id, inst.caps.instance) for conn, inst in free]
        # How full each cache is with what matters; an instance whose size
        # is not reported is taken as full as the others on average.
        fills = [self.prefixes.fill(where) for where in wheres] if prefix else []
        known = [f for f in fills if f is not None]
        usual = sum(known) / len(known) if known else 0.0
        homes = self.prefixes.homes(prefix)
        scores: dict[str, float] = {}
        raw: list[float] = []
        best: tuple[float, int, NodeConnection, InstanceState] | None = None
        idlest: int | None = None
        for i, (conn, inst) in enumerate(free):
            where = wheres[i]
            matched = self.prefixes.matched(where, prefix) / len(prefix) if prefix else 0.0
            home = where in homes
            # A replica that holds none of the prompt yet is where its runs
            # go when its homes are full or too busy (a miss either way):
            # its room was weighed when it was chosen.
            cold = home and matched == 0.0
            load = loads[i]
            if idlest is None or load < loads[idlest]:
                idlest = i
            # The homes' copies go first (their load decides among them):
            # another copy, made while they were busy, serves only while
            # they are busy.
            home_bonus = s.home_weight if home else 0.0
            score = (
                (s.prefix_weight + home_bonus) * matched
                - s.load_weight * load
                - s.kv_weight * self.kv_usage(inst, now)
            )
            if prefix and not cold:
                # The blocks it lacks evict what its cache holds, in
                # proportion to how full that is with what matters.
                fill = fills[i]
                score -= s.room_weight * (1.0 - matched) * (usual if fill is None else fill)
            if where == preferred:
                score += s.affinity_weight
            scores[f"{where[0]}/{where[1]}"] = round(score, 4)
            raw.append(score)
            # Ties go to the first candidate (the registry's order).
            if best is None or score > best[0]:
                best = (score, i, conn, inst)
        assert best is not None
        assert idlest is not None
        score, at, conn, inst = best
        least = loads[idlest]

        def too_busy(load: float) -> bool:
            return (
                load - least > s.balance_load_threshold and load > least * s.balance_rel_threshold
            )

        if balance and too_busy(loads[at]):
            idle = free[idlest][1]
            against = (
                f"in flight {self.occupancy(inst, now):g}/{inst.caps.max_concurrency} against "
                f"{self.occupancy(idle, now):g}/{idle.caps.max_concurrency}"
            )
            # The best scored of the candidates the rule lets be (the
            # idlest always is): another copy of the prefix, if one is not
            # too busy, before an instance that holds none of it.
            ok = [i for i in range(len(free)) if not too_busy(loads[i])]
            pick = max(ok, key=lambda i: (raw[i], -loads[i], -i))
            if raw[pick] <= raw[idlest]:
                pick = idlest
            conn, inst = free[pick]
            if pick == idlest:
                return conn, inst, f"least-loaded: {against}", scores
            return conn, inst, f"balance: {against}; best of the rest", scores
        why = f"prefix: best score {score:.3f} of {len(free)}"
        if wheres[at] in homes and prefix and not self.prefixes.matched(wheres[at], prefix):
            why += "; warms a new replica"
        return conn, inst, why, scores

    def _remember(self, key: str, where: tuple[str, str]) -> None:
        self._affinity[key] = where
        self._affinity.move_to_end(key)
        while len(self._affinity) > self.settings.affinity_entries:
            self._affinity.popitem(last=False)

    def could_serve(self, model: str, exclude: Excluded, operation: str = "chat") -> bool:
        """Whether any node outside ``exclude`` serves ``operation`` on ``model``
        (free or busy)."""
        return any(True for _ in self.candidates(model, exclude, operation))

    def has_room(self, model: str, operation: str = "chat", sheddable: bool = False) -> bool:
        """Whether an instance serving ``operation`` on ``model`` has a free
        slot (for a ``sheddable`` run, beyond its reserve)."""
        return any(
            self.fits(inst, sheddable) for _, inst in self.candidates(model, operation=operation)
        )
