"""Alembic environment: async-aware, one history for SQLite and PostgreSQL.

`migrations.upgrade_engine` hands in an open connection through
`config.attributes["connection"]`; otherwise (the `alembic` command) an
async engine is made from `sqlalchemy.url`."""

from __future__ import annotations

import asyncio

from alembic import context

from migrations import target_metadata as _target_metadata

config = context.config
target_metadata = _target_metadata()


def run_migrations(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        # SQLite cannot ALTER most things; batch mode rebuilds tables instead.
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


async def run_async() -> None:
    from gateway.store.sql import create_engine

    engine = create_engine(config.get_main_option("sqlalchemy.url"))
    try:
        async with engine.begin() as connection:
            await connection.run_sync(run_migrations)
    finally:
        await engine.dispose()


if context.is_offline_mode():
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=target_metadata,
                      literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
elif (connection := config.attributes.get("connection")) is not None:
    run_migrations(connection)
else:
    asyncio.run(run_async())
