"""A request body as JSON, parsed so that no body can make a 500.

Python's json module has three traps for untrusted input: nesting deep
enough to exhaust the recursion limit (a RecursionError), integers past
`sys.get_int_max_str_digits()` digits (a ValueError), and the non-standard
constants `NaN`/`Infinity`. It also lets `\\ud800` escapes through as lone
surrogates, which no UTF-8 encoder (the tokenizer, asyncpg, the JSON
response echoing a field back) will take. `load_json` refuses all of them
with a 400, and bounds the nesting depth so that no later validator walks a
structure deeper than any real request.
"""

from __future__ import annotations

import json
import re

from gateway.errors import InvalidRequest

# Deeper than any OpenAI request (messages[i].content[j].text is 5 levels)
# and far below the interpreter's recursion limit. A grammar bound, like
# protobuf's JSON parser's 100 or orjson's 1024, not an operator's knob.
MAX_JSON_DEPTH = 32

# A `\uD800`-`\uDFFF` escape: the only way a surrogate gets into a parsed string.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


def load_json(raw: bytes) -> object:
    """The parsed body, or InvalidRequest (400) saying what is wrong with it."""
    try:
        body = json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError:
        raise _too_deep() from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, too many digits, NaN
        raise InvalidRequest(f"the body is not valid JSON: {exc}") from None
    # Counting brackets runs at C speed; only a body with more of them than
    # the bound (a long conversation, or text full of brackets) is walked.
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and _depth_exceeds(body, MAX_JSON_DEPTH):
        raise _too_deep()
    if _SURROGATE_ESCAPE.search(raw) and _has_lone_surrogate(body):
        raise InvalidRequest("the body is not valid JSON: a string holds a lone UTF-16 surrogate (\\ud800-\\udfff), "
                             "which is not a Unicode character")
    return body


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def _too_deep() -> InvalidRequest:
    return InvalidRequest(f"the body is nested deeper than {MAX_JSON_DEPTH} levels of arrays and objects")


def _children(value: object):
    if isinstance(value, dict):
        return value.values()
    return value if isinstance(value, list) else ()


def _depth_exceeds(body: object, limit: int) -> bool:
    """Whether arrays/objects nest more than `limit` deep (iterative: a
    recursive walk would fail the way json.loads does)."""
    stack = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in _children(value) if isinstance(child, (dict, list)))
    return False


def _has_lone_surrogate(body: object) -> bool:
    stack = [body]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            stack.extend(value.keys())
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return True
        else:
            stack.extend(_children(value))
    return False
