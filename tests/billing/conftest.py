"""Billing tests reuse the gateway's fixtures: migrated databases on SQLite
and PostgreSQL, a tiny adapter."""

from tests.gateway.conftest import anyio_backend, db_url, postgres_url, tiny_adapter_dir  # noqa: F401
