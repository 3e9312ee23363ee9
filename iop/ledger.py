"""The usage ledger's records, prices and SQLite store (no event loop here).

Every finished run of an edge is one ``UsageRecord``: when it ended, whose
it was (tenant, key name), what ran where (model, operation, node,
instance, attempts), what it used (the usage its tenant is charged:
``iop.edge.tenancy._charges.charged_usage``), how it ended and what it cost. The
edge's writer (``iop.edge.tenancy._ledger``) appends them in batches to a SQLite
file in WAL mode; ``iop usage`` and ``/admin/usage`` read it back
(``LedgerStore.report``), and a restarted edge restores its tenants'
budgets and rate windows from it (``LedgerStore.spent``,
``LedgerStore.since``).

Money is integer micro-units of the configured currency, never floats:
prices are per million tokens (``[prices]``), so a run's cost in
micro-units is its tokens times the price in micro-units, divided by a
million and rounded up (``cost_micros``). Budget periods are UTC days and
calendar months (``period_start``).

``LedgerStore`` is synchronous: the edge calls it from a worker thread
(``trio.to_thread.run_sync``), ``iop usage`` directly. SQLite connections
are used by one thread at a time (each ``LedgerStore`` is).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Final, Literal

import msgspec

from iop.config import Price
from iop.errors import ConfigError
from iop.events import Usage

__all__ = [
    "GROUPS",
    "LedgerStore",
    "Prices",
    "UsageRecord",
    "UsageRow",
    "check_ledger_path",
    "cost_micros",
    "money",
    "parse_day",
    "period_end",
    "period_key",
    "period_start",
    "report_json",
    "rows_csv",
    "rows_table",
]

Period = Literal["day", "month"]

# One version of the schema; a newer file is refused, not misread.
SCHEMA_VERSION: Final = 1

_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS runs (
    seq INTEGER PRIMARY KEY,
    run_id TEXT NOT NULL,
    at REAL NOT NULL,
    day TEXT NOT NULL,
    tenant TEXT NOT NULL,
    key_name TEXT NOT NULL,
    model TEXT NOT NULL,
    operation TEXT NOT NULL,
    node TEXT NOT NULL,
    instance TEXT NOT NULL,
    input_tokens INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL,
    cached_tokens INTEGER NOT NULL,
    outcome TEXT NOT NULL,
    reason TEXT NOT NULL,
    duration_ms INTEGER NOT NULL,
    attempts INTEGER NOT NULL,
    cost_micros INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS runs_tenant_at ON runs (tenant, at);
CREATE INDEX IF NOT EXISTS runs_at ON runs (at);
"""

_COLUMNS: Final = (
    "run_id",
    "at",
    "day",
    "tenant",
    "key_name",
    "model",
    "operation",
    "node",
    "instance",
    "input_tokens",
    "output_tokens",
    "cached_tokens",
    "outcome",
    "reason",
    "duration_ms",
    "attempts",
    "cost_micros",
)

GROUPS: Final = ("day", "tenant", "model", "key_name")
"""What a report may group by."""


class UsageRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One finished run, as the ledger keeps it.

    Attributes:
        run_id: The run's id (its timeline's).
        at: When it ended (Unix seconds).
        tenant: Its tenant (``iop.edge.tenancy._tenants``).
        key_name: The name of the key it came with (``[[tenants]] keys``);
            ``sha256:`` and 12 digits of an unnamed key's digest; empty for
            the open edge and ``server.api_keys``.
        model, operation: What the client asked for.
        node, instance: Where its last attempt ran (empty: nowhere).
        input_tokens, output_tokens, cached_tokens: The usage it is charged.
        outcome: ``complete``, ``cancelled`` or ``error``.
        reason: The cancel reason or error code (empty when complete).
        duration_ms: From its arrival at the edge to its end.
        attempts: Nodes it was placed on (a failover is one more).
        cost_micros: What it cost, in micro-units of the currency.
    """

    run_id: str
    at: float
    tenant: str
    key_name: str = ""
    model: str
    operation: str
    node: str = ""
    instance: str = ""
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    outcome: str
    reason: str = ""
    duration_ms: int = 0
    attempts: int = 0
    cost_micros: int = 0

    @property
    def tokens(self) -> int:
        return self.input_tokens + self.output_tokens


class UsageRow(msgspec.Struct, frozen=True, kw_only=True):
    """One line of a report: the sums of a group's runs."""

    day: str = ""
    tenant: str = ""
    model: str = ""
    key_name: str = ""
    runs: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    cost_micros: int = 0


