"""`loragw usage export`: the ledger's records, or per-tenant totals per
hour or day, with prices per tier applied, as CSV or JSONL."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

PRICE_ENV = "LORAGW_PRICE"
PRICE_HELP = ("price of a tier: TIER:PER_GPU_SECOND,PER_1K_PROMPT,PER_1K_COMPLETION, e.g. "
              f"premium:0.004,0.0002,0.0006; repeat per tier [env {PRICE_ENV}, space-separated]")


def add_price_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--price", action="append", default=None, metavar="SPEC", help=PRICE_HELP)


def price_book(args: argparse.Namespace):
    """The `--price` flags, else $LORAGW_PRICE."""
    from billing.pricing import PriceBook
    from gateway.tenancy import Tier

    specs = args.price if args.price else os.environ.get(PRICE_ENV, "").split()
    return PriceBook.parse(specs, known_tiers=tuple(t.value for t in Tier))


def add_parsers(sub) -> None:
    usage = sub.add_parser("usage", help="usage records and totals from the billing ledger")
    actions = usage.add_subparsers(dest="action", required=True)
    export = actions.add_parser("export", help="write usage as CSV or JSONL")
    export.add_argument("--since", required=True, help="ISO date or datetime (UTC unless it says otherwise)")
    export.add_argument("--until", required=True, help="ISO date or datetime, exclusive")
    export.add_argument("--tenant", help="only this tenant")
    export.add_argument("--format", choices=["csv", "jsonl"], default="csv")
    export.add_argument("--group-by", choices=["none", "hour", "day"], default="none",
                        help="per-record rows (none), or per-tenant totals per hour or day")
    export.add_argument("--db", default=os.environ.get("LORAGW_DB"), help="SQLAlchemy URL [env LORAGW_DB]")
    export.add_argument("--output", "-o", help="file to write; default: stdout")
    add_price_flag(export)


def run(args: argparse.Namespace) -> int:
    from billing.export import parse_time

    try:
        since, until = parse_time(args.since), parse_time(args.until)
        prices = price_book(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_export(args, since, until, prices))
    except OSError as exc:  # the output file cannot be written: one line, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


async def _export(args: argparse.Namespace, since: int, until: int, prices) -> None:
    from billing.export import usage_rows, write
    from billing.ledger import Ledger
    from gateway.config import GatewayConfig
    from gateway.store import schema
    from gateway.store.sql import create_engine

    db_url = args.db or GatewayConfig().resolved_db_url()
    await schema.upgrade_async(db_url)
    engine = create_engine(db_url)
    try:
        rows = await usage_rows(Ledger(engine), prices, group_by=args.group_by, since_us=since, until_us=until,
                                tenant=args.tenant)
    finally:
        await engine.dispose()
    if args.output:
        with open(args.output, "w", newline="") as out:
            write(rows, args.format, out, group_by=args.group_by)
    else:
        write(rows, args.format, sys.stdout, group_by=args.group_by)
