"""Alembic environment: one history for SQLite and PostgreSQL.

Online, the caller hands in an open connection through
`config.attributes["connection"]` (`migrations.upgrade_engine`, which
`loragw migrate` reaches through `gateway.store.schema.upgrade`): the engine
behind it is made with the store's connection policy, which this package
cannot import. Offline (`alembic upgrade --sql`) only writes SQL.
Autogenerate compares against `config.attributes["target_metadata"]`
(`gateway.store.schema.target_metadata()`); upgrades need no metadata."""

from __future__ import annotations

from alembic import context

config = context.config
target_metadata = config.attributes.get("target_metadata")


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


if context.is_offline_mode():
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=target_metadata,
                      literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
elif (connection := config.attributes.get("connection")) is not None:
    run_migrations(connection)
else:
    raise RuntimeError("run online migrations through `loragw migrate` (gateway.store.schema.upgrade), "
                       "which connects with the store's policy; `alembic --sql` works offline")
