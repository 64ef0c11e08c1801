"""The admin REST API (`/admin`): tenants, keys, adapters and usage.

Every route is wrapped by `admin_endpoint`, which calls
`deps.require_admin` (the admin bearer token, never a tenant key) before
the handler runs. Handlers parse their input into a schema and call the
`AdminService` that the CLI uses too.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable

from python_multipart.multipart import parse_options_header
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from adapters.errors import CONFIG_FILE, PICKLE_MESSAGE, WEIGHTS_FILE
from gateway.admin_service import AdminService
from gateway.deps import gateway_of, require_admin
from gateway.engine_client import EngineNotReady
from gateway.errors import InvalidRequest, PayloadTooLarge, ServiceUnavailable
from gateway.json_body import load_json
from gateway.schemas.admin import (TENANT_NAME_PATTERN, TENANT_NAME_RULE, USAGE_PAGE_MAX_ROWS, USAGE_PAGE_ROWS,
                                   AdapterUpload, KeyCreate, ListOut, TenantCreate, TenantUpdate, UsagePage, parse)
from gateway.schemas.text import refuse_nul

USAGE_QUERY = ("tenant", "since", "until", "group_by", "limit", "cursor")
PICKLE_FILES = ("adapter_model.bin", "pytorch_model.bin")


def service_of(request: Request) -> AdminService:
    gw = gateway_of(request)

    def registry():
        try:
            found = gw.registry
        except EngineNotReady as exc:
            raise ServiceUnavailable(f"the model is not loaded yet: {exc}", code="engine_not_ready") from None
        if found is None:
            raise InvalidRequest("LoRA adapters are disabled on this server (max_loras=0)", param="adapter")
        return found

    return AdminService(gw.store, registry=registry, now=gw.wall_clock)


def admin_endpoint(handler: Callable[[Request, AdminService], Awaitable[object]], *, status: int = 200):
    """A Starlette endpoint that checks the admin token before anything
    else, runs `handler(request, service)` and sends its schema (or a list
    of them) as JSON."""

    async def endpoint(request: Request) -> JSONResponse:
        require_admin(request)
        result = await handler(request, service_of(request))
        if request.method != "GET":
            # A change made here takes effect on this replica at once; the
            # others see it within the auth cache's TTL.
            gateway_of(request).auth.clear()
        if isinstance(result, list):
            result = ListOut(data=[item.model_dump(mode="json") for item in result])
        return JSONResponse(result.model_dump(mode="json"), status_code=status)

    return endpoint


def _path(request: Request, name: str) -> str:
    """A path parameter that is safe to look up in the store."""
    return _stored(request.path_params[name], name)


def _stored(value: str | None, param: str) -> str | None:
    try:
        return None if value is None else refuse_nul(value)
    except ValueError as exc:
        raise InvalidRequest(f"{param}: {exc}", param=param) from None


async def _body(request: Request) -> object:
    raw = await request.body()
    if not raw:
        return {}
    return load_json(raw)


# ---- tenants ----

async def list_tenants(request: Request, service: AdminService):
    return await service.list_tenants()


async def create_tenant(request: Request, service: AdminService):
    return await service.create_tenant(parse(TenantCreate, await _body(request)))


async def get_tenant(request: Request, service: AdminService):
    return await service.get_tenant(_path(request, "tenant"))


async def update_tenant(request: Request, service: AdminService):
    return await service.update_tenant(_path(request, "tenant"), parse(TenantUpdate, await _body(request)))


async def delete_tenant(request: Request, service: AdminService):
    return await service.delete_tenant(_path(request, "tenant"))


# ---- keys ----

async def list_keys(request: Request, service: AdminService):
    return await service.list_keys(_path(request, "tenant"))


async def create_key(request: Request, service: AdminService):
    return await service.create_key(_path(request, "tenant"), parse(KeyCreate, await _body(request)))


async def revoke_key(request: Request, service: AdminService):
    return await service.revoke_key(_path(request, "key_id"))


# ---- adapters ----

async def list_adapters(request: Request, service: AdminService):
    return await service.list_adapters()


async def upload_adapter(request: Request, service: AdminService):
    """multipart/form-data: fields `name`, `tenant` (optional owner),
    `shared` (optional bool) and the files adapter_config.json and
    adapter_model.safetensors."""
    media_type, _ = parse_options_header(request.headers.get("content-type", ""))
    if media_type != b"multipart/form-data":  # lower-cased: media types are case-insensitive (RFC 9110)
        raise InvalidRequest("an adapter upload is a multipart/form-data body")
    request = await _buffered(request, gateway_of(request).config.max_upload_bytes)
    try:
        async with request.form(max_files=4, max_fields=8, max_part_size=64 * 1024) as form:
            fields, files = {}, {}
            for key, value in form.multi_items():
                if isinstance(value, UploadFile):
                    key = key if key in (CONFIG_FILE, WEIGHTS_FILE) else (value.filename or key)
                    into = files
                else:
                    into = fields
                if key in into:  # which one counts (the owner, the weights) must not hang on the order sent
                    raise InvalidRequest(f"{key[:128]!r} is sent more than once", param=key[:128])
                into[key] = value
            upload = parse(AdapterUpload, fields)
            config_json = await _file(files, CONFIG_FILE)
            weights = await _file(files, WEIGHTS_FILE)
    except (MultiPartException, HTTPException) as exc:  # Starlette re-raises the first as the second
        raise InvalidRequest(f"malformed multipart upload: {getattr(exc, 'message', None) or exc.detail}") from None
    return await service.upload_adapter(upload, config_json, weights)


async def _file(files: dict[str, UploadFile], name: str) -> bytes:
    if name in files:
        return await files[name].read()
    if name == WEIGHTS_FILE and any(pickled in files for pickled in PICKLE_FILES):
        raise InvalidRequest(PICKLE_MESSAGE, param=WEIGHTS_FILE)
    raise InvalidRequest(f"missing file {name}", param=name)


async def _buffered(request: Request, limit: int) -> Request:
    """The request with its body read into memory, or 413 past `limit`
    bytes (checked against Content-Length first, then while reading)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"upload of {declared} bytes is over the limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"upload is over the limit of {limit} bytes")
        chunks.append(chunk)
    body = b"".join(chunks)
    sent = False

    async def replay():
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return Request(request.scope, replay)


