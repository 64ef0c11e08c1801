"""Gateway fixtures: migrated databases on both stores, a tiny adapter."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from gateway.store import schema
from tests.stores import POSTGRES_ENV, REDIS_ENV, unavailable


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def _reset_postgres(url: str) -> None:
    """Empty the test database: every table of a previous run goes."""
    from sqlalchemy import text

    from gateway.store.sql import create_engine

    engine = create_engine(url)
    try:
        async with engine.begin() as conn:
            await conn.execute(text("DROP SCHEMA public CASCADE"))
            await conn.execute(text("CREATE SCHEMA public"))
    finally:
        await engine.dispose()


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request, tmp_path) -> str:
    """A freshly migrated database: a SQLite file, or the session's
    PostgreSQL database (tests/stores.py) emptied first (so reruns pass)."""
    if request.param == "postgres":
        return request.getfixturevalue("postgres_url")
    url = f"sqlite+aiosqlite:///{tmp_path / 'loragw.db'}"
    schema.upgrade(url)
    return url


@pytest.fixture
def postgres_url() -> str:
    """The session's PostgreSQL database, emptied and migrated."""
    url = os.environ.get(POSTGRES_ENV)
    if not url:
        pytest.skip(unavailable("PostgreSQL"))
    asyncio.run(_reset_postgres(url))
    schema.upgrade(url)
    return url


@pytest.fixture
def redis_url() -> str:
    """The session's Redis database (tests/stores.py). Not flushed: the
    tests key everything by fresh tenant ids, so runs sharing it never meet."""
    url = os.environ.get(REDIS_ENV)
    if not url:
        pytest.skip(unavailable("Redis"))
    pytest.importorskip("redis", reason="Redis: the redis package is not installed (pip install 'loragw[redis]')")
    return url


@pytest.fixture(scope="session")
def tiny_adapter_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    """A valid PEFT LoRA adapter (r=4) for the tiny Llama."""
    from tests.adapters.conftest import build_peft_adapter

    out = tmp_path_factory.mktemp("tiny-adapter")
    build_peft_adapter(tiny_llama_dir, out, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    return out


@pytest.fixture(scope="session")
def tiny_base_config(tiny_llama_dir):
    from engine.model.loader import load_hf_config

    return load_hf_config(tiny_llama_dir)
