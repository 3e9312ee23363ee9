"""Who may open ``/admin`` and ``/metrics``: admin keys, signed session
cookies, metrics keys, a brake on guessing.

Theory of operation. The admin keys are ``server.admin_keys``, and only
those: a client key (a tenant's ``key_sha256``, or ``server.api_keys``) never
opens the admin views, which show every tenant's runs and can drain nodes
(docs/operations.md, "Tenants and limits"). Three states, set at start-up
and by a config reload (``AdminGate.reconfigure``):

* **keyed**: admin keys are set; a request needs one (below);
* **off**: clients have keys and no admin key is set; every admin request
  is refused (``Verdict.DISABLED``), with a message naming the key that
  turns the views on: an edge that checks who its clients are does not show
  them to whoever asks;
* **open**: no key of any kind (a local edge, ``iop up``); everyone is
  allowed (bind the edge to loopback then: docs/operations.md).

A request is allowed when it carries

* a valid session cookie (``COOKIE_NAME``), which a person gets by typing a
  key into the login form: :meth:`AdminGate.login`, then
  :meth:`AdminGate.issue`; or
* ``Authorization: Bearer KEY`` with an admin key (scripts, ``curl``).

A session token is ``v1.<session id>.<expiry ms>.<mac>``, the MAC being
HMAC-SHA256 over the first three fields with a secret drawn at random when
the gate is made, once per process: the cookie never holds the key, cannot be
forged or extended without the secret, and every session ends when the
process restarts. The expiry is on the process's monotonic clock (the secret
does not outlive the process, so neither need the clock), so a wall-clock step
neither ends nor extends a session. :meth:`AdminGate.logout` revokes the
token's session id until the token would have expired anyway.

Every key comparison is constant-time over all keys. Wrong keys (from the form
or a Bearer header on ``/admin*``) are counted across all clients in a fixed
window of ``BRAKE_WINDOW_S``: past ``failures_per_minute`` in one window,
:meth:`check` and :meth:`login` answer ``THROTTLED`` without looking at the
key until the window ends (checking it would tell a guesser when it is right).
A valid session cookie is still honoured: guessing the MAC is hopeless.

``/metrics`` (``MetricsGate``) names every tenant and its usage: open when
no client has a key and no ``server.metrics_keys`` is set, else it needs
``Authorization: Bearer`` with a metrics key (a Prometheus scrape
credential, which opens nothing else) or an admin key; with client keys and
neither kind set it is off. Wrong metrics keys are not braked: a scraper
misconfigured for a minute must not lock the operator out of ``/admin``,
and the keys, random, are no easier to guess than the API's.

Sans-IO: a function of its inputs and of an injectable clock; the secret is
never part of a repr or a log line.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import math
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Final

__all__ = [
    "ADMIN_OFF_MESSAGE",
    "BRAKE_WINDOW_S",
    "COOKIE_NAME",
    "METRICS_OFF_MESSAGE",
    "AdminGate",
    "MetricsGate",
    "Verdict",
    "key_matches",
]

COOKIE_NAME: Final = "iop_admin"
# The window the wrong-key brake counts in (`failures_per_minute`).
BRAKE_WINDOW_S: Final = 60.0
_VERSION: Final = "v1"
# 128 bits: session ids are not secrets (the MAC is), only unique.
_SESSION_ID_BYTES: Final = 16
# 256 bits, HMAC-SHA256's block-size-safe key length.
_SECRET_BYTES: Final = 32

ADMIN_OFF_MESSAGE: Final = (
    "The admin views are off: this edge has client keys ([[tenants]] or "
    "server.api_keys) and no admin key, and a client key never opens them. "
    "Set server.admin_keys to turn them on."
)
METRICS_OFF_MESSAGE: Final = (
    "/metrics is off: this edge has client keys ([[tenants]] or server.api_keys), "
    "and its metrics name every tenant. Set server.metrics_keys (a scrape key) "
    "or server.admin_keys; the scraper sends it in an Authorization header."
)


class Verdict(enum.Enum):
    """What the gate says about one request."""

    ALLOWED = "allowed"
    DENIED = "denied"  # no credentials, or wrong ones
    THROTTLED = "throttled"  # too many wrong keys this window: try later
    DISABLED = "disabled"  # off: clients have keys and no key of this kind is set


def key_matches(candidate: bytes, keys: Sequence[bytes]) -> bool:
    """Whether ``candidate`` is one of ``keys``, comparing against every key in constant time."""
    ok = False
    for k in keys:
        ok |= hmac.compare_digest(candidate, k)
    return ok


def _bearer(authorization: str | None) -> bytes | None:
    if authorization is None or not authorization.startswith("Bearer "):
        return None
    return authorization[len("Bearer ") :].encode()


class AdminGate:
    """The admin keys, the sessions issued for them, and the wrong-key brake.

    Args:
        keys: ``server.admin_keys``.
        clients_keyed: The edge has client keys (tenants or ``api_keys``):
            without admin keys the gate is then off, not open.
    """

    def __init__(
        self,
        keys: Sequence[str],
        *,
        session_s: float,
        failures_per_minute: int,
        clients_keyed: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._keys = [k.encode() for k in keys]
        self.off = not keys and clients_keyed
        self.session_s = session_s
        self.failures_per_minute = failures_per_minute
        self._clock = clock
        self._secret = secrets.token_bytes(_SECRET_BYTES)
        # Revoked session id -> its token's expiry (forgotten after that).
        self._revoked: dict[str, int] = {}
        self._window_end = -math.inf
        self._failures = 0

    def reconfigure(
        self,
        keys: Sequence[str],
        *,
        session_s: float,
        failures_per_minute: int,
        clients_keyed: bool = False,
    ) -> None:
        """Take the admin keys and limits of a reloaded config.

        When a key is taken away, every session ends (a new secret): a
        session does not say which key opened it, and one opened with a
        revoked key must not outlive it. Sessions issued afterwards last
        the new ``session_s``.
        """
        new = [k.encode() for k in keys]
        if not set(self._keys) <= set(new):
            self._secret = secrets.token_bytes(_SECRET_BYTES)
            self._revoked.clear()
        self._keys = new
        self.off = not keys and clients_keyed
        self.session_s = session_s
        self.failures_per_minute = failures_per_minute

    def __repr__(self) -> str:
        state = " off" if self.off else ""
        return f"<AdminGate keys={len(self._keys)}{state} session_s={self.session_s:g}>"

    @property
    def open(self) -> bool:
        """No key of any kind is configured: everyone may open ``/admin``."""
        return not self._keys and not self.off

    # --- the brake -------------------------------------------------------------------

    def retry_after(self) -> float | None:
        """Seconds until keys are checked again, or None when they are checked now."""
        now = self._clock()
        if now >= self._window_end:
            return None
        if self._failures < self.failures_per_minute:
            return None
        return self._window_end - now

    @property
    def failures(self) -> int:
        """Wrong keys counted in the current window."""
        return 0 if self._clock() >= self._window_end else self._failures

    def _fail(self) -> None:
        now = self._clock()
        if now >= self._window_end:
            self._window_end = now + BRAKE_WINDOW_S
            self._failures = 0
        self._failures += 1

    def _try_key(self, key: bytes) -> Verdict:
        if self.retry_after() is not None:
            return Verdict.THROTTLED
        if key_matches(key, self._keys):
            return Verdict.ALLOWED
        self._fail()
        return Verdict.DENIED

    # --- requests --------------------------------------------------------------------

    def check(self, cookie: str | None, authorization: str | None) -> Verdict:
        """A request's verdict from its session cookie and ``Authorization`` header."""
        if self.off:
            return Verdict.DISABLED
        if self.open:
            return Verdict.ALLOWED
        if cookie and self.session_valid(cookie):
            return Verdict.ALLOWED
        key = _bearer(authorization)
        if key is None:
            return Verdict.DENIED
        return self._try_key(key)

    def login(self, key: str) -> Verdict:
        """A key typed into the login form (counted by the brake when wrong)."""
        if self.off:
            return Verdict.DISABLED
        if self.open:
            return Verdict.ALLOWED
        return self._try_key(key.encode())

    # --- sessions --------------------------------------------------------------------

    def _mac(self, payload: str) -> str:
        return hmac.new(self._secret, payload.encode(), hashlib.sha256).hexdigest()

    def issue(self) -> str:
        """A new session token, valid for ``session_s`` (call after ``login`` allowed)."""
        session_id = secrets.token_urlsafe(_SESSION_ID_BYTES)
        expires_ms = int((self._clock() + self.session_s) * 1000)
        payload = f"{_VERSION}.{session_id}.{expires_ms}"
        return f"{payload}.{self._mac(payload)}"

    def _verify(self, token: str) -> tuple[str, int] | None:
        """(session id, expiry ms) of a token this gate signed, or None."""
        parts = token.split(".")
        if len(parts) != 4 or parts[0] != _VERSION:
            return None
        payload = ".".join(parts[:3])
        # Bytes: compare_digest refuses non-ASCII str, and a cookie may hold anything.
        if not hmac.compare_digest(parts[3].encode(), self._mac(payload).encode()):
            return None
        # Signed by us, so the expiry is the integer issue() wrote.
        return parts[1], int(parts[2])

    def session_valid(self, token: str) -> bool:
        """Whether ``token`` is a session this gate issued, not expired nor logged out."""
        verified = self._verify(token)
        if verified is None:
            return False
        session_id, expires_ms = verified
        return self._clock() * 1000 < expires_ms and session_id not in self._revoked

    def logout(self, token: str | None) -> None:
        """End the session of ``token`` (a no-op for anything else)."""
        verified = self._verify(token) if token else None
        if verified is None:
            return
        now_ms = self._clock() * 1000
        # Forget revocations whose tokens have expired: they are refused anyway.
        for sid in [s for s, exp in self._revoked.items() if exp <= now_ms]:
            del self._revoked[sid]
        session_id, expires_ms = verified
        if expires_ms > now_ms:
            self._revoked[session_id] = expires_ms


