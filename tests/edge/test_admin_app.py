"""``/admin`` behind keys, on a real socket: the login form, the session cookie,
Bearer for scripts, logout, forged and expired cookies, the wrong-key brake and
the cross-origin guard. (The gate's own rules: ``test_admin_auth.py``; a real
browser: ``tests/e2e/test_admin_browser.py``; client keys against the admin
views and ``/metrics`` on a real process: ``tests/e2e/test_who_sees_what.py``.)"""

from __future__ import annotations

import logging
import time
from http.cookies import SimpleCookie

import httpx
import pytest
import trio

from iop.edge.routes._admin_auth import COOKIE_NAME
from tests.edge._openai_schema import validate_error
from tests.edge.test_app import config, edge

pytestmark = pytest.mark.timeout(60)

API_KEY = "sk-client-1"
ADMIN_KEY = "sk-admin-1"


def set_cookie(resp: httpx.Response) -> SimpleCookie:
    jar: SimpleCookie = SimpleCookie()
    for header in resp.headers.get_list("set-cookie"):
        jar.load(header)
    return jar


async def login(client: httpx.AsyncClient, key: str, **headers: str) -> httpx.Response:
    resp = await client.post("/admin/login", data={"key": key}, headers=headers)
    # Every test sends its cookies by hand (``with_cookie``), not from httpx's jar.
    client.cookies.clear()
    return resp


async def logged_in(client: httpx.AsyncClient, key: str) -> str:
    """Log in with ``key``; the session token the edge set."""
    resp = await login(client, key)
    assert resp.status_code == 303, resp.text
    return set_cookie(resp)[COOKIE_NAME].value


def with_cookie(token: str) -> dict[str, str]:
    return {"Cookie": f"{COOKIE_NAME}={token}"}


def is_login_page(resp: httpx.Response) -> bool:
    return resp.headers["content-type"].startswith("text/html") and (
        "<form method='post' action='/admin/login'>" in resp.text
    )


async def test_no_keys_leave_admin_open() -> None:
    async with edge() as (_, _, client):
        resp = await client.get("/admin")
        assert resp.status_code == 200
        assert "<td>n1</td>" in resp.text
        assert "Log out" not in resp.text  # nothing to log out of
        assert (await client.get("/admin/nodes")).status_code == 200
        resp = await login(client, "anything")
        assert resp.status_code == 303
        assert "set-cookie" not in resp.headers


async def test_login_with_an_admin_key_sets_a_session_cookie(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="iop.edge.http")
    async with edge(config(api_keys=[API_KEY], admin_keys=[ADMIN_KEY])) as (_, _, client):
        # No credentials: a browser gets the login form, a script a JSON 401.
        resp = await client.get("/admin")
        assert resp.status_code == 401
        assert is_login_page(resp)
        assert "<td>n1</td>" not in resp.text
        assert resp.headers["cache-control"] == "no-store"
        assert "frame-ancestors 'none'" in resp.headers["content-security-policy"]
        resp = await client.get("/admin/nodes")
        assert resp.status_code == 401
        validate_error(resp.json())

        resp = await login(client, "sk-wrong")
        assert resp.status_code == 401
        assert is_login_page(resp)
        assert "Wrong key." in resp.text
        assert "set-cookie" not in resp.headers

        resp = await login(client, ADMIN_KEY)
        assert resp.status_code == 303
        assert resp.headers["location"] == "/admin"
        morsel = set_cookie(resp)[COOKIE_NAME]
        token = morsel.value
        assert ADMIN_KEY not in token
        assert morsel["httponly"] is True
        assert morsel["samesite"] == "Strict"
        assert morsel["path"] == "/admin"
        assert morsel["max-age"] == str(8 * 3600)
        assert not morsel["secure"]  # plain http here

        resp = await client.get("/admin", headers=with_cookie(token))
        assert resp.status_code == 200
        assert "<td>n1</td>" in resp.text
        assert "action='/admin/logout'" in resp.text
        resp = await client.get("/admin/nodes", headers=with_cookie(token))
        assert resp.status_code == 200
        assert resp.json()["nodes"][0]["id"] == "n1"
        # The cookie opens the admin pages only, not the API.
        assert (await client.get("/v1/models", headers=with_cookie(token))).status_code == 401

    text = caplog.text
    assert "admin login from 127.0.0.1" in text
    assert "wrong admin key from 127.0.0.1 (login form, /admin/login): 1 of 10" in text
    assert ADMIN_KEY not in text
    assert "sk-wrong" not in text
    assert token not in text


