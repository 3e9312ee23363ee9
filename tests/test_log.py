"""Log redaction: secret-looking keys (``_log.redact``) and configured secret values."""

from __future__ import annotations

import base64
import io
import logging
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from iop import _log, _secrets
from iop._log import configure_logging, may_hold_secret, redact

CRED = "c2VjcmV0LXZhbHVlLTQy"  # what every case below must hide
BASIC = base64.b64encode(b"alice:wonderland-pass").decode()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # HTTP header lines: the scheme stays readable, the credential goes.
        (f"Authorization: Bearer {CRED}", "Authorization: Bearer ***"),
        (f"Authorization: Basic {BASIC}", "Authorization: Basic ***"),
        (f"authorization: bearer {CRED}", "authorization: bearer ***"),
        (f"AUTHORIZATION: BASIC {BASIC}", "AUTHORIZATION: BASIC ***"),
        (f"Proxy-Authorization: Basic {BASIC}", "Proxy-Authorization: Basic ***"),
        (f"Authorization: {CRED}", "Authorization: ***"),
        (f"x-api-key: {CRED}", "x-api-key: ***"),
        (f"X-Api-Key:{CRED}", "X-Api-Key:***"),
        # key=value
        (f"authorization=Bearer {CRED} next=1", "authorization=Bearer *** next=1"),
        (f"api_key={CRED} model=m", "api_key=*** model=m"),
        (f"API-KEY = {CRED}", "API-KEY = ***"),
        (f"token={CRED}", "token=***"),
        (f"node_token={CRED}, other", "node_token=***, other"),
        (f"client_secret={CRED};", "client_secret=***;"),
        (f"password={CRED}&user=bob", "password=***&user=bob"),
        # Python dict reprs and JSON, quoted values with spaces.
        (f"{{'Authorization': 'Bearer {CRED}'}}", "{'Authorization': 'Bearer ***'}"),
        (f"{{'authorization': 'Basic {BASIC}', 'x': 1}}", "{'authorization': 'Basic ***', 'x': 1}"),
        (f'{{"authorization": "Bearer {CRED}"}}', '{"authorization": "Bearer ***"}'),
        (f'{{"Authorization":"Basic {BASIC}"}}', '{"Authorization":"Basic ***"}'),
        (f'{{"api_key": "{CRED}", "n": 2}}', '{"api_key": "***", "n": 2}'),
        ('{"password": "two words here"}', '{"password": "***"}'),
        ("token='has spaces and more'", "token='***'"),
        ('secret="a \\"quoted\\" bit"', 'secret="***"'),
        # JSON inside a JSON string (an error body quoted in a message).
        (f'"{{\\"token\\": \\"{CRED}\\"}}"', '"{\\"token\\": \\"***\\"}"'),
        # Header tuples as h11/hypercorn print them.
        (
            f"[(b'host', b'h'), (b'authorization', b'Bearer {CRED}')]",
            "[(b'host', b'h'), (b'authorization', b'Bearer ***')]",
        ),
        (
            f"(b'x-api-key', b'{CRED}')",
            "(b'x-api-key', b'***')",
        ),
        # URLs.
        (
            f"GET http://h:1/v1/models?api_key={CRED}&x=1",
            "GET http://h:1/v1/models?api_key=***&x=1",
        ),
        (f"https://h/v1?token={CRED}", "https://h/v1?token=***"),
        (f"http://alice:{CRED}@db.local:5432/x", "http://alice:***@db.local:5432/x"),
        (f"wss://alice:{CRED}@edge/v1/link", "wss://alice:***@edge/v1/link"),
        # A credential with no key in front, as backends echo it.
        (
            f"Incorrect API key provided: Bearer {CRED}",
            "Incorrect API key provided: Bearer ***",
        ),
        (f"bad credentials Basic {BASIC}.", "bad credentials Basic ***."),
        ("key sk-proj-abcdefghijklmnop1234 refused", "key sk-*** refused"),
    ],
)
def test_redact_masks_every_header_form(text: str, expected: str) -> None:
    assert redact(text) == expected
    assert CRED not in redact(text)
    assert BASIC not in redact(text)


@pytest.mark.parametrize(
    "text",
    [
        "run abc123 complete finish=stop input_tokens=12 output_tokens=64 ttft_s=0.02",
        "max_tokens=100 reasoning_tokens: 16 tokens_per_s=50",
        "the tokenizer split the prompt into 12 tokens",
        "Basic configuration is in docs/configuration.md",
        "Bearer tokens are checked in constant time",
        "connecting to edge ws://127.0.0.1:8080/v1/link",
        "GET http://127.0.0.1:8000/v1/models 200",
        "node 'n1' presented a bad token",
        "instance status: vllm-sim=available",
        "Authorization header missing",
        "http://user@host/path",
    ],
)
def test_redact_leaves_benign_text_readable(text: str) -> None:
    assert redact(text) == text


# --- the fast path: a line no pattern can match skips them all -------------------

# Pieces of every pattern in ``_log`` (key words, separators, quotes, schemes,
# URL parts, key prefixes), in any case, with the non-ASCII letters that
# ``(?i)`` matches for ASCII ones (Kelvin sign for k, long s for s, dotted
# and dotless i), so that generated lines come near and across every match.
_WORDS = [
    "authorization", "api_key", "api-key", "apikey", "access_key", "key", "token",
    "secret", "password", "passwd", "passw", "bearer", "basic", "digest", "sk-",
    "://", "http", "@", ":", "=", ",", " ", "\t", "\n", "'", '"', "\\", "b'", "(", ")",
    "{", "}", CRED, BASIC, "abcdefghijklmnop1234", "out_tokens=64", "\u212a", "\u017f",
    "\u0130", "\u0131", "\u00e9",
]  # fmt: skip


