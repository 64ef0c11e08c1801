"""The output constraint a request asks for: OpenAI's `response_format`,
vLLM's `structured_outputs`, or its tools (gateway/tools.py); at most one
of them. Every constraint is compiled against the tokenizer before the
request is admitted (`EngineClient.check_structured`), so a schema, regex
or grammar the engine cannot enforce is a 400 naming its field, never an
engine error.
"""

from __future__ import annotations

from engine.structured.spec import StructuredSpec
from gateway.errors import InvalidRequest
from gateway.json_body import load_json
from gateway.schemas.openai import ChatCompletionRequest, CompletionRequest
from gateway.schemas.structured import NamedToolChoice, ResponseFormatParam, StructuredOutputs
from gateway.tools import ToolPlan, plan_tools


def output_spec(req: ChatCompletionRequest | CompletionRequest) -> StructuredSpec | None:
    """The constraint of `response_format` or `structured_outputs`, if any.
    Raises engine ValidationError (a 400) for a bad schema's shape."""
    fmt = req.response_format if isinstance(req, ChatCompletionRequest) else None
    from_format = _format_spec(fmt) if fmt is not None else None
    if req.structured_outputs is None:
        return from_format
    if from_format is not None:
        raise InvalidRequest("structured_outputs: cannot be combined with a response_format other than text",
                             param="structured_outputs")
    return _structured_outputs_spec(req.structured_outputs)


def _format_spec(fmt: ResponseFormatParam) -> StructuredSpec | None:
    if fmt.type == "json_object" or (fmt.type == "json_schema" and fmt.json_schema.schema_ is None):
        return StructuredSpec.json_object(param="response_format")
    if fmt.type == "json_schema":
        return StructuredSpec.json_schema(fmt.json_schema.schema_, param="response_format.json_schema.schema")
    return None


def _structured_outputs_spec(so: StructuredOutputs) -> StructuredSpec:
    given = so.given()
    if len(given) != 1:
        raise InvalidRequest("structured_outputs: exactly one of regex, choice, grammar, json or json_object "
                             f"must be given, got {len(given)}", param="structured_outputs")
    (name,) = given
    param = f"structured_outputs.{name}"
    if name == "regex":
        return StructuredSpec.regex(so.regex, param)
    if name == "choice":
        return StructuredSpec.choice(so.choice, param)
    if name == "grammar":
        return StructuredSpec.grammar(so.grammar, param)
    if name == "json_object":
        return StructuredSpec.json_object(param)
    schema = so.json_
    if isinstance(schema, str):
        schema = load_json(schema, f"{param}, a string,", param)
    return StructuredSpec.json_schema(schema, param)


def tool_plan(req: ChatCompletionRequest, other: StructuredSpec | None) -> ToolPlan | None:
    """What the request's tools ask for; None without tools or with
    tool_choice "none". `other` is the constraint of response_format or
    structured_outputs, which tools cannot share the output with."""
    choice = req.tool_choice
    if not req.tools:
        if choice is not None and choice not in ("none", "auto"):
            raise InvalidRequest("tool_choice: a tool choice needs tools", param="tool_choice")
        return None
    choice = "auto" if choice is None else choice
    names = [t.function.name for t in req.tools]
    if len(set(names)) != len(names):
        raise InvalidRequest("tools: tool names must be unique", param="tools")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise InvalidRequest(f"tool_choice: no tool is named {choice.function.name!r}", param="tool_choice")
    plan = plan_tools(req.tools, choice)
    if plan is not None and other is not None:
        param = "response_format" if req.structured_outputs is None else "structured_outputs"
        raise InvalidRequest(f"{param}: cannot be combined with tools (unless tool_choice is \"none\")",
                             param=param)
    return plan