async def test_bearer_keeps_working_for_scripts() -> None:
    async with edge(config(api_keys=[API_KEY], admin_keys=[ADMIN_KEY])) as (_, _, client):
        bearer = {"Authorization": f"Bearer {ADMIN_KEY}"}
        resp = await client.get("/admin/nodes", headers=bearer)
        assert resp.status_code == 200
        assert resp.json()["nodes"][0]["id"] == "n1"
        resp = await client.get("/admin", headers=bearer)
        assert resp.status_code == 200
        assert "<td>n1</td>" in resp.text
        resp = await client.get("/admin/nodes", headers={"Authorization": "Bearer sk-wrong"})
        assert resp.status_code == 401
        assert resp.json()["error"]["code"] == "invalid_api_key"


async def test_logout_ends_the_session() -> None:
    async with edge(config(api_keys=[API_KEY], admin_keys=[ADMIN_KEY])) as (_, _, client):
        token = await logged_in(client, ADMIN_KEY)
        other = await logged_in(client, ADMIN_KEY)  # another browser
        resp = await client.post("/admin/logout", headers=with_cookie(token))
        client.cookies.clear()
        assert resp.status_code == 303
        assert resp.headers["location"] == "/admin"
        cleared = set_cookie(resp)[COOKIE_NAME]
        assert cleared.value == ""
        assert cleared["max-age"] == "0"
        assert cleared["path"] == "/admin"
        # The old cookie, replayed, no longer opens the page (not just forgotten
        # by the browser): the session is revoked on the edge.
        resp = await client.get("/admin", headers=with_cookie(token))
        assert resp.status_code == 401
        assert is_login_page(resp)
        assert (await client.get("/admin/nodes", headers=with_cookie(token))).status_code == 401
        assert (await client.get("/admin", headers=with_cookie(other))).status_code == 200
        # Logging out without a session is harmless.
        assert (await client.post("/admin/logout")).status_code == 303


async def test_forged_and_foreign_cookies_are_refused() -> None:
    async with edge(config(api_keys=[API_KEY], admin_keys=[ADMIN_KEY])) as (_, _, client):
        token = await logged_in(client, ADMIN_KEY)
        payload, mac = token.rsplit(".", 1)
        version, sid, expires_ms = payload.split(".")
        forged = [
            ADMIN_KEY,  # the key itself is not a session
            API_KEY,
            f"{payload}.{'0' * len(mac)}",
            f"{version}.{sid}.{int(expires_ms) * 2}.{mac}",  # extended
            "garbage",
        ]
        for value in forged:
            resp = await client.get("/admin", headers=with_cookie(value))
            assert resp.status_code == 401, value
            assert is_login_page(resp)
        assert (await client.get("/admin", headers=with_cookie(token))).status_code == 200
    # A second edge (a restart: a new secret) does not accept the first one's cookie.
    async with edge(config(api_keys=[API_KEY], admin_keys=[ADMIN_KEY])) as (_, _, client):
        assert (await client.get("/admin", headers=with_cookie(token))).status_code == 401


