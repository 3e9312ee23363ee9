"""``iop keys``: a key made by the CLI admits its tenant on a real edge process."""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import httpx
import openai
import pytest

from iop.config import EdgeConfig, decode_config
from iop.testing import Proc, toml_dumps
from iop.testing._processes import EDGE_READY, UP_READY


def iop(*args: str, stdin: str | bytes | None = "") -> subprocess.CompletedProcess[str]:
    """The real command line in a process of its own (``stdin=None``: stdin closed)."""
    if isinstance(stdin, bytes):
        done = subprocess.run(
            [sys.executable, "-m", "iop", *args],
            input=stdin,
            capture_output=True,
            timeout=60,
            check=False,
        )
        return subprocess.CompletedProcess(
            done.args, done.returncode, done.stdout.decode(), done.stderr.decode()
        )
    return subprocess.run(
        [sys.executable, "-m", "iop", *args],
        input=stdin,
        stdin=subprocess.DEVNULL if stdin is None else None,
        # stdin=None: no fd 0 at all (`iop keys hash <&-`), Python's sys.stdin is None.
        preexec_fn=(lambda: os.close(0)) if stdin is None else None,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    """The single stderr line of a command refused with exit 2 (no traceback)."""
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("iop keys")
    return line


def test_create_prints_the_key_once_and_a_table_holding_only_its_digest() -> None:
    made = iop("keys", "create", "team-a", "--rpm", "60", "--tpm", "1000", "--model", "m")
    assert made.returncode == 0, made.stderr
    key = made.stderr.strip().splitlines()[-1]
    assert key.startswith("iop-")
    assert len(key) == 4 + 43
    assert key not in made.stdout
    table = tomllib.loads(made.stdout)
    cfg = decode_config(table, EdgeConfig, source="stdout")
    (tenant,) = cfg.tenants
    assert tenant.name == "team-a"
    assert tenant.key_sha256 == [hashlib.sha256(key.encode()).hexdigest()]
    assert (tenant.requests_per_minute, tenant.tokens_per_minute, tenant.models) == (
        60,
        1000,
        ["m"],
    )
    again = iop("keys", "create", "team-a")
    assert again.stderr.strip().splitlines()[-1] != key


def test_create_writes_the_key_to_a_private_file_and_never_overwrites(tmp_path: Path) -> None:
    path = tmp_path / "team-a.key"
    made = iop("keys", "create", "team-a", "--key-file", str(path))
    assert made.returncode == 0, made.stderr
    key = path.read_text().strip()
    assert key not in made.stderr
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert hashlib.sha256(key.encode()).hexdigest() in made.stdout
    again = iop("keys", "create", "team-a", "--key-file", str(path))
    line = one_line_error(again)
    assert str(path) in line
    assert "exists" in line
    assert again.stdout == ""  # no table for a key that went nowhere
    assert path.read_text().strip() == key


def test_a_key_file_that_cannot_be_made_is_one_line_and_no_table(tmp_path: Path) -> None:
    for path in (tmp_path / "no-such-dir" / "a.key", tmp_path):
        done = iop("keys", "create", "team-a", "--key-file", str(path))
        assert str(path) in one_line_error(done)
        assert done.stdout == ""
    assert not (tmp_path / "no-such-dir").exists()


def test_a_bad_name_is_a_config_error_that_says_why() -> None:
    made = iop("keys", "create", "team a")
    assert made.returncode == 2
    assert "metrics label" in made.stderr


def test_hash_prints_the_digest_line_of_a_key_on_stdin() -> None:
    out = iop("keys", "hash", stdin="sk-abc\n")
    assert out.returncode == 0
    assert out.stdout.strip() == f'key_sha256 = ["{hashlib.sha256(b"sk-abc").hexdigest()}"]'
    assert "no key on stdin" in one_line_error(iop("keys", "hash", stdin=""))


@pytest.mark.parametrize(
    ("stdin", "says"),
    [
        (None, "no key on stdin"),
        ("\n", "no key on stdin"),
        ("   \n", "no key on stdin"),
        (b"\xff\xfekey\n", "printable ASCII"),
        (" sk-abc\n", "printable ASCII"),
        ("sk-\u00e9\n", "printable ASCII"),
    ],
    ids=["closed", "empty-line", "blank", "not-utf8", "leading-space", "not-ascii"],
)
def test_hash_refuses_what_no_client_could_send_as_a_key(
    stdin: str | bytes | None, says: str
) -> None:
    """A key travels in an HTTP header: a digest of anything else would
    admit nobody, silently."""
    done = iop("keys", "hash", stdin=stdin)
    assert says in one_line_error(done)
    assert done.stdout == ""


@pytest.mark.timeout(60)
def test_a_created_key_opens_a_real_edge_and_its_limit_holds(tmp_path: Path) -> None:
    made = iop("keys", "create", "team-a", "--rpm", "1")
    key = made.stderr.strip().splitlines()[-1]
    config = tomllib.loads(made.stdout) | {"server": {"port": 0}}
    path = tmp_path / "edge.toml"
    path.write_text(toml_dumps(config))
    edge = Proc("edge", ["edge", "--config", str(path), "--node-token", "t" * 16], tmp_path)
    try:
        url = edge.wait_stdout(EDGE_READY, 30)[1]
        with openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0) as client:
            # No node: the first request is admitted (and fails 503), the second is over the limit.
            with pytest.raises(openai.InternalServerError):
                client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}]
                )
            with pytest.raises(openai.RateLimitError) as err:
                client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}]
                )
            assert err.value.response.headers["x-ratelimit-limit-requests"] == "1"
        with (
            openai.OpenAI(base_url=url + "/v1", api_key="iop-wrong", max_retries=0) as wrong,
            pytest.raises(openai.AuthenticationError),
        ):
            wrong.models.list()
    finally:
        edge.stop()


