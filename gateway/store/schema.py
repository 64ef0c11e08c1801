"""The database schema as loragw runs it: every table the alembic history
creates, and bringing the database at a URL up to the history's head.

`migrations` holds the history and upgrades an engine it is handed; the
engine comes from here, with the store's connection policy
(`gateway.store.sql.create_engine`: SQLite files created owner-only, foreign
keys on, bounded timeouts). So the history never imports the gateway.
"""

from __future__ import annotations

import asyncio

from sqlalchemy import MetaData

import migrations
from billing.models import BillingBase
from gateway.store.models import Base
from gateway.store.sql import create_engine


def target_metadata() -> MetaData:
    """Every table the history creates: the store's and the billing ledger's."""
    combined = MetaData()
    for metadata in (Base.metadata, BillingBase.metadata):
        for table in metadata.tables.values():
            table.to_metadata(combined)
    return combined


async def upgrade_async(db_url: str, revision: str = "head") -> None:
    """Upgrade the database at `db_url`; usable inside a running loop."""
    engine = create_engine(db_url)
    try:
        await migrations.upgrade_engine(engine, revision)
    finally:
        await engine.dispose()


def upgrade(db_url: str, revision: str = "head") -> None:
    """`alembic upgrade head` on `db_url`, from synchronous code."""
    asyncio.run(upgrade_async(db_url, revision))