async def test_expired_cookie_is_refused() -> None:
    async with edge(config(api_keys=[API_KEY], admin_keys=[ADMIN_KEY], admin_session_s=1.5)) as (
        _,
        _,
        client,
    ):
        resp = await login(client, ADMIN_KEY)
        morsel = set_cookie(resp)[COOKIE_NAME]
        assert morsel["max-age"] == "2"  # rounded up to whole seconds
        token = morsel.value
        assert (await client.get("/admin", headers=with_cookie(token))).status_code == 200
        # Sent by hand, as a browser that ignores Max-Age would: the edge refuses it.
        deadline = time.monotonic() + 15
        while (await client.get("/admin", headers=with_cookie(token))).status_code == 200:
            assert time.monotonic() < deadline, "the session never expired"
            await trio.sleep(0.1)
        resp = await client.get("/admin", headers=with_cookie(token))
        assert resp.status_code == 401
        assert is_login_page(resp)


async def test_a_client_key_never_opens_admin_and_an_admin_key_never_the_api() -> None:
    async with edge(config(api_keys=[API_KEY], admin_keys=[ADMIN_KEY])) as (_, _, client):
        # A client key opens the API, not the admin pages.
        resp = await login(client, API_KEY)
        assert resp.status_code == 401
        assert "Wrong key." in resp.text
        resp = await client.get("/admin/nodes", headers={"Authorization": f"Bearer {API_KEY}"})
        assert resp.status_code == 401
        # The admin key opens the admin pages, not the API.
        token = await logged_in(client, ADMIN_KEY)
        assert (await client.get("/admin", headers=with_cookie(token))).status_code == 200
        resp = await client.get("/admin/nodes", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        assert resp.status_code == 200
        resp = await client.get("/v1/models", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        assert resp.status_code == 401
        resp = await client.get("/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
        assert resp.status_code == 200


async def test_admin_keys_without_api_keys_protect_admin_only() -> None:
    async with edge(config(admin_keys=[ADMIN_KEY])) as (_, _, client):
        assert (await client.get("/v1/models")).status_code == 200
        resp = await client.get("/admin")
        assert resp.status_code == 401
        assert is_login_page(resp)
        assert (await client.get("/admin/nodes")).status_code == 401


async def test_wrong_keys_are_braked(caplog: pytest.LogCaptureFixture) -> None:
    cfg = config(api_keys=[API_KEY], admin_keys=[ADMIN_KEY], admin_login_failures_per_minute=2)
    async with edge(cfg) as (_, _, client):
        token = await logged_in(client, ADMIN_KEY)
        assert (await login(client, "guess-1")).status_code == 401
        resp = await client.get("/admin/nodes", headers={"Authorization": "Bearer guess-2"})
        assert resp.status_code == 401
        # The limit is crossed: even the right key is refused, and says why.
        resp = await login(client, ADMIN_KEY)
        assert resp.status_code == 429
        assert is_login_page(resp)
        assert "Too many wrong admin keys (limit 2 a minute)" in resp.text
        assert 1 <= int(resp.headers["retry-after"]) <= 60
        assert "set-cookie" not in resp.headers
        resp = await client.get("/admin/nodes", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        assert resp.status_code == 429
        validate_error(resp.json())
        assert resp.json()["error"]["code"] == "too_many_wrong_keys"
        assert "retry-after" in resp.headers
        resp = await client.get("/admin", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        assert resp.status_code == 429
        # A session from before still works; the API's keys are not braked here.
        assert (await client.get("/admin", headers=with_cookie(token))).status_code == 200
        resp = await client.get("/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
        assert resp.status_code == 200
    braked = [r for r in caplog.records if "admin logins braked" in r.getMessage()]
    assert len(braked) == 1  # once, when the limit is reached, not per refused try


async def test_cross_origin_forms_are_refused() -> None:
    async with edge(config(api_keys=[API_KEY], admin_keys=[ADMIN_KEY])) as (handle, _, client):
        token = await logged_in(client, ADMIN_KEY)
        own = handle.url  # http://127.0.0.1:PORT
        for origin in ("http://evil.example", "null", "http://127.0.0.1:1"):
            resp = await login(client, ADMIN_KEY, Origin=origin)
            assert resp.status_code == 403, origin
            validate_error(resp.json())
            assert resp.json()["error"]["code"] == "cross_origin"
            resp = await client.post(
                "/admin/logout", headers={**with_cookie(token), "Origin": origin}
            )
            assert resp.status_code == 403
        assert (await client.get("/admin", headers=with_cookie(token))).status_code == 200
        assert (await login(client, ADMIN_KEY, Origin=own)).status_code == 303
        # Behind a proxy that rewrites Host, X-Forwarded-Host names the browser's host.
        resp = await login(
            client, ADMIN_KEY, Origin="https://edge.example", **{"X-Forwarded-Host": "edge.example"}
        )
        assert resp.status_code == 303


async def test_cookie_is_secure_behind_https() -> None:
    async with edge(config(api_keys=[API_KEY], admin_keys=[ADMIN_KEY])) as (_, _, client):
        resp = await login(client, ADMIN_KEY, **{"X-Forwarded-Proto": "https"})
        assert resp.status_code == 303
        assert set_cookie(resp)[COOKIE_NAME]["secure"] is True
        resp = await client.post("/admin/logout", headers={"X-Forwarded-Proto": "https"})
        assert set_cookie(resp)[COOKIE_NAME]["secure"] is True


async def test_get_login_goes_to_admin() -> None:
    async with edge(config(api_keys=[API_KEY], admin_keys=[ADMIN_KEY])) as (_, _, client):
        resp = await client.get("/admin/login")
        assert resp.status_code == 303
        assert resp.headers["location"] == "/admin"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_a_script_drains_and_undrains_a_node(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="iop.edge")
    async with edge(config(api_keys=[API_KEY], admin_keys=[ADMIN_KEY])) as (handle, _, client):
        # An admin key, not a client key.
        resp = await client.post("/admin/nodes/n1/drain", headers=bearer(API_KEY))
        assert resp.status_code == 401
        validate_error(resp.json())

        resp = await client.post(
            "/admin/nodes/n1/drain", headers=bearer(ADMIN_KEY), json={"reason": "kernel\nupgrade"}
        )
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["changed"] is True
        assert body["connected"] is True
        assert body["drained"]["reason"] == "kernel upgrade"  # one line
        assert body["drained"]["by"] == "admin key from 127.0.0.1"
        again = await client.post("/admin/nodes/n1/drain", headers=bearer(ADMIN_KEY))
        assert again.json()["changed"] is False
        assert again.json()["drained"]["reason"] == "kernel upgrade"

        nodes = (await client.get("/admin/nodes", headers=bearer(ADMIN_KEY))).json()
        assert nodes["nodes"][0]["drained"]["reason"] == "kernel upgrade"
        assert list(nodes["drained"]) == ["n1"]
        metrics = await client.get("/metrics", headers=bearer(ADMIN_KEY))
        assert 'iop_node_drained{node="n1"} 1.0' in metrics.text
        # The last node drained: a request is refused at once, saying why.
        resp = await client.post(
            "/v1/chat/completions",
            headers=bearer(API_KEY),
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert resp.status_code == 503
        validate_error(resp.json())
        assert resp.json()["error"]["code"] == "model_unavailable"
        assert (
            "node n1 is drained by an operator (kernel upgrade)" in resp.json()["error"]["message"]
        )

        resp = await client.post("/admin/nodes/n1/undrain", headers=bearer(ADMIN_KEY))
        assert resp.status_code == 200
        assert resp.json() == {
            "id": "n1",
            "drained": None,
            "connected": True,
            "runs": 0,
            "changed": True,
        }
        assert handle.core.registry.drained == {}

        for verb in ("drain", "undrain"):
            resp = await client.post(f"/admin/nodes/gpu-9/{verb}", headers=bearer(ADMIN_KEY))
            assert resp.status_code == 404
            validate_error(resp.json())
            assert resp.json()["error"]["code"] == "node_not_found"
    assert "node n1 drained by admin key from 127.0.0.1 (kernel upgrade)" in caplog.text
    assert "node n1 undrained by admin key from 127.0.0.1" in caplog.text
    assert ADMIN_KEY not in caplog.text


async def test_a_drain_request_is_bounded_and_checked() -> None:
    async with edge(config(admin_keys=[ADMIN_KEY])) as (handle, _, client):
        url, auth = "/admin/nodes/n1/drain", bearer(ADMIN_KEY)
        cases = [
            ({"json": {"reason": "x" * 201}}, 400, "invalid_value"),
            ({"json": {"why": "x"}}, 400, "invalid_json"),
            (
                {"content": b"not json", "headers": {"Content-Type": "application/json"}},
                400,
                "invalid_json",
            ),
            ({"json": {"reason": "x" * 5000}}, 413, "request_entity_too_large"),
            (
                {"content": b"reason", "headers": {"Content-Type": "text/plain"}},
                415,
                "unsupported_media_type",
            ),
        ]
        for kwargs, status, code in cases:
            headers = {**auth, **kwargs.pop("headers", {})}  # type: ignore[dict-item]
            resp = await client.post(url, headers=headers, **kwargs)  # type: ignore[arg-type]
            assert (resp.status_code, resp.json()["error"]["code"]) == (status, code), kwargs
            validate_error(resp.json())
        assert handle.core.registry.drained == {}
        # A cross-site form carrying the cookie is refused before anything else.
        token = await logged_in(client, ADMIN_KEY)
        resp = await client.post(
            url,
            data={"reason": "x"},
            headers={**with_cookie(token), "Origin": "https://evil.example"},
        )
        assert resp.status_code == 403
        assert resp.json()["error"]["code"] == "cross_origin"
        assert handle.core.registry.drained == {}


async def test_the_pages_drain_button_posts_a_form_and_comes_back() -> None:
    async with edge(config(admin_keys=[ADMIN_KEY])) as (handle, _, client):
        token = await logged_in(client, ADMIN_KEY)
        page = (await client.get("/admin", headers=with_cookie(token))).text
        assert "action='/admin/nodes/n1/drain'" in page
        assert "Placement: least_loaded" in page
        # Without a session, a form gets the login page, and nothing changes.
        resp = await client.post("/admin/nodes/n1/drain", data={"reason": "x"})
        assert resp.status_code == 401
        assert is_login_page(resp)
        resp = await client.post(
            "/admin/nodes/n1/drain", data={"reason": "disk <b>"}, headers=with_cookie(token)
        )
        assert resp.status_code == 303
        assert resp.headers["location"] == "/admin"
        assert handle.core.registry.drained["n1"].by == "admin session from 127.0.0.1"
        page = (await client.get("/admin", headers=with_cookie(token))).text
        assert "action='/admin/nodes/n1/undrain'" in page
        assert "disk &lt;b&gt;" in page
        # A browser posts a form without fields as an empty urlencoded body.
        form = {"Content-Type": "application/x-www-form-urlencoded"}
        resp = await client.post(
            "/admin/nodes/n1/undrain", content=b"", headers={**with_cookie(token), **form}
        )
        assert resp.status_code == 303
        assert handle.core.registry.drained == {}


async def test_an_open_admin_drains_too_and_says_so() -> None:
    async with edge() as (handle, node, client):
        resp = await client.post("/admin/nodes/n1/drain")
        assert resp.status_code == 200
        assert resp.json()["drained"]["by"] == "open admin (no admin key set) from 127.0.0.1"
        resp = await client.get("/admin")
        assert "n1 (drained)" in resp.text
        assert "action='/admin/nodes/n1/undrain'" in resp.text
        # A drained node that left keeps its row (and its button).
        assert node is not None
        await node.chan.aclose()
        with trio.fail_after(10):
            while handle.core.registry.nodes:
                await trio.sleep(0.01)
        resp = await client.get("/admin")
        assert "action='/admin/nodes/n1/undrain'" in resp.text
        assert "not connected" in resp.text
        assert (await client.post("/admin/nodes/n1/undrain")).json()["connected"] is False
