"""usage records: the billing ledger

Revision ID: 0002_usage_records
Revises: 0001_tenants_keys_adapter_grants
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002_usage_records"
down_revision = "0001_tenants_keys_adapter_grants"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "usage_records",
        sa.Column("request_id", sa.String(200), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("tenant", sa.String(64), nullable=False),
        sa.Column("key_id", sa.String(64), nullable=True),
        sa.Column("tier", sa.String(16), nullable=False),
        sa.Column("adapter", sa.String(128), nullable=True),
        sa.Column("adapter_version", sa.Integer(), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("cached_prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("gpu_us", sa.BigInteger(), nullable=False),
        sa.Column("recompute_us", sa.BigInteger(), nullable=False),
        sa.Column("adapter_load_us", sa.BigInteger(), nullable=False),
        sa.Column("queue_us", sa.BigInteger(), nullable=True),
        sa.Column("ttft_us", sa.BigInteger(), nullable=True),
        sa.Column("e2e_us", sa.BigInteger(), nullable=True),
        sa.Column("finish_reason", sa.String(32), nullable=True),
        sa.Column("started_at_us", sa.BigInteger(), nullable=True),
        sa.Column("ended_at_us", sa.BigInteger(), nullable=False),
        sa.Column("caused_by", sa.String(200), nullable=True),
        sa.PrimaryKeyConstraint("request_id", name="pk_usage_records"),
    )
    op.create_index("ix_usage_records_tenant_ended", "usage_records", ["tenant", "ended_at_us"])
    op.create_index("ix_usage_records_ended", "usage_records", ["ended_at_us"])


def downgrade() -> None:
    op.drop_index("ix_usage_records_ended", table_name="usage_records")
    op.drop_index("ix_usage_records_tenant_ended", table_name="usage_records")
    op.drop_table("usage_records")
