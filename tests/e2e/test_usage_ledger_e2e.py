"""The usage ledger on real processes: what clients received, what the ledger holds.

docs/operations.md, "Usage and budgets". A few hundred mixed requests
(every surface, streamed and not, complete, failed, cancelled before and
after the first token) go through a real edge, node and sim at modest
concurrency; each category comes with a key of its own, so the ledger's
sums by key name are compared with what the clients were told:

* completed runs: the ledger's input and output tokens equal, exactly, the
  usage the clients received (the usage in each answer or final event);
* failed runs and runs cancelled before their first token: recorded, and
  charged nothing;
* runs cancelled after their first token: recorded, charged their prompt
  (the admission estimate) and at least the output the client read.

Then the same after a graceful restart (nothing lost) and after ``kill -9``:
every run the ledger had committed (its records counter, read before the
kill) is there, and of runs that ended within the last flush interval the
ledger holds a prefix, each row whole. A restarted edge restores the
tenant's spend of the month from the ledger.
"""

from __future__ import annotations

import hashlib
import math
import signal
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from iop.ledger import LedgerStore
from tests._valkey import Valkey
from tests.e2e._platform import MODEL, Edge, Procs, Sim, free_port, poll

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

OPERATOR: Final = "iop-e2e-usage-operator"
# The tenant default's key: what the harness lists models with.
CLIENT: Final = "iop-e2e-usage-client"
# Prices per million tokens: every run has a cost, in whole micro-units.
PRICES: Final = {MODEL: {"input": "0.5", "output": "1.5"}}
KEYS: Final = ("complete", "failed", "cancel-before", "cancel-after")
# 400 characters in one user message: ceil(400 / 4) + 4 = 104 tokens, the
# admission's estimate (docs/api.md, "count_tokens"): what a run cancelled
# after its first token is charged for its prompt.
PROMPT: Final = "abcd" * 100
PROMPT_ESTIMATE: Final = 104
CONCURRENCY: Final = 6


def _key(name: str) -> str:
    return f"iop-e2e-usage-{name}"


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _config(ledger: Path) -> dict[str, Any]:
    return {
        "server": {
            "keepalive_interval_s": 0.3,
            "drain_timeout_s": 5,
            "api_keys": [CLIENT],
            "admin_keys": [OPERATOR],
        },
        "usage": {"ledger_path": str(ledger), "flush_interval_s": 0.2},
        "prices": PRICES,
        "tenants": [
            {
                "name": "alpha",
                "keys": [{"sha256": _digest(_key(k)), "name": k} for k in KEYS],
                # Large: never reached, but reserved, settled and restored.
                "budget_per_month": 1000,
            },
            # An unnamed key: the ledger names it by its digest.
            {"name": "beta", "key_sha256": [_digest(_key("beta"))]},
        ],
    }


@dataclass
class Sent:
    key: str
    input_tokens: int = 0
    output_tokens: int = 0
    seen_output: int = 0  # chunks read before a cancel


# --- one request of each kind ---------------------------------------------------------------

SIM_SHORT: Final = {"iop_sim": {"output_tokens": 12}}
SIM_SLOW: Final = {"iop_sim": {"output_tokens": 400, "tokens_per_s": 40.0}}


def _messages() -> Any:
    return [{"role": "user", "content": PROMPT}]


def chat(edge: Edge, key: str, stream: bool) -> Sent:
    with openai.OpenAI(base_url=f"{edge.url}/v1", api_key=_key(key), max_retries=0) as c:
        if not stream:
            r = c.chat.completions.create(
                model=MODEL, messages=_messages(), max_tokens=12, extra_body=SIM_SHORT
            )
            assert r.usage is not None
            return Sent(key, r.usage.prompt_tokens, r.usage.completion_tokens)
        sent = Sent(key)
        for chunk in c.chat.completions.create(
            model=MODEL,
            messages=_messages(),
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=SIM_SHORT,
        ):
            if chunk.usage is not None:
                sent.input_tokens = chunk.usage.prompt_tokens
                sent.output_tokens = chunk.usage.completion_tokens
        return sent


def completion(edge: Edge, key: str, stream: bool) -> Sent:
    with openai.OpenAI(base_url=f"{edge.url}/v1", api_key=_key(key), max_retries=0) as c:
        if not stream:
            r = c.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=12, extra_body=SIM_SHORT
            )
            assert r.usage is not None
            return Sent(key, r.usage.prompt_tokens, r.usage.completion_tokens)
        sent = Sent(key)
        for chunk in c.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=SIM_SHORT,
        ):
            if chunk.usage is not None:
                sent.input_tokens = chunk.usage.prompt_tokens
                sent.output_tokens = chunk.usage.completion_tokens
        return sent


