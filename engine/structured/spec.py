"""What a structured request asks the engine to enforce: a grammar spec.

Plain Python and no grammar library, so it rides inside `SamplingParams`
over the worker protocol and the scheduler never sees more than a value.
The gateway builds one from OpenAI's `response_format`, vLLM's
`structured_outputs` or a tool call; the engine compiles it with llguidance
(engine/structured/grammar.py).

Limits are checked here, before any compiler sees the text: a spec is at
most `MAX_SPEC_BYTES` of canonical text and a JSON schema at most
`MAX_SCHEMA_DEPTH` deep. Work past those is bounded by llguidance's fuel
(the compile "timeout", counted in work rather than wall time).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass

from engine.errors import ValidationError

MAX_SPEC_BYTES = 64 * 1024
MAX_SCHEMA_DEPTH = 32
MAX_CHOICES = 256


class SpecKind(str, enum.Enum):
    JSON_SCHEMA = "json_schema"  # source: the schema, canonical JSON
    JSON_OBJECT = "json_object"  # any JSON object; source is empty
    REGEX = "regex"
    CHOICE = "choice"  # source: a JSON list of the allowed strings
    GRAMMAR = "grammar"  # a Lark grammar in llguidance's dialect


@dataclass(frozen=True)
class StructuredSpec:
    """A constraint on one request's output; `param` names the request field
    it came from, for the 400 that a bad spec gets."""

    kind: SpecKind
    source: str = ""
    param: str = "response_format"

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", SpecKind(self.kind))
        if not isinstance(self.source, str):
            raise ValidationError(self.param, "the constraint must be text")
        size = len(self.source.encode())
        if size > MAX_SPEC_BYTES:
            raise ValidationError(self.param, f"the constraint is {size} bytes; at most {MAX_SPEC_BYTES} "
                                              "are allowed")

    @property
    def key(self) -> tuple[str, str]:
        """What the compiled-grammar cache is keyed by (the source is canonical)."""
        return (self.kind.value, self.source)

    @classmethod
    def json_schema(cls, schema: object, param: str = "response_format") -> StructuredSpec:
        if isinstance(schema, bool):  # true and false are schemas too, but not useful ones
            raise ValidationError(param, "the schema must be a JSON object")
        if not isinstance(schema, dict):
            raise ValidationError(param, "the schema must be a JSON object")
        depth = _depth(schema)
        if depth > MAX_SCHEMA_DEPTH:
            raise ValidationError(param, f"the schema nests {depth} levels deep; at most {MAX_SCHEMA_DEPTH} "
                                         "are allowed")
        return cls(SpecKind.JSON_SCHEMA, canonical_json(schema, param), param)

    @classmethod
    def json_object(cls, param: str = "response_format") -> StructuredSpec:
        return cls(SpecKind.JSON_OBJECT, "", param)

    @classmethod
    def regex(cls, pattern: object, param: str = "structured_outputs.regex") -> StructuredSpec:
        if not isinstance(pattern, str) or not pattern:
            raise ValidationError(param, "the regex must be a non-empty string")
        return cls(SpecKind.REGEX, pattern, param)

    @classmethod
    def choice(cls, choices: object, param: str = "structured_outputs.choice") -> StructuredSpec:
        if (not isinstance(choices, list) or not choices
                or not all(isinstance(c, str) and c for c in choices)):
            raise ValidationError(param, "choice must be a non-empty list of non-empty strings")
        if len(choices) > MAX_CHOICES:
            raise ValidationError(param, f"at most {MAX_CHOICES} choices are allowed, got {len(choices)}")
        return cls(SpecKind.CHOICE, canonical_json(choices, param), param)

    @classmethod
    def grammar(cls, text: object, param: str = "structured_outputs.grammar") -> StructuredSpec:
        if not isinstance(text, str) or not text.strip():
            raise ValidationError(param, "the grammar must be a non-empty string")
        return cls(SpecKind.GRAMMAR, text, param)


def canonical_json(value: object, param: str = "response_format") -> str:
    """One spelling per JSON value, keys in their given order (a schema's
    property order is the order the output is generated in)."""
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:  # NaN, or a value that did not come from JSON
        raise ValidationError(param, f"not a JSON value: {exc}") from None


def _depth(value: object) -> int:
    """Nesting depth of a JSON value, iteratively: a hostile schema must not
    reach Python's recursion limit here."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        if deepest > MAX_SCHEMA_DEPTH:
            return deepest
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return deepest