async def get_adapter(request: Request, service: AdminService):
    return await service.get_adapter(request.path_params["name"])


async def delete_adapter(request: Request, service: AdminService):
    return await service.delete_adapter(request.path_params["name"])


# ---- usage ----

async def usage(request: Request, service: AdminService):
    """Usage from the billing ledger, priced per tier: per-record rows, or
    per-tenant totals with `group_by=hour|day`, over `[since, until)`
    (ISO dates or datetimes), `limit` rows a page. `?tenant=` is the name
    the records were made under: a deleted tenant's usage stays there, and
    a name reused since has both tenants' records, told apart by
    `tenant_id`."""
    from billing.export import GROUP_BY, decode_cursor, parse_time, usage_page
    from billing.ledger import Ledger

    q = request.query_params
    # Like the admin bodies, which forbid unknown fields: a misspelt filter
    # (`?tenat=acme`) must not quietly return every tenant's usage.
    unknown = next((name for name in q if name not in USAGE_QUERY), None)
    if unknown is not None:
        raise InvalidRequest(f"unknown query parameter {unknown!r}; expected {', '.join(USAGE_QUERY)}",
                             param=unknown)
    repeated = next((name for name in q if len(q.getlist(name)) > 1), None)
    if repeated is not None:  # `?tenant=a&tenant=b` must not quietly mean b
        raise InvalidRequest(f"query parameter {repeated!r} is given more than once", param=repeated)
    tenant = _stored(q.get("tenant"), "tenant")
    # Records are made under tenant names, so a name no tenant could have
    # is a mistake to point out, not an empty list.
    if tenant is not None and not re.fullmatch(TENANT_NAME_PATTERN, tenant):
        raise InvalidRequest(f"tenant: not a tenant name ({TENANT_NAME_RULE})", param="tenant")
    bounds = {}
    for param in ("since", "until"):
        try:
            bounds[param] = parse_time(q.get(param))
        except ValueError as exc:
            raise InvalidRequest(f"{param}: {exc}", param=param) from None
    group_by = q.get("group_by", "none")
    if group_by not in GROUP_BY:
        raise InvalidRequest(f"group_by must be one of {', '.join(GROUP_BY)}", param="group_by")
    limit = q.get("limit", str(USAGE_PAGE_ROWS))
    # ASCII digits only: int() would also take "１０", " 10" and "1_0", and
    # refuse more than 4,300 digits with a ValueError of its own.
    if not (re.fullmatch(r"[0-9]{1,20}", limit) and 1 <= int(limit) <= USAGE_PAGE_MAX_ROWS):
        raise InvalidRequest(f"limit must be an integer from 1 to {USAGE_PAGE_MAX_ROWS}", param="limit")
    try:
        after = decode_cursor(group_by, q["cursor"]) if q.get("cursor") else None
    except ValueError as exc:
        raise InvalidRequest(f"cursor: {exc}", param="cursor") from None
    gw = gateway_of(request)
    rows, next_cursor = await usage_page(Ledger(gw.store.engine), gw.config.prices, group_by=group_by,
                                         since_us=bounds["since"], until_us=bounds["until"], tenant=tenant,
                                         after=after, limit=int(limit))
    return UsagePage(data=rows, has_more=next_cursor is not None, next_cursor=next_cursor)


def routes() -> list[Route]:
    def route(path: str, method: str, handler, status: int = 200) -> Route:
        return Route(path, admin_endpoint(handler, status=status), methods=[method], name=handler.__name__)

    return [
        route("/admin/tenants", "GET", list_tenants),
        route("/admin/tenants", "POST", create_tenant, 201),
        route("/admin/tenants/{tenant}", "GET", get_tenant),
        route("/admin/tenants/{tenant}", "PATCH", update_tenant),
        route("/admin/tenants/{tenant}", "DELETE", delete_tenant),
        route("/admin/tenants/{tenant}/keys", "GET", list_keys),
        route("/admin/tenants/{tenant}/keys", "POST", create_key, 201),
        route("/admin/keys/{key_id}", "DELETE", revoke_key),
        route("/admin/adapters", "GET", list_adapters),
        route("/admin/adapters", "POST", upload_adapter, 201),
        route("/admin/adapters/{name}", "GET", get_adapter),
        route("/admin/adapters/{name}", "DELETE", delete_adapter),
        route("/admin/usage", "GET", usage),
    ]
