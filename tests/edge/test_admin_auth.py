"""The admin gate (sans-IO): keys, session tokens, logout and the wrong-key brake,
on a hand-driven clock; the metrics gate; and the config rule that an operator's
key is never a client's."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from iop.config import EdgeConfig, load_config
from iop.edge.routes._admin_auth import BRAKE_WINDOW_S, AdminGate, MetricsGate, Verdict, key_matches
from iop.errors import ConfigError

KEY = "sk-admin-1"
OTHER = "sk-admin-2"
SESSION_S = 100.0
LIMIT = 3


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def gate(clock: Clock) -> AdminGate:
    return AdminGate([KEY, OTHER], session_s=SESSION_S, failures_per_minute=LIMIT, clock=clock)


def test_key_matches_any_key_exactly() -> None:
    keys = [b"a-key", b"b-key"]
    assert key_matches(b"a-key", keys)
    assert key_matches(b"b-key", keys)
    assert not key_matches(b"a-ke", keys)
    assert not key_matches(b"a-key ", keys)
    assert not key_matches(b"", keys)
    assert not key_matches(b"a-key", [])


def test_open_gate_allows_everything() -> None:
    gate = AdminGate([], session_s=SESSION_S, failures_per_minute=LIMIT)
    assert gate.open
    assert gate.check(None, None) is Verdict.ALLOWED
    assert gate.login("anything") is Verdict.ALLOWED


def test_a_gate_without_admin_keys_is_off_when_clients_have_keys() -> None:
    gate = AdminGate([], session_s=SESSION_S, failures_per_minute=LIMIT, clients_keyed=True)
    assert not gate.open
    assert gate.off
    assert gate.check(None, None) is Verdict.DISABLED
    assert gate.check(None, f"Bearer {KEY}") is Verdict.DISABLED
    assert gate.login(KEY) is Verdict.DISABLED
    assert gate.failures == 0  # nothing to guess: no key is counted
    assert "off" in repr(gate)
    keyed = AdminGate([KEY], session_s=SESSION_S, failures_per_minute=LIMIT, clients_keyed=True)
    assert not keyed.off
    assert keyed.check(None, f"Bearer {KEY}") is Verdict.ALLOWED


def test_the_metrics_gate() -> None:
    # No key of any kind: open. Admin keys alone (an open API) leave it open.
    for gate in (
        MetricsGate([], [], clients_keyed=False),
        MetricsGate([], [KEY], clients_keyed=False),
    ):
        assert gate.check(None) is Verdict.ALLOWED
    # Client keys and nothing to scrape with: off.
    assert MetricsGate([], [], clients_keyed=True).check(f"Bearer {KEY}") is Verdict.DISABLED
    # A metrics key set, even on an open API: needed; an admin key opens it too.
    for clients_keyed in (False, True):
        gate = MetricsGate(["m-key"], [KEY], clients_keyed=clients_keyed)
        assert gate.check("Bearer m-key") is Verdict.ALLOWED
        assert gate.check(f"Bearer {KEY}") is Verdict.ALLOWED
        for wrong in (None, "Bearer nope", "m-key", "Bearer ", f"Basic {KEY}"):
            assert gate.check(wrong) is Verdict.DENIED
    assert "m-key" not in repr(MetricsGate(["m-key"], [], clients_keyed=True))


def test_bearer_header(gate: AdminGate) -> None:
    assert not gate.open
    assert gate.check(None, None) is Verdict.DENIED
    assert gate.check(None, f"Bearer {KEY}") is Verdict.ALLOWED
    assert gate.check(None, f"Bearer {OTHER}") is Verdict.ALLOWED
    assert gate.check(None, "Bearer nope") is Verdict.DENIED
    assert gate.check(None, f"Basic {KEY}") is Verdict.DENIED
    assert gate.check(None, KEY) is Verdict.DENIED


def test_session_token_is_not_the_key_and_is_valid_until_it_expires(
    gate: AdminGate, clock: Clock
) -> None:
    assert gate.login(KEY) is Verdict.ALLOWED
    token = gate.issue()
    assert KEY not in token
    assert OTHER not in token
    assert gate.check(token, None) is Verdict.ALLOWED
    clock.now += SESSION_S - 0.01
    assert gate.session_valid(token)
    clock.now += 0.02
    assert not gate.session_valid(token)
    assert gate.check(token, None) is Verdict.DENIED


def test_every_session_is_its_own(gate: AdminGate) -> None:
    a, b = gate.issue(), gate.issue()
    assert a != b
    gate.logout(a)
    assert not gate.session_valid(a)
    assert gate.session_valid(b)


@pytest.mark.parametrize(
    "mangle",
    [
        pytest.param(lambda t: t[:-1] + ("0" if t[-1] != "0" else "1"), id="mac"),
        pytest.param(
            lambda t: ".".join(
                [*t.split(".")[:2], str(int(t.split(".")[2]) * 10), t.split(".")[3]]
            ),
            id="extended-expiry",
        ),
        pytest.param(lambda t: "v2" + t[2:], id="version"),
        pytest.param(lambda t: t + ".x", id="extra-field"),
        pytest.param(lambda t: t.rsplit(".", 1)[0], id="no-mac"),
        pytest.param(lambda t: "", id="empty"),
        pytest.param(lambda t: "v1.é.1.ü", id="non-ascii"),
        pytest.param(lambda t: KEY, id="the-key-itself"),
    ],
)
def test_forged_tokens_are_refused(gate: AdminGate, mangle: object) -> None:
    token = gate.issue()
    forged = mangle(token)  # type: ignore[operator]
    assert not gate.session_valid(forged)
    assert gate.check(forged, None) is Verdict.DENIED
    gate.logout(forged)  # a no-op, never an error
    assert gate.session_valid(token)


def test_another_process_cannot_vouch_for_a_token(clock: Clock) -> None:
    """The secret is per process: a token from one gate (a previous run of
    the edge) is worthless to another with the same keys."""
    first = AdminGate([KEY], session_s=SESSION_S, failures_per_minute=LIMIT, clock=clock)
    second = AdminGate([KEY], session_s=SESSION_S, failures_per_minute=LIMIT, clock=clock)
    token = first.issue()
    assert first.session_valid(token)
    assert not second.session_valid(token)


def test_logout_ends_the_session_and_is_forgotten_after_expiry(
    gate: AdminGate, clock: Clock
) -> None:
    token = gate.issue()
    gate.logout(token)
    assert gate.check(token, None) is Verdict.DENIED
    gate.logout(token)  # twice is fine
    gate.logout(None)
    clock.now += SESSION_S + 1
    later = gate.issue()
    gate.logout(later)  # prunes the expired revocation
    assert gate._revoked.keys() == {later.split(".")[1]}
    assert not gate.session_valid(token)
    gate.logout(token)  # expired already: nothing to remember
    assert gate._revoked.keys() == {later.split(".")[1]}


def test_brake_throttles_after_the_limit_until_the_window_ends(
    gate: AdminGate, clock: Clock
) -> None:
    for i in range(LIMIT):
        assert gate.retry_after() is None
        assert gate.login(f"guess-{i}") is Verdict.DENIED
        assert gate.failures == i + 1
    # Past the limit the key is not even looked at: the right one is refused too.
    assert gate.login(KEY) is Verdict.THROTTLED
    assert gate.check(None, f"Bearer {KEY}") is Verdict.THROTTLED
    assert gate.check(None, "Bearer guess") is Verdict.THROTTLED
    assert gate.retry_after() == pytest.approx(BRAKE_WINDOW_S)
    # A session obtained before still works.
    assert gate.check(gate.issue(), None) is Verdict.ALLOWED
    clock.now += BRAKE_WINDOW_S - 1
    assert gate.retry_after() == pytest.approx(1)
    assert gate.login(KEY) is Verdict.THROTTLED
    clock.now += 1
    assert gate.retry_after() is None
    assert gate.failures == 0
    assert gate.login(KEY) is Verdict.ALLOWED


def test_bearer_guesses_count_too(gate: AdminGate) -> None:
    for _ in range(LIMIT):
        assert gate.check(None, "Bearer guess") is Verdict.DENIED
    assert gate.login(KEY) is Verdict.THROTTLED


def test_right_keys_do_not_count(gate: AdminGate) -> None:
    for _ in range(LIMIT * 3):
        assert gate.login(KEY) is Verdict.ALLOWED
        assert gate.check(None, f"Bearer {KEY}") is Verdict.ALLOWED
    assert gate.failures == 0


def test_repr_shows_no_secret_and_no_key(gate: AdminGate) -> None:
    text = repr(gate)
    assert KEY not in text
    assert gate._secret.hex() not in text
    assert "keys=2" in text


@pytest.mark.parametrize(
    ("server", "message"),
    [
        ("admin_session_s = 0", "admin_session_s must be > 0"),
        ("admin_login_failures_per_minute = 0", "admin_login_failures_per_minute must be >= 1"),
        ('admin_keys = [""]', "must not contain an empty key"),
        # An empty key would let `Authorization: Bearer ` in.
        ('api_keys = ["${IOP_TEST_EMPTY}"]', "must not contain an empty key"),
        ('metrics_keys = [""]', "must not contain an empty key"),
        ('admin_key = ["k"]', "unknown key 'server.admin_key'"),
        ('api_keys = ["k"]\nadmin_keys = ["k"]', "a key in server.admin_keys is also a client"),
        ('api_keys = ["k"]\nmetrics_keys = ["k"]', "a key in server.metrics_keys is also a"),
        (
            f'admin_keys = ["k"]\n[[tenants]]\nname = "t"\n'
            f'key_sha256 = ["{hashlib.sha256(b"k").hexdigest()}"]',
            "a key in server.admin_keys is also a client key",
        ),
    ],
)
def test_admin_settings_are_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, server: str, message: str
) -> None:
    monkeypatch.setenv("IOP_TEST_EMPTY", "")
    p = tmp_path / "edge.toml"
    p.write_text(f"[server]\n{server}\n")
    with pytest.raises(ConfigError, match=message):
        load_config(p, EdgeConfig)


def test_admin_settings_defaults(tmp_path: Path) -> None:
    p = tmp_path / "edge.toml"
    p.write_text('[server]\nadmin_keys = ["k"]\n')
    server = load_config(p, EdgeConfig).server
    assert server.admin_keys == ["k"]
    assert server.admin_session_s == 8 * 3600
    assert server.admin_login_failures_per_minute == 10
