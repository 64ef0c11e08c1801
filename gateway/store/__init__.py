"""Tenant, key and adapter-ownership storage.

`Store` is the contract; `SqlStore` implements it over SQLAlchemy (SQLite
through aiosqlite by default, PostgreSQL through asyncpg)."""

from gateway.store.base import Store

__all__ = ["Store"]
