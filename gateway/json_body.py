"""A request body as JSON, parsed so that no body can make a 500.

Python's json module has three traps for untrusted input: nesting deep
enough to exhaust the recursion limit (a RecursionError), integers past
`sys.get_int_max_str_digits()` digits (a ValueError), and the non-standard
constants `NaN`/`Infinity`. It also lets lone UTF-16 surrogates through,
which no UTF-8 encoder (the tokenizer, asyncpg, the JSON response echoing a
field back) will take: as `\\ud800` escapes, and from bytes, which it
decodes with "surrogatepass" (so CESU-8's ED A0 80 passes) after guessing
UTF-16 or UTF-32 from the NULs. `load_json` takes only UTF-8 (RFC 8259 for
JSON exchanged between systems; a leading byte order mark is ignored, as
the RFC allows), refuses all of the above with a 400, and bounds the
nesting depth so that no later validator walks a structure deeper than any
real request. JSON inside a field (a schema sent as a string, a tool call's
arguments) goes through it too: its escapes are only decoded there.
"""

from __future__ import annotations

import json
import re

from gateway.errors import InvalidRequest

# Deeper than any OpenAI request (messages[i].content[j].text is 5 levels)
# and far below the interpreter's recursion limit. A grammar bound, like
# protobuf's JSON parser's 100 or orjson's 1024, not an operator's knob.
MAX_JSON_DEPTH = 32

# A `\uD800`-`\uDFFF` escape: once the text is strict UTF-8, the only way a
# surrogate gets into a parsed string.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")


def load_json(raw: bytes | str, what: str = "the body", param: str | None = None) -> object:
    """The parsed JSON, or InvalidRequest (400) saying what is wrong with it;
    `what` names it in the message and `param` in the error."""
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidRequest(f"{what} is not valid JSON: it is not UTF-8 ({exc})", param=param) from None
    text = raw.removeprefix("\ufeff")
    try:
        body = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise _too_deep(what, param) from None
    except ValueError as exc:  # JSONDecodeError, too many digits, NaN
        raise InvalidRequest(f"{what} is not valid JSON: {exc}", param=param) from None
    # Counting brackets runs at C speed; only a body with more of them than
    # the bound (a long conversation, or text full of brackets) is walked.
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH and _depth_exceeds(body, MAX_JSON_DEPTH):
        raise _too_deep(what, param)
    if _SURROGATE_ESCAPE.search(text) and has_lone_surrogate(body):
        raise InvalidRequest(f"{what} is not valid JSON: a string holds a lone UTF-16 surrogate "
                             "(\\ud800-\\udfff), which is not a Unicode character", param=param)
    return body


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def _too_deep(what: str, param: str | None) -> InvalidRequest:
    return InvalidRequest(f"{what} is nested deeper than {MAX_JSON_DEPTH} levels of arrays and objects",
                          param=param)


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


def has_lone_surrogate(body: object) -> bool:
    """Whether a string anywhere in `body`, a key included, holds one."""
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
