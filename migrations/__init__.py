"""The one alembic schema history, for SQLite and PostgreSQL alike.

`upgrade_engine(engine)` brings the database behind an engine to the newest
revision. The caller makes the engine: `gateway.store.schema.upgrade(url)`,
which `loragw migrate` and `loragw serve` call, makes it with the store's
connection policy, so this package imports nothing of the gateway's. The
alembic Config is built here in code, so nothing depends on an alembic.ini or
on the working directory. Autogenerate compares against the metadata put in
`config.attributes["target_metadata"]` (`gateway.store.schema.target_metadata()`).
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy.ext.asyncio import AsyncEngine

HERE = Path(__file__).resolve().parent


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


async def current_revision(engine: AsyncEngine) -> str | None:
    from alembic.migration import MigrationContext

    async with engine.connect() as connection:
        return await connection.run_sync(lambda c: MigrationContext.configure(c).get_current_revision())
