"""The one alembic schema history, for SQLite and PostgreSQL alike.

`upgrade(db_url)` brings a database to the newest revision; `loragw migrate`
and `loragw serve` call it. The alembic Config is built here in code, so
nothing depends on an alembic.ini or on the working directory.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy import MetaData
from sqlalchemy.ext.asyncio import AsyncEngine

HERE = Path(__file__).resolve().parent


def target_metadata() -> MetaData:
    """Every table the history creates: the gateway's and the billing ledger's."""
    from billing.models import BillingBase
    from gateway.store.models import Base

    combined = MetaData()
    for metadata in (Base.metadata, BillingBase.metadata):
        for table in metadata.tables.values():
            table.to_metadata(combined)
    return combined


def alembic_config(db_url: str | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(HERE))
    if db_url is not None:
        # ConfigParser would read '%' as interpolation (passwords may hold it).
        cfg.set_main_option("sqlalchemy.url", db_url.replace("%", "%%"))
    return cfg


def head_revision() -> str:
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


async def upgrade_engine(engine: AsyncEngine, revision: str = "head") -> None:
    """Upgrade the database behind `engine`; usable inside a running loop."""

    def run(connection) -> None:
        cfg = alembic_config()
        cfg.attributes["connection"] = connection
        command.upgrade(cfg, revision)

    async with engine.begin() as connection:
        await connection.run_sync(run)


async def upgrade_async(db_url: str, revision: str = "head") -> None:
    from gateway.store.sql import create_engine

    engine = create_engine(db_url)
    try:
        await upgrade_engine(engine, revision)
    finally:
        await engine.dispose()


def upgrade(db_url: str, revision: str = "head") -> None:
    """`alembic upgrade head` on `db_url`, from synchronous code."""
    asyncio.run(upgrade_async(db_url, revision))


async def current_revision(engine: AsyncEngine) -> str | None:
    from alembic.migration import MigrationContext

    async with engine.connect() as connection:
        return await connection.run_sync(lambda c: MigrationContext.configure(c).get_current_revision())
