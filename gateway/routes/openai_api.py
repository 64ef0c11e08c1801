"""The OpenAI-compatible API: /v1/chat/completions, /v1/completions, /v1/models (and one model).

Every completion takes the same path:
  auth -> the tier queue's and the tenant's limits (429) -> read the body (413) -> parse (400)
  -> model: base or an adapter this tenant may use (404)
  -> prepare tokens and sampling (400) -> admission (429) -> engine
  -> one JSON body, or an SSE stream.
The cache salt comes from the principal, never from the request, so KV is
shared only inside a tenant.
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Callable, NamedTuple

from anyio import to_thread
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from adapters.errors import AdapterError
from gateway.deps import gateway_of, require_principal
from gateway.engine_client import EngineRequest
from gateway.errors import ModelNotFound, RateLimited, ServiceUnavailable
from gateway.lifecycle import RequestLifecycle
from gateway.openai_format import ResponseFormat
from gateway.prepare import Prepared, parse_body, prepare_chat, prepare_completion
from gateway.schemas.openai import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from gateway.store.base import NotFound
from gateway.streaming import SSEResponse, check_output, collect_output, completion_events, run_until_disconnect
from gateway.tenancy import Principal
from gateway.tracing import admission_span

PLATFORM_OWNER = "loragw"
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before the answer


def routes() -> list[Route]:
    return [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", retrieve_model, methods=["GET"]),
    ]


async def chat_completions(request: Request) -> Response:
    return await _complete(request, ChatCompletionRequest, prepare_chat, chat=True)


async def completions(request: Request) -> Response:
    return await _complete(request, CompletionRequest, prepare_completion, chat=False)


async def list_models(request: Request) -> JSONResponse:
    principal = await require_principal(request)
    return JSONResponse(ModelList(data=await _model_cards(request, principal)).model_dump(mode="json"))


async def retrieve_model(request: Request) -> JSONResponse:
    """One card of the list (the SDK's `models.retrieve`); anything not in
    it is the completions' 404, so it reveals no more than they do."""
    model = request.path_params["model"]
    if not model:  # `/v1/models/`: a stray slash is an unknown path, as everywhere else
        raise HTTPException(status_code=404)
    principal = await require_principal(request)
    card = next((c for c in await _model_cards(request, principal) if c.id == model), None)
    if card is None:
        raise model_not_found(model)
    return JSONResponse(card.model_dump(mode="json"))


async def _model_cards(request: Request, principal: Principal) -> list[ModelCard]:
    """The base model and the adapters `principal`'s tenant may use."""
    gw = gateway_of(request)
    base = gw.served_model_name
    created = int(gw.wall_clock().timestamp())
    cards = [ModelCard(id=base, created=created, owned_by=PLATFORM_OWNER, root=base)]
    registry = gw.registry
    if registry is not None:
        tenant = principal.tenant.name
        grants = {g.name: g for g in await gw.auth.visible_grants(tenant)}
        for manifest in registry.list():
            grant = grants.get(manifest.name)
            if grant is None:
                continue
            owner = tenant if grant.owner == tenant else (PLATFORM_OWNER if grant.owner is None else "shared")
            cards.append(ModelCard(id=manifest.name, created=_unix(manifest.created_at), owned_by=owner,
                                   parent=base, root=manifest.ref))
    return cards


def _unix(iso: str) -> int:
    return int(dt.datetime.fromisoformat(iso).timestamp())


def model_not_found(model: str) -> ModelNotFound:
    shown = model if len(model) <= 128 else f"{model[:128]}..."  # a long name is not echoed back whole
    return ModelNotFound(f"The model '{shown}' does not exist or you do not have access to it.", param="model")


class ResolvedModel(NamedTuple):
    adapter_key: tuple[str, int, str] | None  # None: the base model
    adapter_owner: str | None  # the grant's owner tenant; None: a platform adapter, or the base model


async def resolve_model(request: Request, principal: Principal, model: str) -> ResolvedModel:
    """The base model, or the registry key of an adapter the tenant may use
    and its owner. Everything else is the same 404, so nobody learns whether
    another tenant's adapter exists."""
    gw = gateway_of(request)
    if model == gw.served_model_name:
        return ResolvedModel(None, None)
    not_found = model_not_found(model)
    registry = gw.registry
    if registry is None:
        raise not_found
    name = model.partition("@")[0]
    try:
        grant = await gw.auth.adapter_grant(name)
    except NotFound:
        raise not_found from None
    if not (grant.shared or grant.owner == principal.tenant.name):
        raise not_found
    try:
        return ResolvedModel(registry.resolve(model).key, grant.owner)
    except AdapterError:
        raise not_found from None


async def _precheck(gw, principal: Principal, *, chat: bool) -> None:
    """The tier queue's limits and the tenant's own, before any work a
    request they refuse could make us do (reading, parsing, tokenizing); a
    refusal is traced like admit's."""
    try:
        await gw.admission.precheck(principal)
    except RateLimited:
        with admission_span(gw.tracing, principal, model=None, chat=chat):
            raise


async def _complete(request: Request, schema, prepare: Callable[..., Prepared], *, chat: bool) -> Response:
    gw = gateway_of(request)
    if gw.draining:
        raise ServiceUnavailable("the server is shutting down; retry on another replica", code="draining",
                                 headers={"Retry-After": "1"})
    principal = await require_principal(request)
    await _precheck(gw, principal, chat=chat)
    # JSON parsing, templating and tokenizing run on worker threads (a
    # bounded number), never on the event loop.
    body = await to_thread.run_sync(parse_body, await request.body(), schema, limiter=gw.prepare_limiter)
    adapter_key, adapter_owner = await resolve_model(request, principal, body.model)
    prepared = await to_thread.run_sync(prepare, body, gw.engine, limiter=gw.prepare_limiter)
    params = prepared.params
    with admission_span(gw.tracing, principal, model=body.model, chat=chat):
        ticket = await gw.admission.admit(principal, prompt_tokens=len(prepared.prompt_ids),
                                    max_tokens=params.max_tokens * params.n)
    # Unique even when a client sends the same X-Request-Id again: the ledger keys on it.
    request_id = f"{request.state.request_id}-{uuid.uuid4().hex}"
    engine_request = EngineRequest(
        request_id=request_id, tenant_id=principal.tenant.id, tier=principal.tenant.tier,
        prompt_ids=prepared.prompt_ids, params=params, adapter_key=adapter_key, cache_salt=principal.cache_salt)
    fmt = ResponseFormat(id=f"{'chatcmpl' if chat else 'cmpl'}-{request_id}", model=body.model,
                         created=int(gw.wall_clock().timestamp()), chat=chat, decode=gw.engine.decode,
                         tools=prepared.tools)
    lifecycle = RequestLifecycle(gw, ticket, principal, request_id=request_id, model=body.model,
                                 adapter_key=adapter_key, adapter_owner=adapter_owner,
                                 prompt_tokens=len(prepared.prompt_ids))
    outputs = None
    streaming = False
    try:
        outputs = gw.engine.generate(engine_request)
        first = None

        async def wait_first() -> None:
            nonlocal first
            first = await anext(outputs)

        # Wait for the first output before answering: an engine that refuses
        # the request then still gets its proper status, not a broken stream.
        # A client that hangs up meanwhile (it is likely queued) is aborted at
        # once: cancelling the wait closes the engine's iterator, which aborts
        # the request before it takes a queue slot's turn or any prefill.
        if not await run_until_disconnect(request.receive, wait_first):
            lifecycle.client_left()
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        check_output(lifecycle.saw(first))  # seen first: an engine error is then billed as one
        if body.stream:
            events = completion_events(first, outputs, fmt, n=params.n, include_usage=body.include_usage,
                                       on_output=lifecycle.saw)
            streaming = True  # the response owns the outputs and the lifecycle now
            # Past the deadline the engine request is aborted first, so `last` is what the ledger bills.
            usage = (lambda: fmt.usage_chunk(lifecycle.last)) if body.include_usage else (lambda: None)
            return SSEResponse(events, on_close=lifecycle.close, max_seconds=gw.config.max_stream_seconds,
                               on_deadline=lifecycle.server_aborted, usage=usage)
        final = first

        async def collect() -> None:
            nonlocal final
            final = await collect_output(first, outputs, on_output=lifecycle.saw)

        if not final.finished and not await run_until_disconnect(request.receive, collect):
            return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody is listening
        return JSONResponse(fmt.response(final))
    finally:
        if not streaming:
            if outputs is not None:
                await outputs.aclose()  # aborts the engine request if it is still running
            lifecycle.close()
