"""Reloading a config file while the process runs: which keys change live, and the plan.

Sans-IO: ``plan_reload`` is a pure function of the running config and the
file's new one, so the rules are tested as a table (tests/test_reload.py).
Reading the file, serialising reloads, applying the plan and logging it are
the caller's (``iop.cli._reloader``); docs/operations.md, "Reloading", says
what an operator sees.

Theory of operation
-------------------
A reload reads the whole file again and validates it exactly as a start does
(``iop.config``: unknown keys, bad values and cross-key rules are errors). A
file that fails changes nothing: the running config stays, and the error says
why. A valid file is *diffed* against the running config, key by key
(``changed_keys``): structs field by field; lists of named items
(``[[tenants]]``, ``[[instances]]``) item by item by name, so a change reads
``tenants[alice].requests_per_minute``, an item that came or went
``tenants[bob] (added)``; any other value as a whole (a list of keys is
named, never printed).

Every key is either **live** (the running process applies the new value: to
what starts after the reload; what is in flight keeps what it started with)
or needs a **restart** (the process holds it in something built once: a
listening socket, a buffer sized at start, a connection). The rule of a key
is its longest prefix in the rules table (``EDGE_RULES``, ``NODE_RULES``,
``UP_RULES``). A changed restart key is *not* applied: the plan's config
keeps its running value, and the key is named in ``restart_required``.
The config so merged is validated again (its cross-key rules may not hold
for a mix of new and running values); if it fails, the reload is refused.

The plan's ``config`` is then what the process runs with; applying it is
one synchronous step per process (``EdgeCore.apply_config``,
``NodeAgent.apply_config``), so no request ever sees half a reload.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Final, Generic, Literal, Protocol, TypeVar

import msgspec

from iop.config import LlamaCppInstance
from iop.errors import ConfigError

__all__ = [
    "EDGE_RULES",
    "NODE_RULES",
    "UP_RULES",
    "Apply",
    "ReloadOutcome",
    "ReloadPlan",
    "Reloading",
    "changed_keys",
    "managed_instances",
    "plan_reload",
    "rule_for",
]


class Apply(enum.Enum):
    """How a changed key takes effect."""

    LIVE = "live"  # applied by a reload (to what starts after it)
    RESTART = "restart"  # named by a reload, applied by a restart


LIVE: Final = Apply.LIVE
RESTART: Final = Apply.RESTART

Rules = Mapping[str, Apply]
"""Dotted key (no list indices) -> how it takes effect; the longest prefix wins."""

# The edge's keys. Restart: what is built once at start (the listeners and
# hypercorn's limits, the app's body limits and parsers, the link's frame
# limits and heartbeat clock, the prefix index, the response store, the
# timeline ring and export, the tracer, the Valkey connection).
EDGE_RULES: Final[Rules] = {
    "server": RESTART,
    "server.api_keys": LIVE,
    "server.admin_keys": LIVE,
    "server.metrics_keys": LIVE,
    "server.admin_session_s": LIVE,
    "server.admin_login_failures_per_minute": LIVE,
    "server.keepalive_interval_s": LIVE,
    "server.drain_timeout_s": LIVE,
    "server.tls_certfile": LIVE,
    "server.tls_keyfile": LIVE,
    "link": RESTART,
    "link.node_tokens": LIVE,
    "link.hello_timeout_s": LIVE,
    # The credential set is swapped whole; a removed one's links are closed
    # (EdgeCore.set_node_credentials).
    "link.nodes": LIVE,
    # Certificates are read again on every reload (EdgeCore.apply_config),
    # renewed in place or moved; turning TLS on or off needs a restart.
    "link.client_ca": LIVE,
    "scheduler": LIVE,
    "scheduler.prefix_block_chars": RESTART,
    "scheduler.prefix_index_bytes": RESTART,
    "scheduler.prefix_chars_per_token": RESTART,
    # The prefix index is built with them (Placement.__init__).
    "scheduler.prefix_demand_half_life": RESTART,
    "scheduler.prefix_count_slack_s": RESTART,
    "scheduler.prefix_trim_share": RESTART,
    "scheduler.load_stale_s": RESTART,
    "deadlines": LIVE,
    "responses": RESTART,
    "timelines": RESTART,
    "timelines.max_stalls": LIVE,
    "tracing": RESTART,
    "models": LIVE,
    "tenancy": LIVE,
    "tenants": LIVE,
    "cluster": RESTART,
    # The ledger's file and writer are opened once; prices only price the
    # runs that end after the reload.
    "usage": RESTART,
    "prices": LIVE,
    # Read at each run's admission (EdgeCore.queue_share).
    "objectives": LIVE,
    # The store and the runner are opened once (iop.edge.batches).
    "batches": RESTART,
}

# The node's keys. Restart: its id and edges (the links), the frame and
# backlog sizes and report rate (per link, told in the hello), the tracer.
NODE_RULES: Final[Rules] = {
    "node": RESTART,
    "node.reconnect_min_s": LIVE,
    "node.reconnect_max_s": LIVE,
    "node.probe_interval_s": LIVE,
    "node.drain_timeout_s": LIVE,
    "instances": LIVE,
    # The model manager is built once, from the models and groups at start.
    "models": RESTART,
    "model_groups": RESTART,
    "tracing": RESTART,
}

# ``iop up``: the edge's rules under ``edge.``, the node's ``[node]`` and
# ``[[instances]]``. Its node dials its edge with the first node token, so
# the tokens change with a restart; the embedded backend is started once.
UP_RULES: Final[Rules] = {
    **{f"edge.{key}": how for key, how in EDGE_RULES.items()},
    "edge.link.node_tokens": RESTART,
    **{key: how for key, how in NODE_RULES.items() if key.startswith("node")},
    "instances": LIVE,
    "models": RESTART,
    "model_groups": RESTART,
    "embedded": RESTART,
}


def _bare(path: str) -> str:
    """``tenants[bob].weight`` -> ``tenants.weight``; ``instances[x] (added)`` -> ``instances``."""
    out = []
    depth = 0
    for ch in path.split(" (", 1)[0]:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out)


def rule_for(path: str, rules: Rules) -> Apply:
    """How the key at ``path`` (as ``changed_keys`` names it) takes effect.

    Raises:
        KeyError: No rule covers it (every top-level key has one: a test checks).
    """
    key = _bare(path)
    while True:
        if key in rules:
            return rules[key]
        if "." not in key:
            raise KeyError(path)
        key = key.rsplit(".", 1)[0]


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _named(items: object) -> dict[str, Any] | None:
    """A list of structs that each have a unique ``name``, by name; else None."""
    if not isinstance(items, list) or not items:
        return None
    out: dict[str, Any] = {}
    for item in items:
        name = getattr(item, "name", None)
        if not isinstance(item, msgspec.Struct) or not isinstance(name, str) or name in out:
            return None
        out[name] = item
    return out


def changed_keys(old: object, new: object, path: str = "") -> list[str]:
    """The keys whose values differ between ``old`` and ``new`` (module docstring)."""
    if old == new:
        return []
    if isinstance(old, msgspec.Struct) and type(old) is type(new):
        out: list[str] = []
        for field in msgspec.structs.fields(old):
            out += changed_keys(
                getattr(old, field.name), getattr(new, field.name), _join(path, field.name)
            )
        return out
    before = _named(old) if old != [] else {}
    after = _named(new) if new != [] else {}
    if before is not None and after is not None and isinstance(old, list):
        out = [f"{path}[{name}] (removed)" for name in before if name not in after]
        out += [f"{path}[{name}] (added)" for name in after if name not in before]
        for name in before.keys() & after.keys():
            out += changed_keys(before[name], after[name], f"{path}[{name}]")
        if not out:
            out.append(f"{path} (order)")
        return sorted(out)
    return [path]


def managed_instances(running: object, new: object) -> list[str]:
    """``instances[NAME]`` of every ``llamacpp`` instance of either config: a
    backend the node runs itself is started once, with the node, so a change
    of one (added, removed, changed) waits for a restart (``plan_reload``'s
    ``restart``)."""
    names = {
        inst.name
        for config in (running, new)
        for inst in getattr(config, "instances", ())
        if isinstance(inst, LlamaCppInstance)
    }
    return [f"instances[{name}]" for name in sorted(names)]


def _forced(path: str, restart: Collection[str]) -> str | None:
    """The key of ``restart`` that covers ``path`` (a field, or one item of a
    named list: ``instances[llm]``), or None."""
    bare = _bare(path)
    for key in restart:
        if "[" in key:
            if path == key or path.startswith((key + ".", key + " (")):
                return key
        elif bare == key or bare.startswith(key + "."):
            return key
    return None


def _revert_items(running: list[Any], new: list[Any], names: set[str]) -> list[Any]:
    """``new`` with the items named ``names`` as they run: changed ones back to
    the running item, added ones left out, removed ones kept."""
    old = {item.name: item for item in running}
    out = [
        old[item.name] if item.name in names else item
        for item in new
        if item.name not in names or item.name in old
    ]
    present = {item.name for item in out}
    out += [old[name] for name in sorted(names) if name in old and name not in present]
    return out


def _get(config: object, path: str) -> object:
    for name in path.split("."):
        config = getattr(config, name)
    return config


def _set(config: Any, path: str, value: object) -> Any:
    """``config`` with the key at ``path`` (fields only) set to ``value``, validated."""
    head, _, rest = path.partition(".")
    inner = value if not rest else _set(getattr(config, head), rest, value)
    return msgspec.structs.replace(config, **{head: inner})


C = TypeVar("C")


@dataclass(frozen=True)
class ReloadPlan(Generic[C]):
    """What a valid file changes.

    Attributes:
        applied: Changed keys applied live.
        restart_required: Changed keys that need a restart (not applied).
        config: What the process runs with from now on: the file's config
            with every restart key at its running value.
    """

    applied: tuple[str, ...]
    restart_required: tuple[str, ...]
    config: C


def plan_reload(
    running: C, new: C, rules: Rules, *, restart: Collection[str] = ()
) -> ReloadPlan[C]:
    """The plan of reloading ``running`` with the file's ``new`` config.

    Args:
        running: The config the process runs with.
        new: The file's config, validated.
        rules: How each key takes effect.
        restart: Keys that need a restart here whatever ``rules`` say: a
            field (``iop up`` serving its embedded backend: ``instances``)
            or an item of a named list (``managed_instances``).

    Raises:
        ConfigError: The file's live keys do not validate together with the
            running values of its restart keys.
    """
    applied: list[str] = []
    restart_required: list[str] = []
    kept: dict[str, object] = {}
    kept_items: dict[str, set[str]] = {}
    for path in changed_keys(running, new):
        forced = _forced(path, restart)
        if forced is None and rule_for(path, rules) is not RESTART:
            applied.append(path)
            continue
        restart_required.append(path)
        # The key itself; in a named list, the item a forced key names, or
        # the whole list.
        field = path.split("[", 1)[0].split(" (", 1)[0]
        if forced is not None and "[" in forced:
            kept_items.setdefault(field, set()).add(forced.split("[", 1)[1].rstrip("]"))
        else:
            kept[field] = _get(running, field)
    for field, names in kept_items.items():
        if field not in kept:
            before, after = _get(running, field), _get(new, field)
            assert isinstance(before, list)
            assert isinstance(after, list)
            kept[field] = _revert_items(before, after, names)
    config = new
    for field, value in kept.items():
        try:
            config = _set(config, field, value)
        except (ValueError, msgspec.ValidationError) as exc:
            raise ConfigError(
                f"{field} needs a restart, and with its running value the new config is "
                f"invalid: {exc}"
            ) from exc
    return ReloadPlan(tuple(applied), tuple(restart_required), config)


class ReloadOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """What one reload did: the reply of ``POST /admin/reload``, and its log line.

    Attributes:
        status: ``applied`` (a live key changed), ``unchanged`` (nothing the
            process runs with changed, though keys that need a restart may
            have: ``restart_required``), ``refused`` (the file failed:
            nothing changed).
        source: The file read.
        applied: Keys applied live.
        restart_required: Keys changed in the file that need a restart: not
            applied, the running value stays.
        error: Why a refused file was refused (the file and key).
    """

    status: Literal["applied", "unchanged", "refused"]
    source: str
    applied: list[str] = []
    restart_required: list[str] = []
    error: str | None = None

    @classmethod
    def of(cls, plan: ReloadPlan[Any], source: str) -> ReloadOutcome:
        return cls(
            status="applied" if plan.applied else "unchanged",
            source=source,
            applied=list(plan.applied),
            restart_required=list(plan.restart_required),
        )

    @classmethod
    def refused(cls, source: str, error: str) -> ReloadOutcome:
        return cls(status="refused", source=source, error=error)

    def describe(self) -> str:
        """The outcome as one log line's message (after ``reload (VIA)``)."""
        if self.status == "refused":
            return f"refused: {self.error}; the running config is unchanged"
        parts = []
        if self.applied:
            parts.append("applied " + ", ".join(self.applied))
        if self.restart_required:
            parts.append("not applied until a restart: " + ", ".join(self.restart_required))
        return "; ".join(parts) or f"{self.source} is unchanged"


class Reloading(Protocol):
    """What serves ``POST /admin/reload`` (``iop.cli._reloader.Reloader``)."""

    async def reload(self, via: str) -> ReloadOutcome: ...
