"""What every route needs from a request: the wired gateway, the caller.

Routes call these at their top, so each handler states its requirements
in its first lines (Starlette has no dependency injection of its own)."""

from __future__ import annotations

import hmac

from starlette.requests import Request

from gateway.errors import AuthenticationFailed
from gateway.tenancy import Principal


def gateway_of(request: Request):
    """The `gateway.app.Gateway` this app was built around."""
    return request.app.state.gateway


def bearer_token(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


async def require_principal(request: Request) -> Principal:
    """The tenant behind the request's API key (through the auth cache), or
    401; 503 when the database is down and the key is not cached."""
    token = bearer_token(request)
    if token is None:
        raise AuthenticationFailed("missing API key: send 'Authorization: Bearer <key>'")
    gw = gateway_of(request)
    principal = await gw.auth.authenticate(token, now=gw.wall_clock())
    if principal is None:
        raise AuthenticationFailed("invalid API key")
    return principal


def require_admin(request: Request) -> None:
    """401 unless the request carries the admin token (never a tenant key)."""
    expected = gateway_of(request).config.admin_token
    token = bearer_token(request)
    if not expected or token is None or not hmac.compare_digest(token.encode(), expected.encode()):
        raise AuthenticationFailed("admin routes need the admin token", code="invalid_admin_token")
