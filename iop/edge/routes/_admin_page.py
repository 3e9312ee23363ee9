"""The admin pages: ``GET /admin`` (nodes, instances, load, operator drains
with their Drain/Undrain buttons, on-demand models with their state, memory
and Load/Unload, Pin/Unpin buttons, the routing policy, live and recent runs)
and a run's timeline (``GET /admin/runs/{id}`` from a browser: its spans,
moments and placements, with the candidates each was chosen from) as HTML.
With a usage ledger, ``GET /admin`` also plots the last days' tokens and
cost as inline SVG bars (no script, no dependency).

Rendered on the server from ``EdgeCore.snapshot()`` and ``EdgeCore.runs_view()``
(the same data as ``GET /admin/nodes`` and ``GET /admin/runs``), escaped,
with no script: the page reloads itself every few seconds, and its buttons
are forms that post to the edge (drain, undrain, a model's load, unload,
pin and unpin, log out; the edge refuses
them cross-origin). A run's timeline
is a table of its moments and a chart of its spans drawn with plain
``div``s whose offsets and widths are percentages of the run's duration. When admin keys are configured, ``render_login_page`` is what a
browser without a session gets: a plain form that posts the key to
``/admin/login`` (``_admin_auth`` has the rules); ``render_off_page`` is what
it gets when the admin views are off. Sans-IO: functions of their
arguments.
"""

from __future__ import annotations

from html import escape
from typing import Any, Final
from urllib.parse import quote

__all__ = [
    "RECENT_ON_PAGE",
    "REFRESH_S",
    "USAGE_DAYS",
    "render_admin_page",
    "render_login_page",
    "render_off_page",
    "render_run_page",
]

REFRESH_S: Final = 2
# Finished runs the admin page lists (``/admin/runs`` has more).
RECENT_ON_PAGE: Final = 20