class MetricsGate:
    """Who may read ``/metrics`` (module docstring).

    Args:
        metrics_keys: ``server.metrics_keys``.
        admin_keys: ``server.admin_keys`` (they open ``/metrics`` too).
        clients_keyed: The edge has client keys (tenants or ``api_keys``).
    """

    def __init__(
        self, metrics_keys: Sequence[str], admin_keys: Sequence[str], *, clients_keyed: bool
    ) -> None:
        self.reconfigure(metrics_keys, admin_keys, clients_keyed=clients_keyed)

    def reconfigure(
        self, metrics_keys: Sequence[str], admin_keys: Sequence[str], *, clients_keyed: bool
    ) -> None:
        """Take the keys of a reloaded config (or the first)."""
        self._keys = [k.encode() for k in (*metrics_keys, *admin_keys)]
        self.open = not clients_keyed and not metrics_keys
        self.off = not self.open and not self._keys

    def __repr__(self) -> str:
        state = "open" if self.open else "off" if self.off else f"keys={len(self._keys)}"
        return f"<MetricsGate {state}>"

    def check(self, authorization: str | None) -> Verdict:
        """A scrape's verdict from its ``Authorization`` header."""
        if self.open:
            return Verdict.ALLOWED
        if self.off:
            return Verdict.DISABLED
        key = _bearer(authorization)
        if key is not None and key_matches(key, self._keys):
            return Verdict.ALLOWED
        return Verdict.DENIED
