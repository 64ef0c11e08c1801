"""The ledger's table (SQLAlchemy 2 declarative). Created by the alembic
revision `0002_usage_records`, never by `metadata.create_all`."""

from __future__ import annotations

from sqlalchemy import BigInteger, Index, Integer, MetaData, String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from billing.records import MAX_RECORD_ID


class BillingBase(DeclarativeBase):
    metadata = MetaData(naming_convention={"pk": "pk_%(table_name)s", "ix": "ix_%(column_0_label)s"})


class UsageRecordRow(BillingBase):
    """Append-only: rows are inserted (ON CONFLICT DO NOTHING), never updated."""

    __tablename__ = "usage_records"
    __table_args__ = (Index("ix_usage_records_tenant_ended", "tenant", "ended_at_us"),
                      Index("ix_usage_records_ended", "ended_at_us"))

    request_id: Mapped[str] = mapped_column(String(MAX_RECORD_ID), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16))
    tenant_id: Mapped[str] = mapped_column(String(32))
    tenant: Mapped[str] = mapped_column(String(64))
    key_id: Mapped[str | None] = mapped_column(String(64))
    tier: Mapped[str] = mapped_column(String(16))
    adapter: Mapped[str | None] = mapped_column(String(128))
    adapter_version: Mapped[int | None] = mapped_column(Integer)
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    cached_prompt_tokens: Mapped[int] = mapped_column(Integer)
    completion_tokens: Mapped[int] = mapped_column(Integer)
    gpu_us: Mapped[int] = mapped_column(BigInteger)
    recompute_us: Mapped[int] = mapped_column(BigInteger)
    adapter_load_us: Mapped[int] = mapped_column(BigInteger)
    queue_us: Mapped[int | None] = mapped_column(BigInteger)
    ttft_us: Mapped[int | None] = mapped_column(BigInteger)
    e2e_us: Mapped[int | None] = mapped_column(BigInteger)
    finish_reason: Mapped[str | None] = mapped_column(String(32))
    started_at_us: Mapped[int | None] = mapped_column(BigInteger)
    ended_at_us: Mapped[int] = mapped_column(BigInteger)
    caused_by: Mapped[str | None] = mapped_column(String(200))
