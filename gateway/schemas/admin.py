"""Request and response bodies of the admin API (and of `loragw ... --json`).

Inputs forbid unknown fields, and their numbers are integers as sent
(`"5"`, `5.0` and `true` are 400s, as in /v1); `parse` turns a pydantic
error into a 400 whose `param` names the offending field. Outputs are what
both the admin API and the CLI print, so the two can never disagree.
"""

from __future__ import annotations

import datetime as dt
import re
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (AwareDatetime, BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator,
                      model_validator)

from gateway.errors import InvalidRequest
from gateway.schemas.text import stored_text
from gateway.tenancy import Tier

TENANT_NAME_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,63}$"
TENANT_NAME_RULE = "a-z 0-9 _ -, at most 64"
TenantName = Annotated[str, Field(pattern=TENANT_NAME_PATTERN, description=TENANT_NAME_RULE)]
ADAPTER_NAME_PATTERN = r"^(?!.*\.\.)[a-z0-9][a-z0-9._-]{0,63}$"  # adapters.registry.validate_name
# NAME or NAME@VERSION, as adapters.registry.parse_ref takes it (a version of at most nine digits)
ADAPTER_REF_PATTERN = ADAPTER_NAME_PATTERN.removesuffix("$") + r"(@[1-9][0-9]{0,8})?$"
# The limits are INTEGER columns (store.models.TenantRow): 32 bits on PostgreSQL.
MAX_LIMIT = 2**31 - 1
Limit = Annotated[Annotated[StrictInt, Field(gt=0, le=MAX_LIMIT)] | None,
                  Field(description="None (null) means unlimited")]
_ISO_DATE = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")
# A key's lifetime is bounded so that now + expires_in stays a datetime.
MAX_KEY_LIFETIME_S = 100 * 365 * 86_400

Model = TypeVar("Model", bound=BaseModel)


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")


def parse(model: type[Model], data: Any) -> Model:
    """Validate `data` as `model`, or raise InvalidRequest naming the field."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(part) for part in first["loc"]) or None
        msg = first["msg"].removeprefix("Value error, ")
        message = msg if param is None else f"{param}: {msg}"
        raise InvalidRequest(message, param=param) from None


# ---- inputs ----

class LimitsIn(_In):
    max_concurrent: Limit = None
    requests_per_minute: Limit = None
    tokens_per_minute: Limit = None


class TenantCreate(_In):
    name: TenantName
    tier: Tier = Tier.STANDARD
    limits: LimitsIn = Field(default_factory=LimitsIn)


class TenantUpdate(_In):
    """Only the fields sent change; inside `limits`, only the limits sent
    change, and an explicit null makes that limit unlimited."""

    tier: Tier | None = None
    limits: LimitsIn | None = None


class KeyCreate(_In):
    # States the one-of rule below in /openapi.json too.
    model_config = ConfigDict(extra="forbid", json_schema_extra={"not": {
        "required": ["expires_at", "expires_in"],
        "properties": {"expires_at": {"type": "string"}, "expires_in": {"type": "integer"}}}})

    name: stored_text(min_length=1, max_length=128) | None = None
    expires_at: AwareDatetime | None = None
    expires_in: Annotated[StrictInt, Field(gt=0, le=MAX_KEY_LIFETIME_S)] | None = Field(
        default=None, description="seconds from now")

    @field_validator("expires_at", mode="before")
    @classmethod
    def _iso_text(cls, value: Any) -> Any:
        # pydantic also reads a number, or text of digits, as Unix seconds;
        # /openapi.json promises an ISO 8601 string, so only that is taken.
        if value is not None and not (isinstance(value, str) and _ISO_DATE.match(value)):
            raise ValueError("must be an ISO 8601 date-time string, such as 2030-01-31T12:00:00Z")
        return value

    @field_validator("expires_at")
    @classmethod
    def _in_utc(cls, value: dt.datetime | None) -> dt.datetime | None:
        # 9999-12-31T23:00-05:00 parses, but is past datetime.max in UTC, where the store keeps it.
        try:
            return None if value is None else value.astimezone(dt.UTC)
        except OverflowError:
            raise ValueError("is out of range once converted to UTC") from None

    @model_validator(mode="after")
    def _one_expiry(self) -> KeyCreate:
        if self.expires_at is not None and self.expires_in is not None:
            raise ValueError("give expires_at or expires_in, not both")
        return self


class AdapterUpload(_In):
    """The form fields of an adapter upload (the files come beside them)."""

    # Checked by the registry (validate_name), with its own message; the
    # pattern states the rule in /openapi.json.
    name: Annotated[str, Field(json_schema_extra={"pattern": ADAPTER_NAME_PATTERN},
                               description="a-z 0-9 . _ -, at most 64, no '..'")]
    tenant: TenantName | None = None  # the owner; None for a platform adapter
    shared: bool = False  # usable by every tenant


# ---- outputs ----

class LimitsOut(BaseModel):
    max_concurrent: int | None
    requests_per_minute: int | None
    tokens_per_minute: int | None


class TenantOut(BaseModel):
    object: Literal["tenant"] = "tenant"
    id: str
    name: str
    tier: Tier
    limits: LimitsOut
    created_at: dt.datetime | None


class KeyOut(BaseModel):
    object: Literal["api_key"] = "api_key"
    id: str
    tenant: str
    prefix: str
    name: str | None
    status: Literal["active", "expired", "revoked"]
    created_at: dt.datetime
    expires_at: dt.datetime | None
    revoked_at: dt.datetime | None


class IssuedKeyOut(KeyOut):
    key: str = Field(description="the secret; shown this once and never again")


class AdapterVersionOut(BaseModel):
    version: int
    ref: str
    digest: str
    rank: int
    target_modules: list[str]
    size_bytes: int
    created_at: str


class AdapterOut(BaseModel):
    object: Literal["adapter"] = "adapter"
    name: str
    owner: str | None
    shared: bool
    latest_version: int
    versions: list[AdapterVersionOut]


class Deleted(BaseModel):
    object: str
    id: str
    deleted: Literal[True] = True


class AlertOut(BaseModel):
    """A firing alert, in the shape of Alertmanager's API (gateway.slo.Alert)."""
    status: Literal["firing", "resolved"]
    labels: dict[str, str]
    annotations: dict[str, str]
    startsAt: str = Field(description="RFC 3339, UTC")
    endsAt: str = Field(description="RFC 3339, UTC; the zero time while firing")
    generatorURL: str
    fingerprint: str


class ListOut(BaseModel):
    object: Literal["list"] = "list"
    data: list[Any]


# /admin/usage answers a page at a time: the ledger grows without bound.
USAGE_PAGE_ROWS = 1000
USAGE_PAGE_MAX_ROWS = 10_000


class UsagePage(ListOut):
    """A page of `/admin/usage`; `next_cursor`, sent back as `?cursor=`, asks for the next."""
    has_more: bool
    next_cursor: str | None = Field(description="null on the last page")
