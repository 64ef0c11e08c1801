"""Strings that may reach the database.

PostgreSQL's text types cannot hold NUL (asyncpg refuses "\\x00" outright),
so a NUL in a field that the store compares or saves would be a 500 on one
store and a silent oddity on the other. Fields that reach the store are
`StoredText`, refused with a 400 naming the field. (Lone surrogates, the
other string no encoder takes, are refused when the body is parsed:
gateway.json_body.)
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, Field

NUL_MESSAGE = "must not contain NUL (\\u0000) characters"


def refuse_nul(value: str) -> str:
    if "\x00" in value:
        raise ValueError(NUL_MESSAGE)
    return value


# The pattern only documents the rule in /openapi.json; the validator, with
# its plainer message, enforces it.
_NO_NUL = (AfterValidator(refuse_nul), Field(json_schema_extra={"pattern": "^[^\\u0000]*$"}))
StoredText = Annotated[str, *_NO_NUL]


def stored_text(min_length: int | None = None, max_length: int | None = None):
    """StoredText of a bounded length. The bounds go on the str before the
    validator: after it, pydantic checks them as a generic length and says
    "items" instead of "characters"."""
    return Annotated[str, Field(min_length=min_length, max_length=max_length), *_NO_NUL]