def _any_case(word: str) -> st.SearchStrategy[str]:
    return st.lists(st.booleans(), min_size=len(word), max_size=len(word)).map(
        lambda ups: "".join(c.upper() if up else c for c, up in zip(word, ups, strict=True))
    )


_PIECES = st.lists(
    st.one_of(st.sampled_from(_WORDS).flatmap(_any_case), st.text(max_size=4)), max_size=8
).map("".join)
# A key word or scheme, a separator and a value: a match, or one character off.
_NEAR = st.tuples(
    _PIECES,
    st.sampled_from(_WORDS[:16]).flatmap(_any_case),
    st.sampled_from(["=", ": ", ":", " = ", "\t", " ", '": "', "': '", '\\": \\"', "', b'", "s="]),
    st.sampled_from([CRED, BASIC, "abcdefghijklmnop1234", "//u:pw@h", "x", ""]),
    _PIECES,
).map("".join)
_URLS = st.tuples(
    _PIECES, st.sampled_from(["http", "wss", "h"]), st.sampled_from(["://", ":/", "//"]),
    st.sampled_from(["alice", "a@b", ""]), st.sampled_from([":", "@", ""]),
    st.sampled_from([CRED, ""]), st.sampled_from(["@host/x", "/x", ""]), _PIECES,
).map("".join)  # fmt: skip
_LINES = st.one_of(_NEAR, _NEAR, _URLS, _PIECES)
# One line per pattern, each of which the fast path must not skip.
_MATCHES = [
    f"password={CRED}&user=bob",
    f"API-KEY = {CRED}",
    f"(b'x-api-key', b'{CRED}')",
    f"Incorrect API key provided: Bearer {CRED}",
    f"bad credentials Basic {BASIC}.",
    "key sk-proj-abcdefghijklmnop1234 refused",
    f"wss://alice:{CRED}@edge/v1/link",
    "api_\u212aey=value-here",  # Kelvin sign: (?i) matches it for k
    "\u017fecret=value-here",  # long s: (?i) matches it for s
]


@settings(max_examples=500, deadline=None)
@given(_LINES)
def test_fast_path_redacts_exactly_what_the_patterns_do(text: str) -> None:
    assert redact(text) == _log._redact_all(text)


@pytest.mark.parametrize("text", _MATCHES)
def test_fast_path_never_skips_a_line_a_pattern_matches(text: str) -> None:
    assert may_hold_secret(text)
    assert redact(text) == _log._redact_all(text) != text


@settings(max_examples=500, deadline=None)
@given(_LINES)
def test_a_line_the_fast_path_skips_matches_no_pattern(text: str) -> None:
    if may_hold_secret(text):
        return
    patterns = (
        _log._SECRET_KEY,
        _log._URL_PASSWORD,
        _log._BEARER,
        _log._BASIC,
        _log._OPENAI_KEY,
    )  # _SCHEME is only tried where a _SECRET_KEY match ends
    for pattern in patterns:
        assert pattern.search(text) is None, (pattern.pattern, text)


def test_the_hot_path_lines_take_the_fast_path() -> None:
    # What a request logs at INFO (iop/runtime/_run.py, iop/adapters/_http.py).
    for line in (
        "12:00:00 INFO  iop.runtime.run: run r-8f3a complete finish=stop out_tokens=64 "
        "ttft_s=0.002 dur_s=0.010",
        "12:00:00 INFO  iop.adapters.http: vllm executing completion run_id=r-8f3a target=m",
        "12:00:00 INFO  iop.adapters.vllm: vllm executing run_id=r-8f3a target=m "
        "endpoint=http://127.0.0.1:8000",
    ):
        assert not may_hold_secret(line)
    assert may_hold_secret(f"token={CRED}")


# --- the log formatter ---------------------------------------------------------------


@pytest.fixture
def stderr_log(monkeypatch: pytest.MonkeyPatch) -> Iterator[io.StringIO]:
    buf = io.StringIO()
    monkeypatch.setattr("sys.stderr", buf)
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    configure_logging("debug")
    try:
        yield buf
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)


def test_formatter_masks_registered_secrets_in_message_args_and_traceback(
    stderr_log: io.StringIO,
) -> None:
    secret = "formatter-marker-9f3a7c"
    _secrets.register_secrets([(secret, "test")])
    log = logging.getLogger("iop.test")
    log.debug("message %s", secret)
    log.info("args %r", {"h": f"x {secret} y"})
    log.warning(f"literal {secret}")
    try:
        raise ValueError(f"Incorrect API key provided: {secret}")
    except ValueError:
        log.exception("with traceback")
    log.error("b64 %s", base64.b64encode(secret.encode()).decode())
    out = stderr_log.getvalue()
    assert out.count("***") == 5, out
    assert secret not in out
    assert base64.b64encode(secret.encode()).decode() not in out
    assert "Traceback" in out  # the rest stays readable
    assert "ValueError: Incorrect API key provided: ***" in out


def test_formatter_redacts_keys_in_tracebacks_and_stack_info(stderr_log: io.StringIO) -> None:
    log = logging.getLogger("iop.test")
    try:
        raise RuntimeError(f"headers {{'Authorization': 'Basic {BASIC}'}}")
    except RuntimeError:
        log.error("failed", exc_info=True, stack_info=True)
    out = stderr_log.getvalue()
    assert BASIC not in out
    assert "'Authorization': 'Basic ***'" in out


def test_formatter_is_the_one_configure_logging_installs() -> None:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        configure_logging("info")
        assert isinstance(root.handlers[0].formatter, _log._RedactingFormatter)
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
