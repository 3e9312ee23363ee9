"""``/admin`` behind keys in a real browser: headless Chromium driven by Playwright
against a real ``iop edge`` (and node and sim) on loopback.

A person opens ``/admin``, sees the login form, types a wrong key and then the
admin key, sees the nodes table, reloads (the session cookie persists), opens
``/admin/nodes`` and logs out; opens a run's timeline and its placement; sees
the routing state and drains and undrains the node with its buttons. The browser is Debian's ``chromium`` package
(Playwright never downloads one here: ``executable_path``), in a fresh profile.
When Chromium or Playwright is missing the test skips with the reason, except
under ``IOP_REQUIRE_BROWSER=1`` (CI, ``.ci/run``), where it fails.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import pytest

from tests.e2e._platform import MODEL, Cluster

API_KEY: Final = "sk-e2e-client"
ADMIN_KEY: Final = "sk-e2e-admin"
EDGE_CONFIG: dict[str, Any] = {
    "server": {"keepalive_interval_s": 0.5, "api_keys": [API_KEY], "admin_keys": [ADMIN_KEY]},
}
CHROMIUM: Final = os.environ.get("IOP_CHROMIUM", "/usr/bin/chromium")
# No network but loopback, no first-run or background chatter, no GPU; no
# sandbox because CI runs as root, where Chromium's sandbox refuses to start.
CHROMIUM_ARGS: Final = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# Per action; generous for a loaded 2-core machine.
ACTION_TIMEOUT_MS: Final = 30_000

pytestmark = pytest.mark.slow


def _browser_missing() -> str | None:
    if importlib.util.find_spec("playwright") is None:
        return "the playwright package is not installed (pip install -e '.[dev]')"
    if shutil.which(CHROMIUM) is None:
        return (
            f"no Chromium at {CHROMIUM} (apt-get install chromium, "
            "or set IOP_CHROMIUM to a Chromium binary)"
        )
    return None


# Session scope: checked before the session's sim and the module's edge start.
@pytest.fixture(scope="session")
def chromium() -> str:
    """The Chromium binary; skips (or fails under IOP_REQUIRE_BROWSER=1) without one."""
    reason = _browser_missing()
    if reason is None:
        return CHROMIUM
    if os.environ.get("IOP_REQUIRE_BROWSER") == "1":
        pytest.fail(
            f"IOP_REQUIRE_BROWSER=1 but the browser test cannot run: {reason}", pytrace=False
        )
    pytest.skip(f"browser test needs Chromium and Playwright: {reason}")


@pytest.fixture
def page(chromium: str, tmp_path: Path) -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(tmp_path / "profile"),  # a fresh profile: no cookie from anywhere else
            executable_path=chromium,
            headless=True,
            args=CHROMIUM_ARGS,
        )
        try:
            context.set_default_timeout(ACTION_TIMEOUT_MS)
            yield context.new_page()
        finally:
            context.close()


def test_admin_login_in_a_browser(
    chromium: str, cluster: Cluster, page: Any, tmp_path: Path
) -> None:
    from playwright.sync_api import expect

    edge = cluster.edge
    admin = f"{edge.url}/admin"

    # No session: the login form, not the nodes.
    resp = page.goto(admin)
    assert resp.status == 401
    expect(page).to_have_title("IOP edge: log in")
    key_box = page.get_by_label("Admin key")
    expect(key_box).to_be_focused()
    expect(page.get_by_role("table")).to_have_count(0)

    # A client key is not an admin key.
    key_box.fill(API_KEY)
    with page.expect_navigation() as nav:
        page.get_by_role("button", name="Log in").click()
    assert nav.value.status == 401
    expect(page.get_by_role("alert")).to_have_text("Wrong key.")
    assert page.context.cookies() == []
    page.screenshot(path=str(tmp_path / "login.png"))

    page.get_by_label("Admin key").fill(ADMIN_KEY)
    with page.expect_navigation(url=admin) as nav:
        page.get_by_role("button", name="Log in").click()
    assert nav.value.status == 200
    expect(page.get_by_role("heading", level=1)).to_have_text("IOP edge: serving")
    expect(page.get_by_role("cell", name=cluster.node.node_id, exact=True).first).to_be_visible()
    expect(page.get_by_role("cell", name="vllm-sim", exact=True)).to_be_visible()
    shot = tmp_path / "admin.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 0

    [cookie] = page.context.cookies()
    assert cookie["name"] == "iop_admin"
    assert cookie["httpOnly"] is True
    assert cookie["sameSite"] == "Strict"
    assert cookie["path"] == "/admin"
    assert ADMIN_KEY not in cookie["value"]
    # HttpOnly: the page's own script could not read it.
    assert page.evaluate("document.cookie") == ""

    # The session survives a reload and opens the JSON view too.
    resp = page.reload()
    assert resp.status == 200
    expect(page.get_by_role("heading", level=1)).to_have_text("IOP edge: serving")
    resp = page.goto(f"{edge.url}/admin/nodes")
    assert resp.status == 200
    nodes = json.loads(page.inner_text("body"))
    assert [n["id"] for n in nodes["nodes"]] == [cluster.node.node_id]

    # Log out: back to the form, the cookie is gone and stays gone on reload.
    page.goto(admin)
    with page.expect_navigation() as nav:
        page.get_by_role("button", name="Log out").click()
    assert nav.value.status == 401
    expect(page.get_by_label("Admin key")).to_be_visible()
    assert page.context.cookies() == []
    resp = page.reload()
    assert resp.status == 401
    expect(page.get_by_role("table")).to_have_count(0)


def test_a_runs_timeline_in_a_browser(
    chromium: str, cluster: Cluster, page: Any, tmp_path: Path
) -> None:
    from playwright.sync_api import expect

    edge = cluster.edge
    with edge.openai() as client:
        client.api_key = API_KEY
        answer = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"iop_sim": {"output_tokens": 8, "ttft_s": 0.05}},
        )
    run_id = answer.id.removeprefix("chatcmpl-")
    page.goto(f"{edge.url}/admin")
    page.get_by_label("Admin key").fill(ADMIN_KEY)
    with page.expect_navigation(url=f"{edge.url}/admin"):
        page.get_by_role("button", name="Log in").click()
    expect(page.get_by_role("heading", name="Recent runs")).to_be_visible()
    with page.expect_navigation(url=f"{edge.url}/admin/runs/{run_id}") as nav:
        page.get_by_role("link", name=run_id).click()
    assert nav.value.status == 200
    expect(page.get_by_role("heading", level=1)).to_have_text(f"Run {run_id}")
    expect(page.get_by_text("outcome complete:stop")).to_be_visible()
    for moment in ("backend request sent", "backend first byte", "node's terminal"):
        expect(page.get_by_role("cell", name=moment, exact=True)).to_be_visible()
    # Where it ran, why, and what it was chosen from.
    expect(page.get_by_role("heading", name="Placement")).to_be_visible()
    node = cluster.node.node_id
    expect(
        page.get_by_role("cell", name=f"{node}/vllm-sim (chosen): load 0.0", exact=True)
    ).to_be_visible()
    # The chart: one bar per span, inside the page's width.
    bars = page.locator(".span .bar")
    assert bars.count() >= 4
    box = bars.first.bounding_box()
    assert box is not None
    assert box["width"] > 0
    shot = tmp_path / "timeline.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 0


def test_drain_and_undrain_a_node_from_the_page(
    chromium: str, cluster: Cluster, page: Any, tmp_path: Path
) -> None:
    from playwright.sync_api import expect

    edge = cluster.edge
    node = cluster.node.node_id
    admin = f"{edge.url}/admin"
    page.goto(admin)
    page.get_by_label("Admin key").fill(ADMIN_KEY)
    with page.expect_navigation(url=admin):
        page.get_by_role("button", name="Log in").click()

    # The routing state: the policy, its weights, the queue and the prefix index.
    expect(page.get_by_role("heading", name="Routing")).to_be_visible()
    expect(page.get_by_text("Placement: least_loaded, affinity on, failover on.")).to_be_visible()
    expect(page.get_by_role("cell", name="load_weight", exact=True)).to_be_visible()
    expect(page.get_by_role("cell", name="prefix index entries", exact=True)).to_be_visible()

    # Drain: the form posts (same origin, with the session cookie) and the page comes back.
    with page.expect_navigation(url=admin) as nav:
        page.get_by_role("button", name="Drain", exact=True).click()
    assert nav.value.status == 200
    expect(
        page.get_by_role("cell", name="drained by admin session from 127.0.0.1", exact=True)
    ).to_be_visible()
    expect(page.get_by_role("cell", name=f"{node} (drained)", exact=True)).to_be_visible()
    assert edge.admin()["drained"][node]["by"] == "admin session from 127.0.0.1"
    page.screenshot(path=str(tmp_path / "drained.png"), full_page=True)

    with page.expect_navigation(url=admin) as nav:
        page.get_by_role("button", name="Undrain", exact=True).click()
    assert nav.value.status == 200
    expect(page.get_by_role("button", name="Drain", exact=True)).to_be_visible()
    assert edge.admin()["drained"] == {}