def messages(edge: Edge, key: str, stream: bool) -> Sent:
    with anthropic.Anthropic(base_url=edge.url, api_key=_key(key), max_retries=0) as c:
        if not stream:
            r = c.messages.create(model=MODEL, messages=_messages(), max_tokens=12)
            return Sent(key, r.usage.input_tokens, r.usage.output_tokens)
        with c.messages.stream(model=MODEL, messages=_messages(), max_tokens=12) as s:
            final = s.get_final_message()
        return Sent(key, final.usage.input_tokens, final.usage.output_tokens)


def responses(edge: Edge, key: str, stream: bool) -> Sent:
    with openai.OpenAI(base_url=f"{edge.url}/v1", api_key=_key(key), max_retries=0) as c:
        if not stream:
            r = c.responses.create(model=MODEL, input=PROMPT, max_output_tokens=16)
            assert r.usage is not None
            return Sent(key, r.usage.input_tokens, r.usage.output_tokens)
        sent = Sent(key)
        for event in c.responses.create(
            model=MODEL, input=PROMPT, max_output_tokens=16, stream=True
        ):
            if event.type == "response.completed":
                assert event.response.usage is not None
                sent.input_tokens = event.response.usage.input_tokens
                sent.output_tokens = event.response.usage.output_tokens
        return sent


def failed(edge: Edge, key: str, stream: bool) -> Sent:
    """The backend answers 500: the client gets an error, the tenant pays nothing."""

    def ask(c: openai.OpenAI) -> None:
        r = c.chat.completions.create(
            model=MODEL,
            messages=_messages(),
            max_tokens=12,
            stream=stream,
            extra_body={"iop_sim": {"failure": "http_500"}},
        )
        if stream:
            for _ in r:  # type: ignore[union-attr]
                pass

    with (
        openai.OpenAI(base_url=f"{edge.url}/v1", api_key=_key(key), max_retries=0) as c,
        pytest.raises(openai.APIError),
    ):
        ask(c)
    return Sent(key)


def cancel_before(edge: Edge, key: str, stream: bool) -> Sent:
    """The client hangs up before the backend's first token (the edge's
    opening chunk comes after keepalive_interval_s without output)."""
    del stream
    with (
        openai.OpenAI(base_url=f"{edge.url}/v1", api_key=_key(key), max_retries=0) as c,
        c.chat.completions.create(
            model=MODEL,
            messages=_messages(),
            max_tokens=12,
            stream=True,
            extra_body={"iop_sim": {"failure": "stall_before_first_byte"}},
        ) as s,
    ):
        first = next(iter(s))
        assert not first.choices[0].delta.content
    return Sent(key)


def cancel_after(edge: Edge, key: str, stream: bool) -> Sent:
    """The client hangs up after its first tokens: it pays for its prompt."""
    del stream
    sent = Sent(key, input_tokens=PROMPT_ESTIMATE)
    with (
        openai.OpenAI(base_url=f"{edge.url}/v1", api_key=_key(key), max_retries=0) as c,
        c.chat.completions.create(
            model=MODEL, messages=_messages(), max_tokens=400, stream=True, extra_body=SIM_SLOW
        ) as s,
    ):
        for chunk in s:
            if chunk.choices and chunk.choices[0].delta.content:
                sent.seen_output += 1
                if sent.seen_output == 2:
                    break
    return sent


Kind = Callable[[Edge, str, bool], Sent]
COMPLETE_KINDS: Final[tuple[Kind, ...]] = (chat, completion, messages, responses)


def plan(n: int) -> list[tuple[Kind, str, bool]]:
    """``n`` requests: mostly complete ones on every surface, streamed and not
    (half of them by the unnamed key of tenant beta), with every 10th failed,
    cancelled before or after its first token."""
    out: list[tuple[Kind, str, bool]] = []
    for i in range(n):
        stream = i % 2 == 0
        if i % 10 == 3:
            out.append((failed, "failed", stream))
        elif i % 10 == 6:
            out.append((cancel_before, "cancel-before", True))
        elif i % 10 == 9:
            out.append((cancel_after, "cancel-after", True))
        else:
            key = "complete" if i % 4 < 2 else "beta"
            out.append((COMPLETE_KINDS[i % len(COMPLETE_KINDS)], key, stream))
    return out


