"""GET /openapi.json: an OpenAPI 3.1 document for the /v1 and /admin APIs.

The document is generated: `OPERATIONS` lists each operation with its
request and response schemas (the same pydantic models the routes parse and
answer with), and their JSON schemas become `components.schemas`. Adding an
endpoint means adding one `Operation` line here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, create_model
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from adapters.errors import CONFIG_FILE, WEIGHTS_FILE
from billing.export import CURSOR_PATTERN, MAX_CURSOR
from gateway.schemas import admin as adm
from gateway.schemas import openai as oai

API_KEY, ADMIN = "apiKey", "adminToken"


@dataclass(frozen=True)
class Operation:
    method: str
    path: str
    summary: str
    response: type[BaseModel] | None
    request: type[BaseModel] | None = None
    security: str | None = API_KEY
    status: int = 200
    errors: tuple[int, ...] = ()
    stream: type[BaseModel] | None = None  # the chunk model when `stream: true` is allowed
    multipart_files: tuple[str, ...] = ()  # request is multipart: `request` holds its fields
    query: tuple[tuple[str, dict], ...] = ()  # (name, JSON schema) of each optional query parameter


@functools.cache
def list_of(model: type[BaseModel]) -> type[BaseModel]:
    """`{"object": "list", "data": [model]}`, as the list endpoints answer."""
    return create_model(f"{model.__name__}List", object=(Literal["list"], "list"), data=(list[model], ...))


# Every operation behind a key can also answer 503 (the database or the
# engine is unavailable, or the server is draining), and every one that
# takes a body 413 (over --max-request-bytes).
_V1_ERRORS = (400, 401, 404, 413, 429, 503)
_ADMIN_ERRORS = (400, 401, 404, 503)
_ADMIN_BODY_ERRORS = (*_ADMIN_ERRORS, 413)

_ISO_TIME = {"anyOf": [{"type": "string", "format": "date"}, {"type": "string", "format": "date-time"},
                       {"type": "string", "maxLength": 0}],
             "description": "an ISO date or datetime; without a zone, UTC; empty: no bound"}
_USAGE_QUERY = (
    ("tenant", {"type": "string", "pattern": adm.TENANT_NAME_PATTERN}),
    ("since", _ISO_TIME),
    ("until", {**_ISO_TIME, "description": "exclusive; " + _ISO_TIME["description"]}),
    ("group_by", {"type": "string", "enum": ["none", "hour", "day"], "default": "none"}),
    ("limit", {"type": "integer", "minimum": 1, "maximum": adm.USAGE_PAGE_MAX_ROWS, "default": adm.USAGE_PAGE_ROWS,
               "description": "rows a page"}),
    ("cursor", {"type": "string", "pattern": CURSOR_PATTERN, "maxLength": MAX_CURSOR,
                "description": "the previous page's next_cursor; empty: the first page"}),
)

OPERATIONS = [
    Operation("get", "/health", "liveness: answers while the process runs", None, security=None),
    Operation("get", "/ready", "readiness: 200 once the model is loaded, 503 while loading or draining",
              None, security=None, errors=(503,)),
    Operation("post", "/v1/chat/completions", "create a chat completion", oai.ChatCompletion,
              oai.ChatCompletionRequest, errors=_V1_ERRORS, stream=oai.ChatCompletionChunk),
    Operation("post", "/v1/completions", "create a text completion", oai.Completion,
              oai.CompletionRequest, errors=_V1_ERRORS, stream=oai.Completion),
    Operation("get", "/v1/models", "the base model and the adapters this key may use", oai.ModelList,
              errors=(401, 503)),
    Operation("get", "/v1/models/{model}", "one model of that list: the base model or an adapter", oai.ModelCard,
              errors=(401, 404, 503)),
    Operation("get", "/admin/tenants", "list tenants", list_of(adm.TenantOut), security=ADMIN,
              errors=(401, 503)),
    Operation("post", "/admin/tenants", "create a tenant", adm.TenantOut, adm.TenantCreate, security=ADMIN,
              status=201, errors=(400, 401, 409, 413, 503)),
    Operation("get", "/admin/tenants/{tenant}", "get a tenant", adm.TenantOut, security=ADMIN,
              errors=_ADMIN_ERRORS),
    Operation("patch", "/admin/tenants/{tenant}", "change a tenant's tier or limits", adm.TenantOut,
              adm.TenantUpdate, security=ADMIN, errors=_ADMIN_BODY_ERRORS),
    Operation("delete", "/admin/tenants/{tenant}", "delete a tenant, its keys and its adapter grants",
              adm.Deleted, security=ADMIN, errors=_ADMIN_ERRORS),
    Operation("get", "/admin/tenants/{tenant}/keys", "list a tenant's API keys (never the secrets)",
              list_of(adm.KeyOut), security=ADMIN, errors=_ADMIN_ERRORS),
    Operation("post", "/admin/tenants/{tenant}/keys", "issue an API key; the secret is returned once",
              adm.IssuedKeyOut, adm.KeyCreate, security=ADMIN, status=201, errors=_ADMIN_BODY_ERRORS),
    Operation("delete", "/admin/keys/{key_id}", "revoke an API key", adm.KeyOut, security=ADMIN,
              errors=_ADMIN_ERRORS),
    Operation("get", "/admin/adapters", "list adapters with their versions", list_of(adm.AdapterOut),
              security=ADMIN, errors=(401, 503)),
    Operation("post", "/admin/adapters", "upload a PEFT LoRA adapter (a new version if the name exists)",
              adm.AdapterOut, adm.AdapterUpload, security=ADMIN, status=201, errors=(*_ADMIN_BODY_ERRORS, 409),
              multipart_files=(CONFIG_FILE, WEIGHTS_FILE)),
    Operation("get", "/admin/adapters/{name}", "get an adapter and its versions", adm.AdapterOut,
              security=ADMIN, errors=_ADMIN_ERRORS),
    Operation("delete", "/admin/adapters/{name}", "delete an adapter (NAME) or one version (NAME@VERSION)",
              adm.Deleted, security=ADMIN, errors=_ADMIN_ERRORS),
    Operation("get", "/admin/alerts", "the SLO monitor's firing alerts, newest last", list_of(adm.AlertOut),
              security=ADMIN, errors=(401,)),
    Operation("get", "/admin/usage", "usage per tenant (`?tenant=` for one), a page at a time", adm.UsagePage,
              security=ADMIN, errors=(400, 401, 503), query=_USAGE_QUERY),
]

_ERROR_TEXT = {400: "invalid request", 401: "missing or invalid credentials", 404: "not found",
               409: "conflict", 413: "payload too large", 429: "rate limited (see Retry-After)",
               503: "not ready, or draining for shutdown"}


def routes() -> list[Route]:
    return [Route("/openapi.json", openapi_json, methods=["GET"], include_in_schema=False)]


async def openapi_json(request: Request) -> JSONResponse:
    return JSONResponse(build_document())


@functools.cache
def build_document() -> dict:
    # Requests are described as they are parsed, responses as they are sent.
    modes = {oai.ErrorResponse: "serialization"}
    for op in OPERATIONS:
        modes.update({m: "serialization" for m in (op.response, op.stream) if m is not None})
        if op.request is not None:
            modes[op.request] = "validation"
    refs, defs = models_json_schema(list(modes.items()), ref_template="#/components/schemas/{model}")
    ref = {model: schema for (model, _mode), schema in refs.items()}
    paths: dict[str, dict] = {}
    for op in OPERATIONS:
        paths.setdefault(op.path, {})[op.method] = _operation(op, ref)
    return {
        "openapi": "3.1.0",
        "info": {"title": "loragw", "version": "1",
                 "description": "OpenAI-compatible inference (/v1) and administration (/admin) of a "
                                "multi-tenant LoRA gateway."},
        "paths": paths,
        "components": {
            "schemas": defs.get("$defs", {}),
            "securitySchemes": {
                API_KEY: {"type": "http", "scheme": "bearer", "description": "a tenant's API key"},
                ADMIN: {"type": "http", "scheme": "bearer", "description": "the admin token (--admin-token)"},
            },
        },
    }


def _operation(op: Operation, ref: dict) -> dict:
    out: dict = {"summary": op.summary, "operationId": f"{op.method}_{op.path.strip('/')}".replace("/", "_")
                 .replace("{", "").replace("}", "")}
    params = [p.strip("{}") for p in op.path.split("/") if p.startswith("{")]
    parameters = [{"name": p, "in": "path", "required": True, "schema": _path_schema(op, p)} for p in params]
    parameters += [{"name": name, "in": "query", "required": False, "schema": schema} for name, schema in op.query]
    if parameters:
        out["parameters"] = parameters
    if op.security is not None:
        out["security"] = [{op.security: []}]
    if op.request is not None:
        out["requestBody"] = {"required": True, "content": _request_content(op, ref)}
    ok: dict = {"description": "OK" if op.status == 200 else "created"}
    if op.response is not None:
        ok["content"] = {"application/json": {"schema": ref[op.response]}}
    if op.stream is not None:
        ok.setdefault("content", {})["text/event-stream"] = {"schema": _sse_event(op.stream, ref)}
    responses = {str(op.status): ok}
    for status in op.errors:
        responses[str(status)] = {"description": _ERROR_TEXT[status],
                                  "content": {"application/json": {"schema": ref[oai.ErrorResponse]}}}
    out["responses"] = responses
    return out


def _sse_event(chunk: type[BaseModel], ref: dict) -> dict:
    """One server-sent event of a stream (before OpenAPI 3.2's itemSchema,
    `schema` describes each event): a chunk, an error once the stream has
    begun, or the closing `[DONE]`."""
    json_data = {"type": "string", "contentMediaType": "application/json",
                 "contentSchema": {"anyOf": [ref[chunk], ref[oai.ErrorResponse]]}}
    return {"type": "object", "required": ["data"],
            "description": f"with `stream: true`: `data: <{chunk.__name__}>` events, then `data: [DONE]`",
            "properties": {"data": {"anyOf": [{"const": "[DONE]"}, json_data]}}}


def _path_schema(op: Operation, param: str) -> dict:
    """What a path parameter may be; anything else is a 400 or a 404."""
    if param == "tenant":
        return {"type": "string", "pattern": adm.TENANT_NAME_PATTERN}
    if param == "name":  # an adapter: GET takes a name, DELETE a name or NAME@VERSION
        return {"type": "string", "pattern": adm.ADAPTER_REF_PATTERN if op.method == "delete"
                else adm.ADAPTER_NAME_PATTERN}
    return {"type": "string", "pattern": "^[^\\u0000]*$"}


def _request_content(op: Operation, ref: dict) -> dict:
    if not op.multipart_files:
        return {"application/json": {"schema": ref[op.request]}}
    # One object, not allOf(fields, files): the fields' model forbids extra
    # properties, which would make the files contradict it.
    schema = op.request.model_json_schema(mode="validation")
    assert "$defs" not in schema, "multipart fields must be flat"
    schema["properties"].update({f: {"type": "string", "contentMediaType": "application/octet-stream"}
                                 for f in op.multipart_files})
    schema["required"] = schema.get("required", []) + list(op.multipart_files)
    return {"multipart/form-data": {"schema": schema}}