def cost_micros(usage: Usage, price: tuple[int, int, int] | None) -> int:
    """What ``usage`` costs at ``price`` (``Price.micros``), rounded up to a
    micro-unit; 0 for an unpriced model."""
    if price is None:
        return 0
    p_in, p_cached, p_out = price
    cached = min(usage.cached_input_tokens, usage.input_tokens)
    total = (usage.input_tokens - cached) * p_in + cached * p_cached + usage.output_tokens * p_out
    return -(-total // 1_000_000)


class Prices:
    """``[prices]``: a model's price by its name, else ``"*"``'s, else none."""

    def __init__(self, prices: Mapping[str, Price]) -> None:
        self._micros = {model: p.micros for model, p in prices.items()}

    def __bool__(self) -> bool:
        return bool(self._micros)

    def of(self, model: str) -> tuple[int, int, int] | None:
        return self._micros.get(model, self._micros.get("*"))

    def cost(self, model: str, usage: Usage) -> int:
        return cost_micros(usage, self.of(model))


def _utc(at: float) -> datetime:
    return datetime.fromtimestamp(at, UTC)


def period_start(period: Period, at: float) -> float:
    """The Unix time the UTC ``period`` holding ``at`` began."""
    t = _utc(at)
    start = t.replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "month":
        start = start.replace(day=1)
    return start.timestamp()


def period_end(period: Period, at: float) -> float:
    """The Unix time the UTC ``period`` holding ``at`` ends."""
    start = _utc(period_start(period, at))
    if period == "day":
        return start.timestamp() + 86400.0
    month = start.month % 12 + 1
    year = start.year + (start.month == 12)
    return start.replace(year=year, month=month).timestamp()


def period_key(period: Period, at: float) -> str:
    """The period holding ``at``, as ``2026-12-04`` (day) or ``2026-12`` (month)."""
    return _utc(at).strftime("%Y-%m-%d" if period == "day" else "%Y-%m")


class LedgerStore:
    """The ledger's SQLite file: append batches, sum, report.

    Args:
        path: The file (made with its directory when missing).
        readonly: Open for reading only (``iop usage``): a missing file is
            an error, nothing is written.

    Raises:
        sqlite3.Error: The file cannot be opened or is not a ledger.
    """

    def __init__(self, path: str | Path, *, readonly: bool = False) -> None:
        self.path = Path(path)
        if readonly:
            self._db = sqlite3.connect(
                f"{self.path.resolve().as_uri()}?mode=ro", uri=True, check_same_thread=False
            )
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # check_same_thread=False: the edge's worker threads take turns
            # (trio.to_thread.run_sync, one call at a time per store).
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            # WAL: readers (``iop usage`` while the edge writes) never wait
            # for the writer; synchronous=NORMAL keeps every committed batch
            # across a process kill (only a power loss may take the last).
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise sqlite3.DatabaseError(
                    f"{self.path}: ledger schema {version} is newer than this iop's "
                    f"({SCHEMA_VERSION})"
                )
            self._db.executescript(_SCHEMA)
            self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    def close(self) -> None:
        """Close the file (idempotent)."""
        self._db.close()

    def append(self, records: Sequence[UsageRecord]) -> None:
        """Write ``records`` in one transaction."""
        rows = [
            (
                r.run_id,
                r.at,
                period_key("day", r.at),
                r.tenant,
                r.key_name,
                r.model,
                r.operation,
                r.node,
                r.instance,
                r.input_tokens,
                r.output_tokens,
                r.cached_tokens,
                r.outcome,
                r.reason,
                r.duration_ms,
                r.attempts,
                r.cost_micros,
            )
            for r in records
        ]
        placeholders = ", ".join("?" * len(_COLUMNS))
        with self._db:
            self._db.execute("BEGIN")
            self._db.executemany(
                f"INSERT INTO runs ({', '.join(_COLUMNS)}) VALUES ({placeholders})", rows
            )

    def spent(self, since: float) -> dict[str, int]:
        """Every tenant's cost of the runs that ended at ``since`` or later."""
        cur = self._db.execute(
            "SELECT tenant, SUM(cost_micros) FROM runs WHERE at >= ? GROUP BY tenant", (since,)
        )
        return {tenant: int(total) for tenant, total in cur}

    def since(self, since: float) -> list[UsageRecord]:
        """The runs that ended at ``since`` or later, oldest first."""
        cur = self._db.execute(
            f"SELECT {', '.join(_COLUMNS)} FROM runs WHERE at >= ? ORDER BY at", (since,)
        )
        return [_record(row) for row in cur]

    def report(
        self,
        by: Iterable[str] = ("day", "tenant", "model"),
        *,
        since: float | None = None,
        until: float | None = None,
        tenant: str | None = None,
    ) -> list[UsageRow]:
        """The runs' sums, grouped ``by`` (of ``GROUPS``), oldest day first.

        Args:
            since: Runs that ended at this Unix time or later.
            until: Runs that ended before this Unix time.
            tenant: Only this tenant's runs.
        """
        groups = [g for g in GROUPS if g in set(by)]
        unknown = set(by) - set(GROUPS)
        if unknown:
            raise ValueError(f"cannot group by {', '.join(sorted(unknown))}")
        where: list[str] = []
        args: list[object] = []
        if since is not None:
            where.append("at >= ?")
            args.append(since)
        if until is not None:
            where.append("at < ?")
            args.append(until)
        if tenant is not None:
            where.append("tenant = ?")
            args.append(tenant)
        cols = ", ".join(groups)
        sql = (
            f"SELECT {cols + ', ' if cols else ''}COUNT(*), SUM(input_tokens), "
            "SUM(output_tokens), SUM(cached_tokens), SUM(cost_micros) FROM runs"
            + (f" WHERE {' AND '.join(where)}" if where else "")
            + (f" GROUP BY {cols} ORDER BY {cols}" if cols else "")
        )
        out: list[UsageRow] = []
        for row in self._db.execute(sql, args):
            named = dict(zip(groups, row[: len(groups)], strict=True))
            runs, tin, tout, tcached, cost = row[len(groups) :]
            if not runs:
                continue
            out.append(
                UsageRow(
                    **named,
                    runs=int(runs),
                    input_tokens=int(tin),
                    output_tokens=int(tout),
                    cached_tokens=int(tcached),
                    cost_micros=int(cost),
                )
            )
        return out


def check_ledger_path(path: str) -> None:
    """Open (and make) the ledger at ``path`` once, before the edge starts.

    Raises:
        ConfigError: It cannot be opened or is not a ledger, said with the key.
    """
    try:
        LedgerStore(path).close()
    except (OSError, sqlite3.Error) as exc:
        raise ConfigError(f"[usage] ledger_path {path!r}: cannot open the ledger: {exc}") from exc


def _record(row: Sequence[object]) -> UsageRecord:
    fields = dict(zip(_COLUMNS, row, strict=True))
    del fields["day"]
    return msgspec.convert(fields, UsageRecord)


_ROW_FIELDS: Final = (
    "runs",
    "input_tokens",
    "output_tokens",
    "cached_tokens",
    "cost",
)


def money(micros: int) -> str:
    """Micro-units as a decimal amount with 6 places (``1.250000``)."""
    sign = "-" if micros < 0 else ""
    whole, frac = divmod(abs(micros), 1_000_000)
    return f"{sign}{whole}.{frac:06d}"


def _cells(row: UsageRow, groups: Sequence[str]) -> list[str]:
    return [
        *(str(getattr(row, g)) for g in groups),
        str(row.runs),
        str(row.input_tokens),
        str(row.output_tokens),
        str(row.cached_tokens),
        money(row.cost_micros),
    ]


def rows_csv(rows: Sequence[UsageRow], groups: Sequence[str]) -> str:
    """``rows`` as CSV with a header line (RFC 4180: no field here needs quoting,
    names are letters, digits and ``_.@:-``)."""
    lines = [",".join([*groups, *_ROW_FIELDS])]
    lines += [",".join(_cells(r, groups)) for r in rows]
    return "\r\n".join(lines) + "\r\n"


def rows_table(rows: Sequence[UsageRow], groups: Sequence[str]) -> str:
    """``rows`` as an aligned text table with a total line."""
    header = [*groups, *_ROW_FIELDS]
    body = [_cells(r, groups) for r in rows]
    if rows:
        total = UsageRow(
            runs=sum(r.runs for r in rows),
            input_tokens=sum(r.input_tokens for r in rows),
            output_tokens=sum(r.output_tokens for r in rows),
            cached_tokens=sum(r.cached_tokens for r in rows),
            cost_micros=sum(r.cost_micros for r in rows),
        )
        cells = _cells(total, groups)
        if groups:
            cells[0] = "total"
        body.append(cells)
    widths = [max(len(c) for c in col) for col in zip(header, *body, strict=True)]
    numeric = len(groups)

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(w) if i >= numeric else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    return "\n".join(line(c) for c in [header, *body]) + "\n"


def parse_day(text: str) -> float:
    """``YYYY-MM-DD`` as the Unix time its UTC day begins.

    Raises:
        ValueError: Not such a date.
    """
    try:
        day = datetime.strptime(text, "%Y-%m-%d").replace(tzinfo=UTC)
    except ValueError:
        raise ValueError(f"{text!r} is not a date YYYY-MM-DD") from None
    return day.timestamp()


def report_json(rows: Sequence[UsageRow], groups: Sequence[str]) -> dict[str, object]:
    """A report as ``iop usage --format json`` and ``/admin/usage`` give it:
    the groups, each row with its cost in micro-units and as a decimal
    string, and the total."""

    def row(r: UsageRow) -> dict[str, object]:
        out: dict[str, object] = {g: getattr(r, g) for g in groups}
        out.update(
            runs=r.runs,
            input_tokens=r.input_tokens,
            output_tokens=r.output_tokens,
            cached_tokens=r.cached_tokens,
            cost_micros=r.cost_micros,
            cost=money(r.cost_micros),
        )
        return out

    total = UsageRow(
        runs=sum(r.runs for r in rows),
        input_tokens=sum(r.input_tokens for r in rows),
        output_tokens=sum(r.output_tokens for r in rows),
        cached_tokens=sum(r.cached_tokens for r in rows),
        cost_micros=sum(r.cost_micros for r in rows),
    )
    summed = row(total)
    for g in groups:
        del summed[g]
    return {"by": list(groups), "rows": [row(r) for r in rows], "total": summed}