def send_all(edge: Edge, requests: list[tuple[Kind, str, bool]], workers: int) -> list[Sent]:
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda r: r[0](edge, r[1], r[2]), requests))


# --- the ledger and the edge's counters ------------------------------------------------------


def ledger_name(key: str) -> str:
    return f"sha256:{_digest(_key(key))[:12]}" if key == "beta" else key


def written(edge: Edge) -> int:
    for family in text_string_to_metric_families(edge.admin_get("/metrics").text):
        if family.name == "iop_usage_ledger_records":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    return int(sample.value)
    return 0


def wait_written(edge: Edge, n: int) -> None:
    edge.wait_no_runs(timeout=30)
    poll(lambda: written(edge) >= n, timeout=30, what=f"{n} runs in the ledger")
    assert written(edge) == n


def by_key(store_path: Path) -> dict[str, tuple[int, int, int]]:
    """(runs, input, output) by key name, read from the file."""
    store = LedgerStore(store_path, readonly=True)
    try:
        return {
            r.key_name: (r.runs, r.input_tokens, r.output_tokens)
            for r in store.report(("key_name",))
        }
    finally:
        store.close()


def check(store_path: Path, sent: list[Sent]) -> None:
    """The ledger holds every run of ``sent``, exactly as the clients saw it."""
    held = by_key(store_path)
    runs = Counter(s.key for s in sent)
    for key in ("complete", "beta"):
        mine = [s for s in sent if s.key == key]
        assert all(s.input_tokens > 0 and s.output_tokens > 0 for s in mine)
        assert held[ledger_name(key)] == (
            len(mine),
            sum(s.input_tokens for s in mine),
            sum(s.output_tokens for s in mine),
        )
    for key in ("failed", "cancel-before"):
        assert held[key] == (runs[key], 0, 0)
    n, tin, tout = held["cancel-after"]
    assert n == runs["cancel-after"]
    assert tin == PROMPT_ESTIMATE * n
    assert tout >= sum(s.seen_output for s in sent if s.key == "cancel-after")
    assert sum(h[0] for h in held.values()) == len(sent)
    # Every row is whole: it has its node, instance, outcome and cost.
    store = LedgerStore(store_path, readonly=True)
    try:
        rows = store.since(0)
    finally:
        store.close()
    assert {r.outcome for r in rows} == {"complete", "error", "cancelled"}
    assert all(r.node and r.instance and r.attempts >= 1 for r in rows if r.outcome != "error")
    for r in rows:
        assert r.cost_micros == math.ceil((r.input_tokens * 0.5 + r.output_tokens * 1.5) - 1e-9)


def month_spent(edge: Edge) -> int:
    resp = httpx.get(
        f"{edge.url}/admin/nodes", headers={"Authorization": f"Bearer {OPERATOR}"}, timeout=10
    )
    tenant = next(t for t in resp.json()["tenants"] if t["name"] == "alpha")
    spent: int = tenant["budgets"]["month"]["spent_micros"]
    return spent


def ledger_cost(store_path: Path, tenant: str) -> int:
    store = LedgerStore(store_path, readonly=True)
    try:
        return store.report(("tenant",), tenant=tenant)[0].cost_micros
    finally:
        store.close()


def usage_today(edge: Edge) -> dict[str, Any]:
    resp = httpx.get(
        f"{edge.url}/admin/usage?by=day",
        headers={"Authorization": f"Bearer {OPERATOR}"},
        timeout=10,
    )
    resp.raise_for_status()
    row: dict[str, Any] = resp.json()["rows"][-1]
    return row


@pytest.fixture
def sim(procs: Procs) -> Sim:
    return procs.sim("sim", "--tokens-per-s", "400")


