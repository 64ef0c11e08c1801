"""Request and response bodies for structured output and tool calls.

Requests: OpenAI's `response_format`, `tools` and `tool_choice`, assistant
messages that carry `tool_calls`, and vLLM's `structured_outputs`. Shapes
are checked here; whether a schema, regex or grammar compiles is checked
when the request is prepared (gateway/prepare.py), against the tokenizer.

Responses: the `tool_calls` of a message and of a streamed delta.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

_REQUEST = ConfigDict(extra="ignore", strict=True, populate_by_name=True)

TOOL_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
MAX_TOOLS = 128

ToolName = Annotated[str, Field(pattern=TOOL_NAME_PATTERN)]
# A JSON schema, or any JSON object: what compiles is up to llguidance.
JsonObject = dict[str, Any]


class JsonSchemaFormat(BaseModel):
    model_config = _REQUEST
    name: ToolName
    description: str | None = None
    # Without a schema the output is any JSON object (as with json_object).
    schema_: JsonObject | None = Field(None, alias="schema")
    strict: bool | None = Field(None, description="ignored: the schema is always enforced")


class ResponseFormatParam(BaseModel):
    model_config = _REQUEST
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormatParam:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only then")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's extra field: exactly one constraint."""

    model_config = _REQUEST
    regex: str | None = None
    choice: Annotated[list[str], Field(fail_fast=True)] | None = None
    grammar: str | None = Field(None, description="a Lark grammar in llguidance's dialect")
    json_: JsonObject | str | None = Field(None, alias="json",
                                           description="a JSON schema, or a JSON string of one")
    json_object: bool | None = None

    def given(self) -> list[str]:
        """The constraints set, by their wire names."""
        names = {"regex": self.regex, "choice": self.choice, "grammar": self.grammar, "json": self.json_,
                 "json_object": self.json_object or None}
        return [name for name, value in names.items() if value is not None]


class FunctionDefinition(BaseModel):
    model_config = _REQUEST
    name: ToolName
    description: str | None = None
    parameters: JsonObject | None = Field(None, description='a JSON schema of type "object"; default '
                                                            '{"type":"object","properties":{}}')
    strict: bool | None = Field(None, description="ignored: the parameters schema is always enforced")

    @field_validator("parameters")
    @classmethod
    def _an_object_schema(cls, value: JsonObject | None) -> JsonObject | None:
        """A call's arguments are a JSON object (OpenAI's `tool_calls`), so
        a schema of another type could never make one: refused, as OpenAI
        does."""
        if value is not None and "type" in value and value["type"] != "object":
            raise ValueError(f'must be a JSON schema of type "object", got type {repr(value["type"])[:100]}')
        return value

    def parameters_schema(self) -> JsonObject:
        """The schema the arguments are held to; one that names no type (a
        bare `properties`, or `{}`) is taken as an object's."""
        if self.parameters is None:
            return {"type": "object", "properties": {}}
        return self.parameters if "type" in self.parameters else {"type": "object", **self.parameters}


class Tool(BaseModel):
    model_config = _REQUEST
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = _REQUEST
    name: str


class NamedToolChoice(BaseModel):
    model_config = _REQUEST
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    """A call the model made: `arguments` is JSON text, as OpenAI sends it."""

    model_config = _REQUEST
    name: str
    arguments: str


class ToolCall(BaseModel):
    model_config = _REQUEST
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


# ---- responses ----------------------------------------------------------------


# A later piece of a call leaves out what only the first carries, as OpenAI
# and vLLM send them: the SDK's stream helper copies every key it gets, so
# an explicit `"type": null` replaced the call's type ("function") with None.
_ABSENT_IF_NONE = Field(None, exclude_if=lambda value: value is None)


class FunctionCallDelta(BaseModel):
    name: str | None = _ABSENT_IF_NONE
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    """A piece of a streamed tool call: the first carries id, type and name."""

    index: int
    id: str | None = _ABSENT_IF_NONE
    type: Literal["function"] | None = _ABSENT_IF_NONE
    function: FunctionCallDelta
