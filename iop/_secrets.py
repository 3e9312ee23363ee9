"""Masking of configured secret values (sans-IO).

``iop._log.redact`` hides the values of secret-looking *keys*
(``Authorization: ...``, ``api_key=...``). That cannot catch a secret that
arrives without its key, which is what OpenAI-compatible servers do when they
refuse a credential: ``Incorrect API key provided: Bearer sk-...``. This
module masks the configured secret *values* themselves, wherever they appear:

* ``SecretMasker`` is a pure object: built from a set of secret strings, its
  ``mask(text)`` replaces every occurrence of any of them (and of their
  derived forms, ``secret_forms``) with ``***``.
* ``edge_secrets`` / ``node_secrets`` / ``up_secrets`` list the secrets of a
  loaded config: client API keys, node tokens, instance header values.
* ``register_secrets`` adds secrets to the process-wide masker that the log
  formatter applies to every record; ``mask`` applies it. Each CLI command
  registers its config's secrets right after loading it, before anything can
  log.

Values shorter than ``MIN_SECRET_LENGTH`` are not masked: they would match
ordinary words and numbers all over the text (a token ``test`` would turn
every ``latest`` into ``la***``), and a credential that short is guessable
anyway. ``register_secrets`` logs a warning naming where each one came from
(never the value).
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import re
from collections.abc import Iterable, Iterator
from typing import Final, TypeVar
from urllib.parse import quote

import msgspec

from iop.config import EdgeConfig, HTTPInstance, InstanceConfig, NodeConfig, UpConfig
from iop.events import Cancelled, Error, RuntimeEvent

__all__ = [
    "MASK",
    "MIN_SECRET_LENGTH",
    "NOT_SECRET_HEADERS",
    "Secret",
    "SecretMasker",
    "credential",
    "edge_secrets",
    "mask",
    "mask_event",
    "node_secrets",
    "register_secrets",
    "registered_masker",
    "secret_forms",
    "up_secrets",
]

log = logging.getLogger("iop.secrets")

MASK: Final = "***"
# Shorter values would match ordinary text (see the module docstring); a
# credential that short offers no protection worth masking for.
MIN_SECRET_LENGTH: Final = 8
# Instance headers that configure the request, not who makes it: their
# values ("application/json") are not masked.
NOT_SECRET_HEADERS: Final = frozenset({"content-type", "accept", "accept-encoding", "user-agent"})

# HTTP authentication schemes whose credential follows the scheme name.
_SCHEME: Final = re.compile(r"(?i)^\s*(?:bearer|basic|token|apikey|api-key|key)\s+(\S+)\s*$")

T = TypeVar("T")

Secret = tuple[str, str]
"""A secret value and where it came from (``edge.server.api_keys[0]``), for warnings."""


def _b64(data: bytes) -> Iterator[str]:
    for enc in (base64.b64encode(data), base64.urlsafe_b64encode(data)):
        text = enc.decode("ascii")
        yield text
        yield text.rstrip("=")


def credential(value: str) -> str:
    """The credential of an ``Authorization``-style value (``X`` of ``Bearer X``), else ``value``."""
    m = _SCHEME.match(value)
    return m.group(1) if m else value


def secret_forms(value: str) -> set[str]:
    """``value`` and the forms it may take in a message.

    * the credential of an ``Authorization``-style value (``Bearer X``,
      ``Basic X``, ...): ``X`` alone, which masks the value as
      ``Bearer ***`` (the scheme stays readable), unless ``X`` is too short
      to be masked alone: then the whole value;
    * for ``Basic``: the decoded ``user:pass`` and the password;
    * the base64 of the value (and of ``X``), as a ``Basic`` header or a
      proxy would carry it;
    * its URL-encoded and JSON-escaped forms, when they differ.

    Forms shorter than ``MIN_SECRET_LENGTH`` are left out, and a value that
    short has no forms at all.
    """
    if len(value) < MIN_SECRET_LENGTH:
        return set()
    forms = {value}
    encoded = {value}
    cred = credential(value)
    if cred != value:
        if len(cred) >= MIN_SECRET_LENGTH:
            forms = {cred}
        encoded.add(cred)
        if value.strip().lower().startswith("basic"):
            try:
                decoded = base64.b64decode(cred + "=" * (-len(cred) % 4), validate=True)
                plain = decoded.decode("utf-8")
            except (binascii.Error, UnicodeDecodeError):
                plain = ""
            if ":" in plain:
                forms.add(plain)
                forms.add(plain.split(":", 1)[1])
    for form in list(forms):
        forms.add(quote(form, safe=""))
        forms.add(json.dumps(form)[1:-1])
    for form in encoded | forms:
        forms.update(_b64(form.encode()))
    return {f for f in forms if len(f) >= MIN_SECRET_LENGTH}


class SecretMasker:
    """Replaces every occurrence of a set of secret strings with ``***``.

    Pure and immutable: ``with_secrets`` returns a new masker. Matching
    ignores case (a backend that echoes a key lower-cased still gives all
    of it but its letters' case away; a secret is at least
    ``MIN_SECRET_LENGTH`` characters, so nothing else matches by chance)
    and prefers the longest form when two overlap.

    Args:
        values: Secret values; each is expanded with ``secret_forms``, and
            values shorter than ``MIN_SECRET_LENGTH`` are ignored.
    """

    __slots__ = ("_pattern", "_values")

    def __init__(self, values: Iterable[str] = ()) -> None:
        self._values = frozenset(v for v in values if v)
        forms: set[str] = set()
        for v in self._values:
            forms |= secret_forms(v)
        self._pattern = (
            re.compile(
                "|".join(re.escape(f) for f in sorted(forms, key=len, reverse=True)),
                re.IGNORECASE,
            )
            if forms
            else None
        )

    @property
    def values(self) -> frozenset[str]:
        """The secret values this masker was built from."""
        return self._values

    def __bool__(self) -> bool:
        return self._pattern is not None

    def with_secrets(self, values: Iterable[str]) -> SecretMasker:
        """A masker for these secrets and ``values``."""
        return SecretMasker(self._values | set(values))

    def mask(self, text: str) -> str:
        """``text`` with every secret (and derived form) replaced by ``***``."""
        if self._pattern is None or not text:
            return text
        return self._pattern.sub(MASK, text)

    def mask_tree(self, value: T) -> T:
        """A copy of a JSON-like tree (dicts, lists, strings...) with every string masked."""
        if self._pattern is None:
            return value
        out: object
        if isinstance(value, str):
            out = self.mask(value)
        elif isinstance(value, dict):
            out = {self.mask_tree(k): self.mask_tree(v) for k, v in value.items()}
        elif isinstance(value, list | tuple):
            out = type(value)(self.mask_tree(v) for v in value)
        else:
            out = value
        return out  # type: ignore[return-value]


def mask_event(event: RuntimeEvent, masker: SecretMasker) -> RuntimeEvent:
    """``event`` with ``masker`` applied to its message (``Error``, ``Cancelled``).

    A backend that refuses a credential often echoes it ("Incorrect API key
    provided: Bearer sk-..."): such a message must not carry it on to the
    edge, its logs and its clients.
    """
    if isinstance(event, Error | Cancelled) and event.message:
        masked = masker.mask(event.message)
        if masked != event.message:
            return msgspec.structs.replace(event, message=masked)
    return event


# --- secrets of a config -----------------------------------------------------------


def _instance_secrets(instances: Iterable[InstanceConfig], where: str) -> Iterator[Secret]:
    for inst in instances:
        if not isinstance(inst, HTTPInstance):
            continue
        for name, value in inst.headers.items():
            if name.lower() not in NOT_SECRET_HEADERS:
                yield value, f"{where}[{inst.name}].headers.{name}"


def edge_secrets(cfg: EdgeConfig, where: str = "edge") -> list[Secret]:
    """Client API keys, admin and metrics keys, node tokens and the cache salt key of an edge config."""
    server = cfg.server
    out = [(k, f"{where}.server.api_keys[{i}]") for i, k in enumerate(server.api_keys)]
    out += [(k, f"{where}.server.admin_keys[{i}]") for i, k in enumerate(server.admin_keys)]
    out += [(k, f"{where}.server.metrics_keys[{i}]") for i, k in enumerate(server.metrics_keys)]
    out += [(t, f"{where}.link.node_tokens[{i}]") for i, t in enumerate(cfg.link.node_tokens)]
    out += [(v, f"{where}.tracing.otlp_headers.{k}") for k, v in cfg.tracing.otlp_headers.items()]
    if cfg.tenancy.cache_salt_key:
        out.append((cfg.tenancy.cache_salt_key, f"{where}.tenancy.cache_salt_key"))
    return out


def node_secrets(cfg: NodeConfig) -> list[Secret]:
    """Edge tokens and instance header values of a node config."""
    out = [(e.token, f"node.edges[{i}].token") for i, e in enumerate(cfg.node.edges)]
    out += _instance_secrets(cfg.instances, "instances")
    out += [(v, f"tracing.otlp_headers.{k}") for k, v in cfg.tracing.otlp_headers.items()]
    return out


def up_secrets(cfg: UpConfig) -> list[Secret]:
    """The edge's secrets and the instances' header values of an ``iop up`` config."""
    return [*edge_secrets(cfg.edge), *_instance_secrets(cfg.instances, "instances")]


# --- the process-wide masker (logging) ---------------------------------------------

_registered = SecretMasker()


def register_secrets(secrets: Iterable[Secret]) -> SecretMasker:
    """Add secrets to the process-wide masker (the one logs go through).

    Secrets shorter than ``MIN_SECRET_LENGTH`` are not masked, and a
    ``Bearer X`` whose ``X`` is that short is masked only as a whole: each
    gets a warning naming where it came from. Returns the new masker.
    """
    global _registered
    values = []
    for value, where in secrets:
        if not value:
            continue
        if len(credential(value)) < MIN_SECRET_LENGTH:
            log.warning(
                "the secret at %s is shorter than %d characters: it is not masked in logs "
                "and error messages%s; use a longer one",
                where,
                MIN_SECRET_LENGTH,
                "" if len(value) < MIN_SECRET_LENGTH else " (but as a whole header value)",
            )
        if len(value) >= MIN_SECRET_LENGTH:
            values.append(value)
    if values:
        _registered = _registered.with_secrets(values)
    return _registered


def registered_masker() -> SecretMasker:
    """The process-wide masker as registered so far."""
    return _registered


def mask(text: str) -> str:
    """``text`` through the process-wide masker."""
    return _registered.mask(text)
