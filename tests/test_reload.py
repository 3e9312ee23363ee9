"""The reload plan (iop._reload), as a table: which keys a file changes, which
are applied live and which wait for a restart, and what the process runs with.

And the rules' bookkeeping: every key of every config has a rule, and
docs/configuration.md ("Reloading") lists exactly the rules the code has.
"""

from __future__ import annotations

import copy
import re
import typing
from pathlib import Path
from typing import Any

import msgspec
import pytest

from iop._reload import (
    EDGE_RULES,
    NODE_RULES,
    UP_RULES,
    Apply,
    ReloadOutcome,
    changed_keys,
    managed_instances,
    plan_reload,
    rule_for,
)
from iop.config import EdgeConfig, NodeConfig, UpConfig, decode_config
from iop.errors import ConfigError

LIVE, RESTART = Apply.LIVE, Apply.RESTART
DIGEST_A = "a" * 64
DIGEST_B = "b" * 64
DIGEST_C = "c" * 64

EDGE: dict[str, Any] = {
    "server": {"api_keys": ["iop-operator-key"], "port": 8080},
    "link": {"node_tokens": ["iop-node-token-1"]},
    "tenants": [
        {"name": "alice", "key_sha256": [DIGEST_A], "requests_per_minute": 10},
        {"name": "bob", "key_sha256": [DIGEST_B]},
    ],
}
NODE: dict[str, Any] = {
    "node": {"id": "n1", "edges": [{"url": "ws://edge:8080/v1/link", "token": "t" * 12}]},
    "instances": [
        {"adapter": "vllm", "name": "a", "endpoint": "http://a:8000"},
        {"adapter": "sim", "name": "b"},
    ],
}


