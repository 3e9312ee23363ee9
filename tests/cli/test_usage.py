"""``iop usage``: the ledger's sums as a table, CSV and JSON, from a real process."""

from __future__ import annotations

import csv
import hashlib
import json
import tomllib
from datetime import UTC, datetime
from pathlib import Path

from iop.config import TenancySettings, TenantSettings, decode_config
from iop.edge.tenancy._tenants import Tenants
from iop.ledger import LedgerStore, UsageRecord
from iop.testing import toml_dumps
from tests.cli.test_keys import iop


def _at(day: str) -> float:
    return datetime.fromisoformat(f"{day}T12:00:00").replace(tzinfo=UTC).timestamp()


def _ledger(path: Path) -> None:
    store = LedgerStore(path)
    store.append(
        [
            UsageRecord(
                run_id=f"r{n}",
                at=_at(day),
                tenant=tenant,
                key_name="ci",
                model="m",
                operation="chat",
                outcome="complete",
                input_tokens=100,
                output_tokens=10,
                cost_micros=1_250_000,
            )
            for n, (day, tenant) in enumerate(
                [("2026-12-03", "a"), ("2026-12-03", "a"), ("2026-12-04", "b")]
            )
        ]
    )
    store.close()


def test_usage_as_table_csv_and_json(tmp_path: Path) -> None:
    db = tmp_path / "usage.db"
    _ledger(db)
    table = iop("usage", "--ledger", str(db))
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split() == [
        "day", "tenant", "model", "runs", "input_tokens", "output_tokens", "cached_tokens", "cost"
    ]  # fmt: skip
    assert lines[1].split() == ["2026-12-03", "a", "m", "2", "200", "20", "0", "2.500000"]
    assert lines[-1].split() == ["total", "3", "300", "30", "0", "3.750000"]

    # The edge's config names the file; CSV by tenant.
    config = tmp_path / "edge.toml"
    config.write_text(toml_dumps({"usage": {"ledger_path": str(db)}}))
    out = iop("usage", "--config", str(config), "--by", "tenant", "--format", "csv")
    assert out.returncode == 0, out.stderr
    assert list(csv.reader(out.stdout.splitlines())) == [
        ["tenant", "runs", "input_tokens", "output_tokens", "cached_tokens", "cost"],
        ["a", "2", "200", "20", "0", "2.500000"],
        ["b", "1", "100", "10", "0", "1.250000"],
    ]

    out = iop("usage", "--ledger", str(db), "--format", "json", "--since", "2026-12-04")
    body = json.loads(out.stdout)
    assert body["rows"] == [
        {
            "day": "2026-12-04",
            "tenant": "b",
            "model": "m",
            "runs": 1,
            "input_tokens": 100,
            "output_tokens": 10,
            "cached_tokens": 0,
            "cost_micros": 1_250_000,
            "cost": "1.250000",
        }
    ]
    assert body["total"]["cost_micros"] == 1_250_000


def test_usage_says_what_is_wrong(tmp_path: Path) -> None:
    missing = iop("usage", "--ledger", str(tmp_path / "none.db"))
    assert missing.returncode == 1
    assert "cannot read the ledger" in missing.stderr
    config = tmp_path / "edge.toml"
    config.write_text("")
    none = iop("usage", "--config", str(config))
    assert none.returncode == 2
    assert "ledger_path is not set" in none.stderr
    bad = iop("usage", "--ledger", str(tmp_path / "x.db"), "--by", "colour")
    assert bad.returncode == 2
    assert "--by takes" in bad.stderr
    assert iop("usage", "--ledger", "x", "--since", "yesterday").returncode == 2


def test_an_edge_whose_ledger_cannot_be_opened_does_not_start(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    config = tmp_path / "edge.toml"
    config.write_text(toml_dumps({"usage": {"ledger_path": str(blocker / "usage.db")}}))
    out = iop("edge", "--port", "0", "--node-token", "e2e-node-token-xyz", "--config", str(config))
    assert out.returncode == 2
    assert "config error: [usage] ledger_path" in out.stderr
    assert "cannot open the ledger" in out.stderr


def test_keys_create_names_the_key_for_the_ledger() -> None:
    out = iop("keys", "create", "team-a", "--key-name", "ci")
    assert out.returncode == 0, out.stderr
    key = out.stderr.strip().splitlines()[-1]
    table = tomllib.loads(out.stdout)["tenants"][0]
    assert table["keys"] == [{"sha256": hashlib.sha256(key.encode()).hexdigest(), "name": "ci"}]
    assert "key_sha256" not in table
    tenant = decode_config(table, TenantSettings, source="stdout")
    assert Tenants([tenant], [], TenancySettings()).key_name(key) == "ci"
