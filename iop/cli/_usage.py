"""``iop usage``: the usage ledger's sums by tenant, model and day.

Reads the ledger's SQLite file (``[usage] ledger_path`` of the edge's
config, or ``--ledger``) without writing to it, so it runs beside a live
edge (WAL mode: readers never wait for the writer), and prints the sums of
the runs grouped ``--by`` (default ``day,tenant,model``) as an aligned
table, CSV or JSON (the JSON is ``/admin/usage``'s answer;
docs/operations.md, "Usage and budgets").
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
from typing import Any

from iop.config import EdgeConfig, load_config
from iop.errors import ConfigError
from iop.ledger import GROUPS, LedgerStore, parse_day, report_json, rows_csv, rows_table

__all__ = ["add_parser"]


def _run(args: argparse.Namespace) -> int:
    path = args.ledger
    if not path:
        if not args.config:
            print("iop usage: give --config (the edge's) or --ledger", file=sys.stderr)
            return 2
        path = load_config(args.config, EdgeConfig).usage.ledger_path
        if not path:
            raise ConfigError(f"{args.config}: [usage] ledger_path is not set: no ledger")
    by = tuple(g for g in args.by.split(",") if g)
    bad = set(by) - set(GROUPS)
    if bad:
        print(f"iop usage: --by takes {', '.join(GROUPS)}; not {', '.join(bad)}", file=sys.stderr)
        return 2
    try:
        since = parse_day(args.since) if args.since else None
        until = parse_day(args.until) if args.until else None
    except ValueError as exc:
        print(f"iop usage: {exc}", file=sys.stderr)
        return 2
    try:
        store = LedgerStore(path, readonly=True)
        try:
            rows = store.report(by, since=since, until=until, tenant=args.tenant)
        finally:
            store.close()
    except sqlite3.Error as exc:
        print(f"iop usage: cannot read the ledger {path}: {exc}", file=sys.stderr)
        return 1
    if args.format == "json":
        sys.stdout.write(json.dumps(report_json(rows, by), indent=2) + "\n")
    elif args.format == "csv":
        sys.stdout.write(rows_csv(rows, by))
    else:
        sys.stdout.write(rows_table(rows, by))
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "usage",
        help="report the usage ledger: tokens and cost by tenant, model and day",
        description=(
            "Sum the runs of the edge's usage ledger ([usage] ledger_path) by day, tenant, "
            "model or key name. Days are UTC; costs are in the currency of [prices]."
        ),
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("--config", metavar="PATH", help="the edge's config (its ledger_path)")
    where.add_argument("--ledger", metavar="PATH", help="the ledger's SQLite file")
    p.add_argument(
        "--by",
        default="day,tenant,model",
        help=f"comma-separated groups of {', '.join(GROUPS)} (default: day,tenant,model)",
    )
    p.add_argument("--since", metavar="YYYY-MM-DD", help="runs that ended on this UTC day or later")
    p.add_argument("--until", metavar="YYYY-MM-DD", help="runs that ended before this UTC day")
    p.add_argument("--tenant", help="only this tenant's runs")
    p.add_argument("--format", choices=["table", "csv", "json"], default="table")
    p.set_defaults(func=_run)
