"""Tenant, key and adapter-ownership storage.

`Store` is the contract; `SqlStore` implements it over SQLAlchemy (SQLite
through aiosqlite by default, PostgreSQL through asyncpg)."""

from gateway.store.base import Conflict, NotFound, Store
from gateway.store.sql import SqlStore

__all__ = ["Conflict", "NotFound", "SqlStore", "Store"]
