"""Which database failures mean "the database is unavailable", as opposed
to a bug or bad input.

A refused or dropped connection, a connect or query timeout and an
exhausted pool are all transient: the client may retry, so they become a
503 with Retry-After (gateway/errors.py), never a 500. SQLAlchemy wraps a
failure during a query (`OperationalError`, `InterfaceError`, or any
`DBAPIError` that invalidated its connection), but asyncpg's connect errors
come through raw (`ConnectionRefusedError`, `TimeoutError`), so both kinds
are recognised here.
"""

from __future__ import annotations

import functools
import inspect

from sqlalchemy import exc as sa_exc

from gateway.store.base import StoreUnavailable

try:
    import asyncpg
except ImportError:  # SQLite-only installs
    _ASYNCPG_ERRORS: tuple[type[BaseException], ...] = ()
else:
    _ASYNCPG_ERRORS = (asyncpg.PostgresConnectionError, asyncpg.InterfaceError,
                       asyncpg.exceptions.CannotConnectNowError, asyncpg.exceptions.TooManyConnectionsError)

# Not every OSError: a failing adapter file is no database outage. Inside
# the store any OSError is one (see `guard_unavailable`).
_NETWORK_ERRORS = (ConnectionError, TimeoutError)


# Every exception type `database_unavailable` may say yes to: the error
# handlers catch these as expected errors (a non-outage one among them is
# still a logged 500).
OUTAGE_ERROR_TYPES: tuple[type[BaseException], ...] = (
    StoreUnavailable, sa_exc.DBAPIError, sa_exc.TimeoutError, sa_exc.DisconnectionError) + _ASYNCPG_ERRORS + \
    _NETWORK_ERRORS


def database_unavailable(exc: BaseException) -> bool:
    """True for a failure to reach or hear from the database."""
    if isinstance(exc, StoreUnavailable):
        return True
    if isinstance(exc, sa_exc.DBAPIError):
        return exc.connection_invalidated or isinstance(exc, (sa_exc.OperationalError, sa_exc.InterfaceError))
    # The pool's own timeout (all connections busy), and a connection it
    # found dead on checkout.
    return isinstance(exc, (sa_exc.TimeoutError, sa_exc.DisconnectionError) + _ASYNCPG_ERRORS + _NETWORK_ERRORS)


def guard_unavailable(cls):
    """Class decorator for a `Store`: every public coroutine method raises
    `StoreUnavailable` (the original as its cause) instead of a driver's
    connection error, so callers handle one typed error."""
    for name, method in list(vars(cls).items()):
        if not name.startswith("_") and inspect.iscoroutinefunction(method):
            setattr(cls, name, _guarded(method))
    return cls


def _guarded(method):
    @functools.wraps(method)
    async def guarded(*args, **kwargs):
        try:
            return await method(*args, **kwargs)
        except StoreUnavailable:
            raise
        except Exception as exc:
            if database_unavailable(exc) or isinstance(exc, OSError):
                raise StoreUnavailable(f"the database is unavailable ({type(exc).__name__})") from exc
            raise

    return guarded