def merged(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``patch`` laid over it (tables merged, other values replaced)."""
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def edge(patch: dict[str, Any] | None = None) -> EdgeConfig:
    return decode_config(merged(EDGE, patch or {}), EdgeConfig, source="edge.toml")


def node(patch: dict[str, Any] | None = None) -> NodeConfig:
    return decode_config(merged(NODE, patch or {}), NodeConfig, source="node.toml")


def _tenant(name: str, digest: str, **limits: object) -> dict[str, Any]:
    return {"name": name, "key_sha256": [digest], **limits}


EDGE_TABLE: list[tuple[str, dict[str, Any], list[str], list[str]]] = [
    ("nothing", {}, [], []),
    ("a client key", {"server": {"api_keys": ["iop-other-key-1"]}}, ["server.api_keys"], []),
    ("an admin key", {"server": {"admin_keys": ["iop-admin-key-1"]}}, ["server.admin_keys"], []),
    ("the drain timeout", {"server": {"drain_timeout_s": 3.0}}, ["server.drain_timeout_s"], []),
    ("the port", {"server": {"port": 9000}}, [], ["server.port"]),
    ("a body limit", {"server": {"max_body_bytes": 1024}}, [], ["server.max_body_bytes"]),
    ("a node token", {"link": {"node_tokens": ["iop-node-token-2"]}}, ["link.node_tokens"], []),
    ("the heartbeat", {"link": {"heartbeat_interval_s": 0.5}}, [], ["link.heartbeat_interval_s"]),
    ("the link's port", {"link": {"port": 0}}, [], ["link.port"]),
    ("a weight", {"scheduler": {"load_weight": 2.0}}, ["scheduler.load_weight"], []),
    ("the queue", {"scheduler": {"max_queue": 10}}, ["scheduler.max_queue"], []),
    ("the placement", {"scheduler": {"placement": "prefix"}}, ["scheduler.placement"], []),
    (
        "the prefix index",
        {"scheduler": {"prefix_index_bytes": 1024}},
        [],
        ["scheduler.prefix_index_bytes"],
    ),
    (
        "the demand's half-life",
        {"scheduler": {"prefix_demand_half_life": 64}},
        [],
        ["scheduler.prefix_demand_half_life"],
    ),
    ("a replica key", {"scheduler": {"replica_load": 0.5}}, ["scheduler.replica_load"], []),
    ("a deadline", {"deadlines": {"idle_timeout_s": 5.0}}, ["deadlines.idle_timeout_s"], []),
    ("the store", {"responses": {"store_ttl_s": 5.0}}, [], ["responses.store_ttl_s"]),
    ("the timeline ring", {"timelines": {"recent": 5}}, [], ["timelines.recent"]),
    ("the stalls kept", {"timelines": {"max_stalls": 5}}, ["timelines.max_stalls"], []),
    ("tracing", {"tracing": {"sample_ratio": 0.5}}, [], ["tracing.sample_ratio"]),
    ("an output policy", {"models": {"*": {"strict": True}}}, ["models"], []),
    (
        "the default max_tokens",
        {"tenancy": {"default_max_tokens": 10}},
        ["tenancy.default_max_tokens"],
        [],
    ),
    ("the cluster", {"cluster": {"key_prefix": "x:"}}, [], ["cluster.key_prefix"]),
    (
        "a tenant's limit",
        {"tenants": [_tenant("alice", DIGEST_A, requests_per_minute=20), _tenant("bob", DIGEST_B)]},
        ["tenants[alice].requests_per_minute"],
        [],
    ),
    (
        "a tenant added and one removed",
        {
            "tenants": [
                _tenant("alice", DIGEST_A, requests_per_minute=10),
                _tenant("carol", DIGEST_C),
            ]
        },
        ["tenants[bob] (removed)", "tenants[carol] (added)"],
        [],
    ),
    (
        "a tenant's key rotated",
        {"tenants": [_tenant("alice", DIGEST_C, requests_per_minute=10), _tenant("bob", DIGEST_B)]},
        ["tenants[alice].key_sha256"],
        [],
    ),
    (
        "the tenants' order",
        {"tenants": [_tenant("bob", DIGEST_B), _tenant("alice", DIGEST_A, requests_per_minute=10)]},
        ["tenants (order)"],
        [],
    ),
    (
        "live and restart keys at once",
        {"server": {"port": 1, "api_keys": ["iop-other-key-1"]}, "scheduler": {"affinity": False}},
        ["scheduler.affinity", "server.api_keys"],
        ["server.port"],
    ),
]


@pytest.mark.parametrize(
    ("patch", "applied", "restart"),
    [case[1:] for case in EDGE_TABLE],
    ids=[case[0] for case in EDGE_TABLE],
)
def test_edge_plan(patch: dict[str, Any], applied: list[str], restart: list[str]) -> None:
    running, new = edge(), edge(patch)
    plan = plan_reload(running, new, EDGE_RULES)
    assert sorted(plan.applied) == sorted(applied)
    assert list(plan.restart_required) == restart
    # What runs: the file's live keys, the running value of the others.
    assert changed_keys(new, plan.config) == restart
    assert changed_keys(running, plan.config) == list(plan.applied)
    for key in restart:
        field = key.split("[")[0]
        value: Any = running
        for name in field.split("."):
            value = getattr(value, name)
        got: Any = plan.config
        for name in field.split("."):
            got = getattr(got, name)
        assert got == value


NODE_TABLE: list[tuple[str, dict[str, Any], list[str], list[str]]] = [
    ("nothing", {}, [], []),
    (
        "an instance added",
        {"instances": [*NODE["instances"], {"adapter": "sim", "name": "c"}]},
        ["instances[c] (added)"],
        [],
    ),
    ("an instance removed", {"instances": NODE["instances"][:1]}, ["instances[b] (removed)"], []),
    (
        "an instance's endpoint and capacity",
        {
            "instances": [
                {
                    "adapter": "vllm",
                    "name": "a",
                    "endpoint": "http://a2:8000",
                    "max_concurrency": 2,
                },
                NODE["instances"][1],
            ]
        },
        ["instances[a].endpoint", "instances[a].max_concurrency"],
        [],
    ),
    (
        "an instance's adapter",
        {
            "instances": [
                {"adapter": "openai_compat", "name": "a", "endpoint": "http://a:8000"},
                NODE["instances"][1],
            ]
        },
        ["instances[a]"],
        [],
    ),
    ("the reconnect delay", {"node": {"reconnect_max_s": 9.0}}, ["node.reconnect_max_s"], []),
    ("the probe interval", {"node": {"probe_interval_s": 1.0}}, ["node.probe_interval_s"], []),
    ("the node's id", {"node": {"id": "n2"}}, [], ["node.id"]),
    (
        "the node's edges",
        {"node": {"edges": [{"url": "ws://other:8080/v1/link", "token": "t" * 12}]}},
        [],
        ["node.edges"],
    ),
    ("the frame limit", {"node": {"max_frame_bytes": 65536}}, [], ["node.max_frame_bytes"]),
    ("tracing", {"tracing": {"sample_ratio": 0.5}}, [], ["tracing.sample_ratio"]),
]


@pytest.mark.parametrize(
    ("patch", "applied", "restart"),
    [case[1:] for case in NODE_TABLE],
    ids=[case[0] for case in NODE_TABLE],
)
def test_node_plan(patch: dict[str, Any], applied: list[str], restart: list[str]) -> None:
    running, new = node(), node(patch)
    plan = plan_reload(running, new, NODE_RULES)
    assert sorted(plan.applied) == sorted(applied)
    assert list(plan.restart_required) == restart
    assert changed_keys(new, plan.config) == restart


def test_a_backend_the_node_runs_itself_waits_for_a_restart_and_the_rest_applies() -> None:
    llm = {"adapter": "llamacpp", "name": "llm"}
    running = node({"instances": [*NODE["instances"], llm]})
    new = node(
        {
            "instances": [
                {"adapter": "vllm", "name": "a", "endpoint": "http://a2:8000"},  # b removed
                {**llm, "ctx": 2048},
                {"adapter": "llamacpp", "name": "llm2"},
            ]
        }
    )
    restart = managed_instances(running, new)
    assert restart == ["instances[llm]", "instances[llm2]"]
    plan = plan_reload(running, new, NODE_RULES, restart=restart)
    assert plan.applied == ("instances[a].endpoint", "instances[b] (removed)")
    assert plan.restart_required == ("instances[llm2] (added)", "instances[llm].ctx")
    # What runs: a's new endpoint, no b, llm as it runs, no llm2.
    assert [i.name for i in plan.config.instances] == ["a", "llm"]
    assert plan.config.instances[0] == new.instances[0]
    assert plan.config.instances[1] == running.instances[2]
    # A managed instance removed from the file stays until a restart.
    gone = node()
    plan = plan_reload(running, gone, NODE_RULES, restart=managed_instances(running, gone))
    assert plan.restart_required == ("instances[llm] (removed)",)
    assert plan.config == running


def test_up_plan_keeps_its_node_token_and_its_embedded_backend() -> None:
    running = decode_config({"edge": EDGE}, UpConfig, source="up.toml")
    new = decode_config(
        {
            "edge": merged(EDGE, {"link": {"node_tokens": ["iop-node-token-2"]}}),
            "instances": [{"adapter": "sim", "name": "s"}],
        },
        UpConfig,
        source="up.toml",
    )
    # Serving its embedded backend: [[instances]] wait for a restart too.
    plan = plan_reload(running, new, UP_RULES, restart=("instances",))
    assert plan.applied == ()
    assert plan.restart_required == ("edge.link.node_tokens", "instances[s] (added)")
    assert plan.config == running
    # Serving [[instances]]: they change live.
    assert plan_reload(running, new, UP_RULES).applied == ("instances[s] (added)",)


def test_a_file_whose_live_keys_do_not_fit_the_running_ones_is_refused() -> None:
    # Three tenants need a store of at least three entries: the file grows
    # both, but the store's size waits for a restart.
    running = edge({"responses": {"store_max_entries": 2}, "server": {"api_keys": []}})
    new = edge(
        {
            "responses": {"store_max_entries": 3},
            "server": {"api_keys": []},
            "tenants": [*EDGE["tenants"], _tenant("carol", DIGEST_C)],
        }
    )
    with pytest.raises(
        ConfigError, match=r"responses\.store_max_entries needs a restart.*less than the 3 tenants"
    ):
        plan_reload(running, new, EDGE_RULES)


def test_the_outcome_says_what_changed_and_never_a_value() -> None:
    plan = plan_reload(edge(), edge({"server": {"api_keys": ["iop-secret-key-9"]}}), EDGE_RULES)
    outcome = ReloadOutcome.of(plan, "edge.toml")
    text = msgspec.json.encode(outcome).decode() + outcome.describe()
    assert "server.api_keys" in text
    assert "iop-secret-key-9" not in text
    assert outcome.status == "applied"
    assert ReloadOutcome.of(plan_reload(edge(), edge(), EDGE_RULES), "f").status == "unchanged"
    refused = ReloadOutcome.refused("edge.toml", "edge.toml: unknown key 'x'")
    assert refused.describe().startswith("refused: edge.toml: unknown key 'x'")


# --- every key has a rule, and the docs list the rules ---------------------------------


def _leaf_keys(struct: type[Any], prefix: str = "") -> list[str]:
    """Every key of a config struct, nested structs' keys included."""
    out = []
    hints = typing.get_type_hints(struct)
    for field in msgspec.structs.fields(struct):
        key = f"{prefix}{field.name}"
        kind = hints[field.name]
        if isinstance(kind, type) and issubclass(kind, msgspec.Struct):
            out += _leaf_keys(kind, key + ".")
        else:
            out.append(key)
    return out


@pytest.mark.parametrize(
    ("struct", "rules"),
    [(EdgeConfig, EDGE_RULES), (NodeConfig, NODE_RULES), (UpConfig, UP_RULES)],
    ids=["edge", "node", "up"],
)
def test_every_key_has_a_rule(struct: type[Any], rules: dict[str, Apply]) -> None:
    keys = _leaf_keys(struct)
    assert len(keys) > 10
    for key in keys:
        rule_for(key, rules)  # raises KeyError if none covers it
    # And no rule names a key that does not exist.
    for rule in rules:
        assert any(k == rule or k.startswith(rule + ".") for k in keys), rule


CONFIG_DOC = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
_ROW = re.compile(r"^\| `([a-z_.]+)` \| (live|restart) \|")


def _documented(heading: str) -> dict[str, Apply]:
    """The rows of the reload table under ``heading`` in docs/configuration.md."""
    lines = CONFIG_DOC.read_text().splitlines()
    start = lines.index(heading)
    out: dict[str, Apply] = {}
    for line in lines[start + 1 :]:
        if line.startswith("#"):
            break
        m = _ROW.match(line)
        if m:
            out[m.group(1)] = Apply(m.group(2))
    return out


def test_the_docs_list_every_rule() -> None:
    assert _documented("### Edge keys on a reload") == EDGE_RULES
    assert _documented("### Node keys on a reload") == NODE_RULES
    up = _documented("### `iop up` keys on a reload")
    derived = {f"edge.{key}": how for key, how in EDGE_RULES.items()}
    assert {**derived, **up} == UP_RULES