def test_the_ledger_holds_what_clients_received_across_restarts(
    procs: Procs, sim: Sim, tmp_path: Path
) -> None:
    path = tmp_path / "usage.db"
    port = free_port()
    config = _config(path)
    edge = procs.edge(config, port=port, name="edge-1")
    procs.node([edge], sim, node_id="n1")
    edge.wait_ready(node_id="n1")

    first = send_all(edge, plan(200), CONCURRENCY)
    wait_written(edge, len(first))
    check(path, first)
    # /admin/usage serves the same sums as the file.
    usage = httpx.get(
        f"{edge.url}/admin/usage?by=key_name",
        headers={"Authorization": f"Bearer {OPERATOR}"},
        timeout=10,
    ).json()
    assert {
        r["key_name"]: (r["runs"], r["input_tokens"], r["output_tokens"]) for r in usage["rows"]
    } == by_key(path)
    spent = month_spent(edge)
    assert spent == ledger_cost(path, "alpha") > 0
    # The admin page plots today's tokens (one bar, so far).
    page = httpx.get(
        f"{edge.url}/admin", headers={"Authorization": f"Bearer {OPERATOR}"}, timeout=10
    ).text
    today = usage_today(edge)
    assert (
        f"<title>{today['day']}: {today['input_tokens'] + today['output_tokens']}</title>" in page
    )
    assert f"<title>{today['day']}: {today['cost']}</title>" in page

    # A graceful stop: nothing is lost, and the restarted edge has the month's spend.
    edge.proc.send(signal.SIGTERM)
    assert edge.proc.wait(20) == 0
    check(path, first)
    edge = procs.edge(config, port=port, name="edge-2")
    edge.wait_ready(node_id="n1")
    assert month_spent(edge) == spent

    # Committed runs survive a kill -9.
    second = send_all(edge, plan(60), CONCURRENCY)
    wait_written(edge, len(second))
    edge.proc.kill()
    check(path, first + second)

    # Runs that end within the flush interval before a kill -9 may be lost:
    # of ten sequential runs the ledger holds the first m, each whole.
    edge = procs.edge(config, port=port, name="edge-3")
    edge.wait_ready(node_id="n1")
    assert month_spent(edge) == ledger_cost(path, "alpha")
    last = [chat(edge, "beta", False) for _ in range(10)]
    edge.proc.kill()
    store = LedgerStore(path, readonly=True)
    try:
        rows = store.since(0)
    finally:
        store.close()
    tail = rows[len(first) + len(second) :]
    assert len(tail) <= len(last)
    assert [(r.input_tokens, r.output_tokens) for r in tail] == [
        (s.input_tokens, s.output_tokens) for s in last[: len(tail)]
    ]


def test_a_spent_budget_is_a_429_in_each_surfaces_shape(
    procs: Procs, sim: Sim, tmp_path: Path
) -> None:
    """A day's budget of 360 micro-units: one chat request reserving 352 (104
    prompt tokens at 0.5 and 200 output at 1.5 per million) fits; it costs at
    least 300 (its 200 output tokens), and then a reservation of 70 (12
    output tokens) does not fit, on any surface."""
    config = {
        "server": {"api_keys": [CLIENT], "admin_keys": [OPERATOR]},
        "usage": {"ledger_path": str(tmp_path / "usage.db")},
        "prices": PRICES,
        "tenants": [
            {
                "name": "thrifty",
                "key_sha256": [_digest(_key("thrifty"))],
                "budget_per_day": "0.00036",
            }
        ],
    }
    edge = procs.edge(config)
    procs.node([edge], sim, node_id="n1")
    edge.wait_ready(node_id="n1")
    key = _key("thrifty")
    with openai.OpenAI(base_url=f"{edge.url}/v1", api_key=key, max_retries=0) as oa:
        oa.chat.completions.create(
            model=MODEL,
            messages=_messages(),
            max_tokens=200,
            extra_body={"iop_sim": {"output_tokens": 200}},
        )
        edge.wait_no_runs()
        with pytest.raises(openai.RateLimitError) as chat_refused:
            oa.chat.completions.create(model=MODEL, messages=_messages(), max_tokens=12)
        with pytest.raises(openai.RateLimitError) as responses_refused:
            oa.responses.create(model=MODEL, input=PROMPT, max_output_tokens=16)
        with pytest.raises(openai.RateLimitError):
            oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12)
    with (
        anthropic.Anthropic(base_url=edge.url, api_key=key, max_retries=0) as an,
        pytest.raises(anthropic.RateLimitError) as messages_refused,
    ):
        an.messages.create(model=MODEL, messages=_messages(), max_tokens=12)
    for refused in (chat_refused, responses_refused):
        resp = refused.value.response
        assert resp.status_code == 429
        assert "Budget reached for tenant thrifty" in refused.value.message
        assert resp.json()["error"]["code"] == "rate_limit_exceeded"
        # Until the UTC day ends: at most a day.
        assert 1 <= int(resp.headers["retry-after"]) <= 86400
    body = messages_refused.value.response.json()
    assert body["type"] == "error"
    assert body["error"]["type"] == "rate_limit_error"
    assert "per day" in body["error"]["message"]
    # The tenant's spend is the one run's cost, as the ledger has it.
    poll(lambda: written(edge) == 1, timeout=10, what="the run in the ledger")
    spent = httpx.get(
        f"{edge.url}/admin/nodes", headers={"Authorization": f"Bearer {OPERATOR}"}, timeout=10
    ).json()["tenants"]
    (thrifty,) = [t for t in spent if t["name"] == "thrifty"]
    assert thrifty["budgets"]["day"] == {
        "limit_micros": 360,
        "spent_micros": ledger_cost(tmp_path / "usage.db", "thrifty"),
    }