_STYLE: Final = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.3em}h2{font-size:1.05em;margin-top:1.6em}
table{border-collapse:collapse;margin:.4em 0}
td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left}
th{background:#f3f3f3}.num{text-align:right}
.ok{color:#176b1a}.bad{color:#b00020}.muted{color:#777}
header{display:flex;align-items:baseline;gap:1em}header form{margin-left:auto}
label{display:block;margin:.8em 0 .3em}input{font:inherit;padding:.3em;width:22em}
button{font:inherit;padding:.3em 1em;margin-top:.8em}td form button{margin:0;padding:.1em .6em}
.chart{width:100%;max-width:60em;margin:.6em 0}
.span{display:flex;align-items:center;gap:.6em;margin:.15em 0}
.span .name{width:13em;flex:none}.span .track{flex:1;position:relative;height:1em;background:#f3f3f3}
.span .bar{position:absolute;top:0;bottom:0;min-width:2px;background:#3b6ea8}
.span .bar.stall{background:#c77c02}.span .bar.cancel{background:#b00020}
.span .bar.node{background:#5b8c3a}
svg.usage rect.tokens{fill:#3b6ea8}svg.usage rect.cost_micros{fill:#5b8c3a}svg.progress rect.answered{fill:#5b8c3a}svg.progress rect.failed{fill:#b03a2e}svg.progress rect.left{fill:#ddd}
figure{margin:.6em 0}figcaption{color:#555}
"""

_HEAD: Final = "<!doctype html><html><head><meta charset='utf-8'>"
_LOGOUT_FORM: Final = (
    "<form method='post' action='/admin/logout'><button type='submit'>Log out</button></form>"
)


def _cell(value: Any, cls: str = "") -> str:
    attr = f' class="{cls}"' if cls else ""
    return f"<td{attr}>{escape(str(value))}</td>"


def _table(headers: list[str], rows: list[str], empty: str) -> str:
    if not rows:
        return f'<p class="muted">{escape(empty)}</p>'
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>"


def render_login_page(message: str | None = None) -> bytes:
    """The login form of ``/admin``, with ``message`` (why the last try failed) above it."""
    note = f'<p class="bad" role="alert">{escape(message)}</p>' if message else ""
    body = (
        f"{_HEAD}<title>IOP edge: log in</title><style>{_STYLE}</style></head><body>"
        "<h1>IOP edge admin</h1>"
        f"{note}"
        "<form method='post' action='/admin/login'>"
        "<label for='key'>Admin key</label>"
        "<input id='key' name='key' type='password' autocomplete='current-password'"
        " required autofocus>"
        "<br><button type='submit'>Log in</button></form>"
        "<p class='muted'>A key of <code>server.admin_keys</code> (a client key "
        "never opens this page). "
        "Scripts send it as <code>Authorization: Bearer KEY</code>.</p>"
        "</body></html>"
    )
    return body.encode()


def render_off_page(message: str) -> bytes:
    """What a browser gets when the admin views are off: why, and how to turn them on."""
    body = (
        f"{_HEAD}<title>IOP edge: admin off</title><style>{_STYLE}</style></head><body>"
        "<h1>IOP edge admin</h1>"
        f'<p class="bad" role="alert">{escape(message)}</p>'
        "</body></html>"
    )
    return body.encode()


def _ms(value: Any) -> str:
    return "" if value is None else f"{float(value):.1f} ms"


def _run_link(run_id: str) -> str:
    return f"<td><a href='/admin/runs/{escape(run_id, quote=True)}'>{escape(run_id)}</a></td>"


def _drain_form(node_id: str, drained: bool) -> str:
    """The Drain (or Undrain) button of one node: a form posting to the edge."""
    verb = "undrain" if drained else "drain"
    action = f"/admin/nodes/{escape(node_id, quote=True)}/{verb}"
    title = (
        "Let this node take runs again"
        if drained
        else "Send no new runs to this node; its runs go on (a reason: the API)"
    )
    return (
        f"<td><form method='post' action='{action}'>"
        f"<button type='submit' title='{title}'>{verb.capitalize()}</button></form></td>"
    )


def _drain_cell(mark: Any) -> str:
    if not mark:
        return _cell("no")
    said = f": {mark.get('reason')}" if mark.get("reason") else ""
    return _cell(f"drained by {mark.get('by') or '?'}{said}", "bad")


def _model_form(node_id: str, model: str, action: str, title: str) -> str:
    """One button of a model's row: a form posting ``action`` to the edge."""
    path = f"/admin/nodes/{quote(node_id, safe='')}/models/{quote(model, safe='')}/{action}"
    return (
        f"<form method='post' action='{escape(path, quote=True)}' style='display:inline'>"
        f"<button type='submit' title='{escape(title, quote=True)}'>"
        f"{action.capitalize()}</button></form>"
    )


def _model_state(m: dict[str, Any]) -> tuple[str, str]:
    """A model's state as the page says it, and its cell's class."""
    state = str(m.get("state", ""))
    detail = str(m.get("detail") or "")
    if state == "loading":
        said = f"loading for {m.get('loading_for_s', 0)} s"
        return (f"{said} ({detail})" if detail else said), ""
    if state == "failed":
        return f"failed: {detail}; retried in {m.get('retry_in_s', 0)} s at the earliest", "bad"
    if state in ("draining", "unloading") and detail:
        return f"{state}: {detail}", "muted"
    return state, "ok" if state == "ready" else "muted" if state == "cold" else ""


def _models_section(nodes: list[dict[str, Any]]) -> str:
    """On-demand models (docs/operations.md, "Operator controls"): each node's
    memory, each model's state and its Load/Unload and Pin/Unpin buttons."""
    rows = []
    for n in nodes:
        mem = n.get("memory_mib") or {}
        for m in n.get("models") or []:
            state, cls = _model_state(m)
            loaded = m.get("state") in ("loading", "ready", "draining")
            buttons = ""
            if n.get("controls"):
                buttons = (
                    _model_form(n["id"], m["model"], "unload", "Unload once its runs end")
                    if loaded
                    else _model_form(n["id"], m["model"], "load", "Start its load now")
                ) + (
                    _model_form(n["id"], m["model"], "unpin", "Let it be evicted again")
                    if m.get("pinned")
                    else _model_form(n["id"], m["model"], "pin", "Keep it loaded")
                )
            rows.append(
                "<tr>"
                + _cell(n["id"])
                + _cell(m.get("model", ""))
                + _cell(state, cls)
                + _cell("yes" if m.get("pinned") else "no")
                + _cell(m.get("runs", 0), "num")
                + _cell(f"{m.get('memory_mib', 0)} MiB", "num")
                + _cell(f"{mem.get('used', 0)} / {mem.get('budget', 0)} MiB", "num")
                + _cell(f"{m.get('load_s', 0)} s" if m.get("load_s") else "", "num")
                + f"<td>{buttons}</td>"
                + "</tr>"
            )
    if not rows:
        return ""
    return "<h2>On-demand models</h2>" + _table(
        ["node", "model", "state", "pinned", "runs", "memory", "node memory", "last load", ""],
        rows,
        "",
    )


def _routing(snapshot: dict[str, Any]) -> str:
    """The routing section: the policy and its weights, the queue, the prefix index."""
    r: dict[str, Any] = snapshot.get("routing") or {}
    if not r:
        return ""
    index = r.get("prefix_index") or {}
    facts = [
        f"Placement: {r.get('placement')}",
        f"affinity {'on' if r.get('affinity') else 'off'}",
        f"failover {'on' if r.get('failover') else 'off'}",
    ]
    rows = [
        ("prefix_weight", r.get("prefix_weight")),
        ("load_weight", r.get("load_weight")),
        ("affinity_weight", r.get("affinity_weight")),
        ("balance_load_threshold", r.get("balance_load_threshold")),
        ("balance_rel_threshold", r.get("balance_rel_threshold")),
        ("queued / max_queue", f"{snapshot.get('queued', 0)} / {r.get('max_queue')}"),
        ("max_queue_delay_s", r.get("max_queue_delay_s")),
        ("queue_timeout_s", r.get("queue_timeout_s")),
        (
            "prefix index entries",
            f"{index.get('entries', 0)} / {index.get('max_entries', 0)}"
            f" ({index.get('evicted', 0)} evicted)",
        ),
    ]
    return f"<h2>Routing</h2><p>{escape(', '.join(facts))}.</p>" + _table(
        ["[scheduler]", "value"],
        ["<tr>" + _cell(k) + _cell(v, "num") + "</tr>" for k, v in rows],
        "",
    )


def render_admin_page(
    snapshot: dict[str, Any],
    runs: dict[str, Any] | None = None,
    *,
    logout: bool = False,
    usage: list[dict[str, Any]] | None = None,
) -> bytes:
    """The admin page for one ``EdgeCore.snapshot()`` and ``EdgeCore.runs_view()``,
    with a log-out button if ``logout``, and the usage ledger's days
    (``iop.ledger.report_json`` rows by day; None: the edge has no ledger)."""
    nodes: list[dict[str, Any]] = snapshot.get("nodes", [])
    instance_rows = []
    for node in nodes:
        for inst in node.get("instances", []):
            status = str(inst.get("provider_status", ""))
            detail = str(inst.get("provider_detail", ""))
            instance_rows.append(
                "<tr>"
                + _cell(
                    node["id"]
                    + (" (drained)" if node.get("drained") else "")
                    + (" (draining)" if node.get("draining") else "")
                )
                + _cell(inst.get("instance", ""))
                + _cell(inst.get("adapter", ""))
                + _cell(inst.get("provider", ""))
                + _cell(
                    f"{status}: {detail}" if detail else status,
                    "ok" if status == "available" else "bad",
                )
                + _cell(", ".join(inst.get("targets", [])))
                + _cell(f"{inst.get('in_flight', 0)} / {inst.get('max_concurrency', 0)}", "num")
                + "</tr>"
            )
    node_rows = [
        "<tr>"
        + _cell(n["id"])
        + _cell(n.get("software", ""))
        + _cell(f"{n.get('connected_for_s', 0)} s", "num")
        + _cell("yes" if n.get("draining") else "no")
        + _drain_cell(n.get("drained"))
        + _cell(len(n.get("runs", [])), "num")
        + _cell(sum(int(i.get("in_flight", 0)) for i in n.get("instances", [])), "num")
        + _drain_form(n["id"], bool(n.get("drained")))
        + "</tr>"
        for n in nodes
    ]
    connected = {n["id"] for n in nodes}
    # Drained ids that are not connected now: they stay drained when they come back.
    node_rows += [
        "<tr>"
        + _cell(node_id)
        + _cell("")
        + _cell("not connected", "muted")
        + _cell("")
        + _drain_cell(mark)
        + _cell(0, "num")
        + _cell(0, "num")
        + _drain_form(node_id, True)
        + "</tr>"
        for node_id, mark in (snapshot.get("drained") or {}).items()
        if node_id not in connected
    ]
    runs = runs or {}
    phases = {r["run_id"]: r.get("phase", "") for r in runs.get("live", [])}
    run_rows = [
        "<tr>"
        + _run_link(r["run_id"])
        + _cell(r.get("model", ""))
        + _cell(phases.get(r["run_id"], r.get("state", "")))
        + _cell(f"{r.get('age_s', 0)} s", "num")
        + "</tr>"
        for r in snapshot.get("runs", [])
    ]
    recent_rows = [
        "<tr>"
        + _run_link(r["run_id"])
        + _cell(r.get("model", ""))
        + _cell(r.get("node") or "")
        + _cell(
            r.get("outcome") or "",
            "ok" if str(r.get("outcome", "")).startswith("complete") else "bad",
        )
        + _cell(_ms(r.get("first_output_ms")), "num")
        + _cell(_ms(r.get("duration_ms")), "num")
        + _cell(r.get("stalls", 0), "num")
        + "</tr>"
        for r in runs.get("recent", [])[:RECENT_ON_PAGE]
    ]
    outcome_rows = [
        "<tr>" + _cell(k) + _cell(v, "num") + "</tr>"
        for k, v in sorted(snapshot.get("outcomes", {}).items())
    ]
    tenant_rows = [_tenant_row(t) for t in snapshot.get("tenants", [])]
    batch_rows = [
        "<tr>"
        + _cell(b["id"])
        + _cell(b["tenant"])
        + _cell(b["model"])
        + _cell(b["status"] + (" (paused)" if b["paused"] else ""))
        + _cell(f"{b['done']} / {b['total']}", "num")
        + "<td>"
        + _progress_plot(b)
        + "</td>"
        + _cell(b["failed"], "num")
        + _cell(b["lines_per_s"], "num")
        + _cell("" if b["eta_s"] is None else f"{b['eta_s']} s", "num")
        + "</tr>"
        for b in snapshot.get("batches", [])
    ]
    state = "draining" if snapshot.get("draining") else "serving"
    body = (
        f"{_HEAD}<meta http-equiv='refresh' content='{REFRESH_S}'>"
        f"<title>IOP edge</title><style>{_STYLE}</style></head><body>"
        f"<header><h1>IOP edge: {escape(state)}</h1>{_LOGOUT_FORM if logout else ''}</header>"
        f"<p>{len(nodes)} node(s), {len(run_rows)} run(s) in flight, "
        f"{int(snapshot.get('queued', 0))} queued, "
        f"{int(snapshot.get('runs_started', 0))} started since start-up. "
        "JSON: <a href='/admin/nodes'>/admin/nodes</a>, <a href='/admin/runs'>/admin/runs</a>, "
        "metrics: <a href='/metrics'>/metrics</a> (open, or with a metrics or admin key as "
        "a Bearer header)</p>"
        "<h2>Instances</h2>"
        + _table(
            ["node", "instance", "adapter", "provider", "status", "models", "in flight / slots"],
            instance_rows,
            "No node is connected.",
        )
        + "<h2>Nodes</h2>"
        + _table(
            [
                "node",
                "software",
                "connected for",
                "said goodbye",
                "operator drain",
                "runs",
                "slots in use",
                "",
            ],
            node_rows,
            "None.",
        )
        + _models_section(nodes)
        + _routing(snapshot)
        + "<h2>Runs in flight</h2>"
        + _table(["run", "model", "phase", "age"], run_rows, "None.")
        + "<h2>Recent runs</h2>"
        + _table(
            ["run", "model", "node", "outcome", "first output", "duration", "stalls"],
            recent_rows,
            "No run has ended yet.",
        )
        + "<h2>Outcomes</h2>"
        + _table(["outcome", "runs"], outcome_rows, "No run has ended yet.")
        + "<h2>Batches</h2>"
        + _table(
            [
                "batch",
                "tenant",
                "model",
                "status",
                "lines done",
                "progress",
                "failed",
                "lines/s",
                "left",
            ],
            batch_rows,
            "No batch is running.",
        )
        + _usage_section(usage)
        + "<h2>Tenants</h2>"
        + _cluster_line(snapshot.get("cluster"))
        + _table(
            [
                "tenant",
                "class / weight",
                "models",
                "running",
                "requests left",
                "tokens left",
                "admitted",
                "refused",
                "tokens in / out",
            ],
            tenant_rows,
            "None.",
        )
        + "</body></html>"
    )
    return body.encode()


# The usage plot: one bar a day for the last USAGE_DAYS days, in a box of
# this many SVG units (scaled to the page's width by the browser).
USAGE_DAYS: Final = 30
_PLOT_W: Final = 600
_PLOT_H: Final = 90


def _usage_plot(days: list[dict[str, Any]], field: str, label: str, fmt: Any) -> str:
    """One inline SVG bar chart of ``field`` per day, with each bar's value
    as its tooltip (``<title>``) and the largest value on the axis."""
    top = max((int(d.get(field, 0)) for d in days), default=0)
    width = _PLOT_W / max(1, len(days))
    bars = []
    for i, d in enumerate(days):
        value = int(d.get(field, 0))
        h = 0.0 if not top else value / top * (_PLOT_H - 14)
        bars.append(
            f"<rect class='{field}' x='{i * width + 1:.1f}' y='{_PLOT_H - h:.1f}' "
            f"width='{max(1.0, width - 2):.1f}' height='{h:.1f}'>"
            f"<title>{escape(str(d.get('day', '')))}: {escape(fmt(value))}</title></rect>"
        )
    return (
        f"<figure><figcaption>{escape(label)} a day (highest: {escape(fmt(top))})</figcaption>"
        f"<svg class='usage' role='img' aria-label='{escape(label)} a day' "
        f"viewBox='0 0 {_PLOT_W} {_PLOT_H}' width='100%' style='max-width:60em;height:7em'>"
        f"<line x1='0' y1='{_PLOT_H}' x2='{_PLOT_W}' y2='{_PLOT_H}' stroke='#999'/>"
        + "".join(bars)
        + "</svg></figure>"
    )


# A batch's progress: one stacked bar of this many SVG units.
_PROGRESS_W: Final = 200
_PROGRESS_H: Final = 12


def _progress_plot(b: dict[str, Any]) -> str:
    """One batch's lines as a stacked bar: answered, failed, left (each
    part's count in its tooltip, its width in proportion)."""
    total = max(1, int(b.get("total", 0)))
    done, failed = int(b.get("done", 0)), int(b.get("failed", 0))
    parts = (("answered", done - failed), ("failed", failed), ("left", total - done))
    x = 0.0
    rects = []
    for name, count in parts:
        width = max(0, count) / total * _PROGRESS_W
        rects.append(
            f"<rect class='{name}' x='{x:.1f}' y='0' width='{width:.1f}' "
            f"height='{_PROGRESS_H}'><title>{name}: {max(0, count)}</title></rect>"
        )
        x += width
    return (
        f"<svg class='progress' role='img' aria-label='lines answered, failed and left' "
        f"viewBox='0 0 {_PROGRESS_W} {_PROGRESS_H}' width='12em' height='0.8em'>"
        + "".join(rects)
        + "</svg>"
    )


def _usage_section(usage: list[dict[str, Any]] | None) -> str:
    """The ledger's last days: tokens and cost plotted, and a table."""
    if usage is None:
        return ""
    days = [
        {**d, "tokens": int(d.get("input_tokens", 0)) + int(d.get("output_tokens", 0))}
        for d in usage
    ]
    rows = [
        "<tr>"
        + _cell(d.get("day", ""))
        + _cell(d.get("runs", 0), "num")
        + _cell(d.get("input_tokens", 0), "num")
        + _cell(d.get("output_tokens", 0), "num")
        + _cell(d.get("cost", ""), "num")
        + "</tr>"
        for d in reversed(days)
    ]
    plots = (
        _usage_plot(days, "tokens", "Tokens (input + output)", str)
        + _usage_plot(days, "cost_micros", "Cost", _money)
        if days
        else ""
    )
    return (
        f"<h2>Usage (last {USAGE_DAYS} days, UTC)</h2>"
        "<p>From the usage ledger; JSON: <a href='/admin/usage'>/admin/usage</a>.</p>"
        + plots
        + _table(["day", "runs", "input tokens", "output tokens", "cost"], rows, "No run yet.")
    )


def _money(micros: int) -> str:
    whole, frac = divmod(micros, 1_000_000)
    return f"{whole}.{frac:06d}"


def _cluster_line(cluster: Any) -> str:
    """With ``[cluster]``: whose limits the table shows (docs/operations.md,
    "Running several edges")."""
    if not isinstance(cluster, dict):
        return ""
    if cluster.get("valkey_up"):
        how = (
            f"Limits are shared in Valkey by {int(cluster.get('live_edges', 1))} live edge(s); "
            "what is left is as of this edge's last admission."
        )
        css = "ok"
    else:
        how = (
            "Valkey is unreachable: this edge admits by its local share "
            f"(limit / {int(cluster.get('live_edges', 1))} live edges)."
        )
        css = "bad"
    return (
        f"<p class='{css}'>Edge {escape(str(cluster.get('edge_id', '')))}: {escape(how)} "
        f"Settlements waiting: {int(cluster.get('pending_settlements', 0))}.</p>"
    )


def _tenant_row(t: dict[str, Any]) -> str:
    limits = t.get("limits", {})

    def left(kind: str) -> str:
        lim = limits.get(kind)
        return "no limit" if lim is None else f"{lim['remaining']} / {lim['limit']}"

    cap = t.get("max_concurrent_runs") or 0
    return (
        "<tr>"
        + _cell(t.get("name", ""))
        + _cell(f"{t.get('priority', '')} / {t.get('weight', '')}")
        + _cell(", ".join(t.get("models", [])) or "all")
        + _cell(f"{t.get('running', 0)}" + (f" / {cap}" if cap else ""), "num")
        + _cell(left("requests"), "num")
        + _cell(left("tokens"), "num")
        + _cell(t.get("admitted", 0), "num")
        + _cell(t.get("refused", 0), "num" if not t.get("refused") else "bad")
        + _cell(f"{t.get('tokens_in', 0)} / {t.get('tokens_out', 0)}", "num")
        + "</tr>"
    )


# (label, start key, end key, css class) of a run's spans, edge then node.
_SPANS: Final = (
    ("queued", "queued_ms", "dequeued_ms", ""),
    ("waiting for first output", "received_ms", "first_output_ms", ""),
    ("streaming", "first_output_ms", "terminal_ms", ""),
    ("cancelling", "cancel_requested_ms", "terminal_ms", "cancel"),
)
_NODE_SPANS: Final = (
    ("node: run", "started_ms", "terminal_ms", "node"),
    ("node: backend to first output", "backend_sent_ms", "first_output_ms", "node"),
    ("node: backend response open", "backend_first_byte_ms", "backend_closed_ms", "node"),
)
# The moments of the table, in the order they happen: (label, key, on the node).
_MOMENTS: Final = (
    ("admitted", "admitted_ms", False),
    ("queued", "queued_ms", False),
    ("dequeued", "dequeued_ms", False),
    ("node got the run", "started_ms", True),
    ("backend request sent", "backend_sent_ms", True),
    ("backend first byte", "backend_first_byte_ms", True),
    ("first output (node)", "first_output_ms", True),
    ("first output", "first_output_ms", False),
    ("cancel requested", "cancel_requested_ms", False),
    ("cancel sent to node", "cancel_sent_ms", False),
    ("node got the cancel", "cancel_received_ms", True),
    ("backend closed", "backend_closed_ms", True),
    ("node's terminal", "terminal_ms", True),
    ("terminal", "terminal_ms", False),
)


def _bar(label: str, start: float, end: float, total: float, cls: str) -> str:
    left = max(0.0, min(100.0, 100.0 * start / total))
    width = max(0.0, min(100.0 - left, 100.0 * (end - start) / total))
    return (
        f"<div class='span'><span class='name'>{escape(label)}</span>"
        f"<span class='track'><span class='bar {cls}' style='left:{left:.2f}%;width:{width:.2f}%'"
        f" title='{escape(label, quote=True)}: {start:.1f} to {end:.1f} ms'></span></span>"
        f"<span class='num'>{end - start:.1f} ms</span></div>"
    )


def render_run_page(timeline: dict[str, Any], *, logout: bool = False) -> bytes:
    """One run's timeline (``Timeline.to_json()``) as a page: summary, chart, moments."""
    t = dict(timeline, received_ms=0.0)
    node: dict[str, Any] = t.get("node") or {}
    live = t.get("terminal_ms") is None
    # The chart ends at the latest moment known: a cancelled run's node ends
    # after the edge's run did; a live run's chart grows.
    times = [
        float(v)
        for part in (t, node)
        for k, v in part.items()
        if k.endswith("_ms") and isinstance(v, (int, float)) and not isinstance(v, bool)
    ]
    end = max([0.0, *times])
    total = max(float(end), 1e-3)
    bars = []
    for label, a, b, cls in _SPANS:
        if t.get(a) is not None and t.get(b) is not None:
            bars.append(_bar(label, float(t[a]), float(t[b]), total, cls))
    for label, a, b, cls in _NODE_SPANS:
        if node.get(a) is not None and node.get(b) is not None:
            bars.append(_bar(label, float(node[a]), float(node[b]), total, cls))
    stalls = [(s, "") for s in t.get("stalls", [])] + [
        (s, "node: ") for s in node.get("stalls", [])
    ]
    for stall, where in stalls:
        if stall.get("start_ms") is not None:
            stop = stall.get("end_ms")
            bars.append(
                _bar(
                    f"{where}{stall.get('kind', '')} stall",
                    float(stall["start_ms"]),
                    float(stop if stop is not None else total),
                    total,
                    "stall",
                )
            )
    moments = []
    for label, key, on_node in _MOMENTS:
        value = (node if on_node else t).get(key)
        if value is not None:
            moments.append((float(value), label, "node" if on_node else "edge"))
    for p in t.get("placements", []):
        moments.append(
            (
                float(p.get("at_ms") or 0.0),
                f"placed on {p.get('node')}/{p.get('instance')} (attempt {p.get('attempt')}):"
                f" {p.get('result') or 'running'}",
                "edge",
            )
        )
    moments.sort(key=lambda m: m[0])
    placement_rows = []
    for p in t.get("placements", []):
        scores: dict[str, Any] = p.get("scores") or {}
        loads: dict[str, Any] = p.get("candidates") or {}
        chosen = f"{p.get('node')}/{p.get('instance')}"
        names = list(loads) + [n for n in scores if n not in loads]
        seen = ", ".join(
            f"{n}{' (chosen)' if n == chosen else ''}: load {loads.get(n, '?')}"
            + (f", score {scores[n]}" if n in scores else "")
            for n in names
        )
        placement_rows.append(
            "<tr>"
            + _cell(p.get("attempt"), "num")
            + _cell(chosen)
            + _cell(p.get("why") or "")
            + _cell(seen)
            + _cell(p.get("result") or "running")
            + "</tr>"
        )
    moment_rows = [
        "<tr>" + _cell(f"{at:.1f} ms", "num") + _cell(label) + _cell(where) + "</tr>"
        for at, label, where in moments
    ]
    run_id = str(t.get("run_id", ""))
    clock = ""
    if node:
        clock = (
            f"<p class='muted'>Node times are in the edge's clock, each good to "
            f"{float(node.get('clock_rtt_ms') or 0.0) / 2:.2f} ms "
            "(half the run's round trip).</p>"
        )
    why = t.get("why_queued")
    cause = t.get("cancel_cause")
    facts = [
        f"model {escape(str(t.get('model', '')))}",
        "streamed" if t.get("stream") else "collected",
        f"phase {escape(str(t.get('phase', '')))}",
        f"outcome {escape(str(t.get('outcome') or 'none yet'))}",
    ]
    if why:
        facts.append(f"queued because {escape(str(why))}")
    if cause:
        facts.append(f"cancelled for {escape(str(cause))}")
    if t.get("stalls_dropped"):
        facts.append(f"{int(t['stalls_dropped'])} stall(s) not kept")
    refresh = f"<meta http-equiv='refresh' content='{REFRESH_S}'>" if live else ""
    body = (
        f"{_HEAD}{refresh}<title>IOP run {escape(run_id)}</title><style>{_STYLE}</style></head>"
        f"<body><header><h1>Run {escape(run_id)}</h1>{_LOGOUT_FORM if logout else ''}</header>"
        f"<p>{', '.join(facts)}. <a href='/admin'>Back to the admin page</a>.</p>"
        "<h2>Spans</h2>"
        + (
            f"<div class='chart' role='list'>{''.join(bars)}</div>"
            if bars
            else "<p class='muted'>None yet.</p>"
        )
        + clock
        + "<h2>Placement</h2>"
        + _table(
            ["attempt", "chosen", "why", "candidates", "result"],
            placement_rows,
            "Not placed yet.",
        )
        + "<h2>Moments</h2>"
        + _table(["at", "moment", "where"], moment_rows, "None yet.")
        + "</body></html>"
    )
    return body.encode()
