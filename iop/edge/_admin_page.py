"""The admin page (``GET /admin``): nodes, instances, load and live runs as HTML.

Rendered on the server from ``EdgeCore.snapshot()`` (the same data as
``GET /admin/nodes``), escaped, with no script: the page reloads itself every
few seconds. When admin keys are configured, ``render_login_page`` is what a
browser without a session gets: a plain form that posts the key to
``/admin/login`` (``_admin_auth`` has the rules). Sans-IO: functions of their
arguments.
"""

from __future__ import annotations

from html import escape
from typing import Any, Final

__all__ = ["REFRESH_S", "render_admin_page", "render_login_page"]

REFRESH_S: Final = 2

_STYLE: Final = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.3em}h2{font-size:1.05em;margin-top:1.6em}
table{border-collapse:collapse;margin:.4em 0}
td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left}
th{background:#f3f3f3}.num{text-align:right}
.ok{color:#176b1a}.bad{color:#b00020}.muted{color:#777}
header{display:flex;align-items:baseline;gap:1em}header form{margin-left:auto}
label{display:block;margin:.8em 0 .3em}input{font:inherit;padding:.3em;width:22em}
button{font:inherit;padding:.3em 1em;margin-top:.8em}
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
        "<p class='muted'>A key of <code>server.admin_keys</code> (or of "
        "<code>server.api_keys</code> when no admin key is set). "
        "Scripts send it as <code>Authorization: Bearer KEY</code>.</p>"
        "</body></html>"
    )
    return body.encode()


def render_admin_page(snapshot: dict[str, Any], *, logout: bool = False) -> bytes:
    """The admin page for one ``EdgeCore.snapshot()``, with a log-out button if ``logout``."""
    nodes: list[dict[str, Any]] = snapshot.get("nodes", [])
    instance_rows = []
    for node in nodes:
        for inst in node.get("instances", []):
            status = str(inst.get("provider_status", ""))
            detail = str(inst.get("provider_detail", ""))
            instance_rows.append(
                "<tr>"
                + _cell(node["id"] + (" (draining)" if node.get("draining") else ""))
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
        + _cell(len(n.get("runs", [])), "num")
        + "</tr>"
        for n in nodes
    ]
    run_rows = [
        "<tr>"
        + _cell(r["run_id"])
        + _cell(r.get("model", ""))
        + _cell(r.get("state", ""))
        + _cell(f"{r.get('age_s', 0)} s", "num")
        + "</tr>"
        for r in snapshot.get("runs", [])
    ]
    outcome_rows = [
        "<tr>" + _cell(k) + _cell(v, "num") + "</tr>"
        for k, v in sorted(snapshot.get("outcomes", {}).items())
    ]
    state = "draining" if snapshot.get("draining") else "serving"
    body = (
        f"{_HEAD}<meta http-equiv='refresh' content='{REFRESH_S}'>"
        f"<title>IOP edge</title><style>{_STYLE}</style></head><body>"
        f"<header><h1>IOP edge: {escape(state)}</h1>{_LOGOUT_FORM if logout else ''}</header>"
        f"<p>{len(nodes)} node(s), {len(run_rows)} run(s) in flight, "
        f"{int(snapshot.get('queued', 0))} queued, "
        f"{int(snapshot.get('runs_started', 0))} started since start-up. "
        "JSON: <a href='/admin/nodes'>/admin/nodes</a>, metrics: <a href='/metrics'>/metrics</a></p>"
        "<h2>Instances</h2>"
        + _table(
            ["node", "instance", "adapter", "provider", "status", "models", "in flight / slots"],
            instance_rows,
            "No node is connected.",
        )
        + "<h2>Nodes</h2>"
        + _table(["node", "software", "connected for", "draining", "runs"], node_rows, "None.")
        + "<h2>Runs in flight</h2>"
        + _table(["run", "model", "state", "age"], run_rows, "None.")
        + "<h2>Outcomes</h2>"
        + _table(["outcome", "runs"], outcome_rows, "No run has ended yet.")
        + "</body></html>"
    )
    return body.encode()
