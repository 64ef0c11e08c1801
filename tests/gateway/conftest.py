"""Gateway fixtures: migrated databases on both stores, a tiny adapter."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from gateway.store import schema

POSTGRES_ENV = "LORAGW_TEST_POSTGRES_URL"


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
    """A freshly migrated database: a SQLite file, or the PostgreSQL database
    named by $LORAGW_TEST_POSTGRES_URL emptied first (so reruns pass)."""
    if request.param == "sqlite":
        url = f"sqlite+aiosqlite:///{tmp_path / 'loragw.db'}"
    else:
        url = os.environ.get(POSTGRES_ENV)
        if not url:
            pytest.skip(f"{POSTGRES_ENV} is not set")
        asyncio.run(_reset_postgres(url))
    schema.upgrade(url)
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