def test_create_says_where_its_table_goes_and_prints_iop_ups_with_up(tmp_path: Path) -> None:
    plain = iop("keys", "create", "team-a")
    assert "[[edge.tenants]]" in plain.stdout  # the comment that says where, for iop up
    made = iop("keys", "create", "team-a", "--up")
    assert made.returncode == 0, made.stderr
    key = made.stderr.strip().splitlines()[-1]
    admin = "adm-0123456789abcdef"
    (tmp_path / "up.toml").write_text(f'[edge.server]\nadmin_keys = ["{admin}"]\n' + made.stdout)
    args = ["up", "--backend", "sim", "--port", "0", "--config", "up.toml"]
    proc = Proc("iop-up", args, tmp_path)
    try:
        url = proc.wait_stdout(UP_READY).group(1)
        with openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30) as c:
            assert [m.id for m in c.models.list().data] == ["iop-sim"]
        # No key at all: the refusal says so, not that a key was wrong.
        refused = httpx.get(f"{url}/v1/models", timeout=30)
        assert refused.status_code == 401
        assert refused.json()["error"]["message"].startswith("No API key provided"), refused.text
        wrong = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer x"}, timeout=30)
        assert wrong.json()["error"]["message"] == "Incorrect API key provided."
        # The admin views say which key they want, and that a client key is not one.
        for headers, says in (
            ({}, "No admin key"),
            ({"Authorization": f"Bearer {key}"}, "Not an admin key"),
        ):
            refused = httpx.get(f"{url}/admin/nodes", headers=headers, timeout=30)
            assert refused.status_code == 401
            message = refused.json()["error"]["message"]
            assert message.startswith(says), message
            assert "server.admin_keys" in message
            assert "a client key never opens" in message
        allowed = httpx.get(
            f"{url}/admin/nodes", headers={"Authorization": f"Bearer {admin}"}, timeout=30
        )
        assert allowed.status_code == 200
    finally:
        proc.stop()


def test_node_prints_a_token_once_and_the_link_nodes_table_of_its_digest(tmp_path: Path) -> None:
    made = iop("keys", "node", "gpu-a", "--node-id", "gpu-a", "--node-id", "gpu-a2")
    assert made.returncode == 0, made.stderr
    token = made.stderr.strip().splitlines()[-1]
    assert token not in made.stdout
    cfg = decode_config(tomllib.loads(made.stdout), EdgeConfig, source="stdout")
    (cred,) = cfg.link.nodes
    assert cred.name == "gpu-a"
    assert cred.token_sha256 == hashlib.sha256(token.encode()).hexdigest()
    assert cred.node_ids == ["gpu-a", "gpu-a2"]
    path = tmp_path / "gpu-a.token"
    to_file = iop("keys", "node", "gpu-a", "--token-file", str(path))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert hashlib.sha256(path.read_text().strip().encode()).hexdigest() in to_file.stdout
    assert "node_ids" not in to_file.stdout  # no binding: any id
    again = iop("keys", "node", "gpu-a", "--token-file", str(path))
    assert "exists" in one_line_error(again)
    assert again.stdout == ""
    bad = iop("keys", "node", "bad name")
    assert bad.returncode == 2
    assert "must be 1-64 letters" in bad.stderr
