"""HTTP errors in OpenAI's shape, and the one place exceptions become them.

Every error body is `{"error": {"message", "type", "param", "code"}}` with a
string `code`. Route code raises `APIError` subclasses (or lets a typed
engine, adapter or store error through); `install_error_handlers` maps all
of them, so no route builds an error response by hand and bad input never
turns into a 500.
"""

from __future__ import annotations

import logging

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse

from adapters.errors import AdapterError
from engine.errors import EngineDeadError
from engine.errors import ValidationError as EngineValidationError
from gateway.engine_client import EngineNotReady
from gateway.store.base import Conflict, NotFound, StoreUnavailable
from gateway.store.outage import OUTAGE_ERROR_TYPES, database_unavailable

log = logging.getLogger(__name__)


class APIError(Exception):
    status = 500
    type = "internal_error"
    code = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class InvalidRequest(APIError):
    status, type, code = 400, "invalid_request_error", "invalid_request"


class AuthenticationFailed(APIError):
    status, type, code = 401, "authentication_error", "invalid_api_key"


class PermissionDenied(APIError):
    status, type, code = 403, "permission_error", "permission_denied"


class ModelNotFound(APIError):
    """Unknown model or adapter, and also another tenant's adapter: the
    answer is the same, so an adapter's existence is never revealed."""

    status, type, code = 404, "invalid_request_error", "model_not_found"


class ResourceNotFound(APIError):
    status, type, code = 404, "invalid_request_error", "not_found"


class ResourceConflict(APIError):
    status, type, code = 409, "invalid_request_error", "conflict"


class PayloadTooLarge(APIError):
    status, type, code = 413, "invalid_request_error", "payload_too_large"


class RequestTimeout(APIError):
    """408: the client did not send its request in time. Sent by the
    server's protocol (gateway.http_protocol), which then closes."""

    status, type, code = 408, "timeout_error", "request_timeout"


class HeaderFieldsTooLarge(APIError):
    """431: the request line and headers are over the HTTP parser's limit.
    Sent by the server's protocol (gateway.http_protocol), not by a route."""

    status, type, code = 431, "invalid_request_error", "request_header_fields_too_large"


class RateLimited(APIError):
    """429: `limit` names what was hit; `retry_after_s` becomes Retry-After."""

    status, type, code = 429, "rate_limit_error", "rate_limit_exceeded"

    def __init__(self, message: str, *, limit: str, retry_after_s: float):
        seconds = max(1, int(-(-retry_after_s // 1)))  # whole seconds, rounded up
        super().__init__(message, code=limit, headers={"Retry-After": str(seconds)})
        self.limit = limit
        self.retry_after_s = seconds


class StreamDeadlineExceeded(APIError):
    """A stream ran past the server's `max_stream_seconds` (Envoy's
    max_stream_duration): it is aborted and ends with this as an event."""

    status, type, code = 408, "timeout_error", "stream_deadline_exceeded"


class ServiceUnavailable(APIError):
    status, type, code = 503, "service_unavailable", "service_unavailable"


# How soon a client should retry after a database outage's 503: long
# enough not to hammer a database on its way back up.
DATABASE_RETRY_AFTER_S = 2


class InternalError(APIError):
    pass


class ClientClosedRequest(APIError):
    """The client hung up before its request was read: nobody gets this
    answer, and nothing failed (nginx's 499, not a 5xx for alerting)."""

    status, type, code = 499, "client_closed_request", "client_closed_request"


def to_api_error(exc: BaseException) -> APIError:
    """The API error for any exception; unknown ones become a bare 500."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, (EngineValidationError, AdapterError)):
        return InvalidRequest(exc.message, param=exc.param)
    if isinstance(exc, NotFound):
        return ResourceNotFound(exc.message, param=exc.param)
    if isinstance(exc, Conflict):
        return ResourceConflict(exc.message, param=exc.param)
    if isinstance(exc, EngineDeadError):
        return ServiceUnavailable("the inference engine is not running", code="engine_unavailable")
    if isinstance(exc, EngineNotReady):
        return ServiceUnavailable(f"the model is not ready: {exc}", code="engine_not_ready")
    if database_unavailable(exc):
        if not isinstance(exc, StoreUnavailable):
            log.warning("database unavailable: %s: %s", type(exc).__name__, exc)
        return ServiceUnavailable("the database is unavailable; retry shortly", code="database_unavailable",
                                  headers={"Retry-After": str(DATABASE_RETRY_AFTER_S)})
    if isinstance(exc, ClientDisconnect):
        return ClientClosedRequest("the client disconnected before its request was read")
    if isinstance(exc, HTTPException):
        error = {404: ResourceNotFound, 405: InvalidRequest, 401: AuthenticationFailed}.get(exc.status_code, APIError)
        out = error(exc.detail or "error", headers=dict(exc.headers or {}))  # a 405's Allow among them
        out.status = exc.status_code
        if exc.status_code == 405:
            out.code = "method_not_allowed"
        return out
    log.error("unhandled error", exc_info=exc)
    return InternalError("internal server error")


def error_response(exc: BaseException) -> JSONResponse:
    error = to_api_error(exc)
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def install_error_handlers(app: Starlette) -> None:
    async def handle(request: Request, exc: Exception) -> JSONResponse:
        return error_response(exc)

    # Expected errors go to Starlette's ExceptionMiddleware, which answers
    # and is done. Anything else propagates to RequestIdMiddleware
    # (gateway/app.py), which answers the 500 with `error_response` (that
    # logs the traceback) on a connection that stays open. The handler for
    # bare `Exception` runs in ServerErrorMiddleware, outside it, only if
    # that answer itself fails.
    for expected in (APIError, EngineValidationError, AdapterError, NotFound, Conflict, EngineDeadError,
                     EngineNotReady, HTTPException, ClientDisconnect) + OUTAGE_ERROR_TYPES:
        app.add_exception_handler(expected, handle)
    app.add_exception_handler(Exception, handle)