def test_a_restart_keeps_the_minute_a_tenant_has_used(
    procs: Procs, sim: Sim, tmp_path: Path
) -> None:
    """600 tokens a minute: one run of 104 + 400 tokens leaves too little for
    another; after a graceful restart the ledger's last minute still does
    (a fresh bucket would admit it)."""
    config = {
        "server": {"api_keys": [CLIENT], "admin_keys": [OPERATOR], "drain_timeout_s": 5},
        "usage": {"ledger_path": str(tmp_path / "usage.db")},
        "tenants": [
            {"name": "minute", "key_sha256": [_digest(_key("minute"))], "tokens_per_minute": 600}
        ],
    }
    port = free_port()
    edge = procs.edge(config, port=port, name="edge-1")
    procs.node([edge], sim, node_id="n1")
    edge.wait_ready(node_id="n1")
    ask: dict[str, Any] = {
        "model": MODEL,
        "messages": _messages(),
        "max_tokens": 400,
        "extra_body": {"iop_sim": {"output_tokens": 400}},
    }
    with openai.OpenAI(base_url=f"{edge.url}/v1", api_key=_key("minute"), max_retries=0) as c:
        done = c.chat.completions.create(**ask)
    assert done.usage is not None
    assert done.usage.completion_tokens >= 400
    edge.proc.send(signal.SIGTERM)
    assert edge.proc.wait(20) == 0
    edge = procs.edge(config, port=port, name="edge-2")
    edge.wait_ready(node_id="n1")
    with (
        openai.OpenAI(base_url=f"{edge.url}/v1", api_key=_key("minute"), max_retries=0) as c,
        pytest.raises(openai.RateLimitError) as refused,
    ):
        c.chat.completions.create(**ask)
    assert "tokens per minute" in refused.value.message
    remaining = int(refused.value.response.headers["x-ratelimit-remaining-tokens"])
    assert remaining < 504


def test_a_budget_spent_through_one_edge_is_spent_on_the_other(
    procs: Procs, sim: Sim, tmp_path: Path
) -> None:
    """Two edges sharing a Valkey (``[cluster]``): a run through edge a
    spends the day's budget (as in the test above), and edge b refuses the
    next request, which its own spend alone would admit."""
    valkey = Valkey(tmp_path / "valkey")
    (tmp_path / "valkey").mkdir()
    valkey.start()
    try:
        edges = []
        for name in ("edge-a", "edge-b"):
            edges.append(
                procs.edge(
                    {
                        "server": {"api_keys": [CLIENT], "admin_keys": [OPERATOR]},
                        "cluster": {"valkey_url": valkey.url, "edge_id": name},
                        "prices": PRICES,
                        "tenants": [
                            {
                                "name": "shared",
                                "key_sha256": [_digest(_key("shared"))],
                                "budget_per_day": "0.00036",
                            }
                        ],
                    },
                    name=name,
                )
            )
        a, b = edges
        procs.node(edges, sim, node_id="n1")
        a.wait_ready(node_id="n1")
        b.wait_ready(node_id="n1")
        key = _key("shared")
        with openai.OpenAI(base_url=f"{a.url}/v1", api_key=key, max_retries=0) as c:
            c.chat.completions.create(
                model=MODEL,
                messages=_messages(),
                max_tokens=200,
                extra_body={"iop_sim": {"output_tokens": 200}},
            )
        # Settled in Valkey (a's settlement is written by its cluster task).
        poll(
            lambda: a.wait_no_runs()["cluster"]["pending_settlements"] == 0,
            timeout=10,
            what="edge a's settlement in Valkey",
        )
        with (
            openai.OpenAI(base_url=f"{b.url}/v1", api_key=key, max_retries=0) as c,
            pytest.raises(openai.RateLimitError) as refused,
        ):
            c.chat.completions.create(model=MODEL, messages=_messages(), max_tokens=12)
        assert "Budget reached for tenant shared" in refused.value.message
    finally:
        valkey.kill()
