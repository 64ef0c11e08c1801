"""Request and response bodies of the OpenAI-compatible API (`/v1`).

Requests are parsed strictly by type (`"n": "2"` or `"n": true` is a 400)
but leniently by name: fields an OpenAI client may send that we do not use
(`metadata`, `store`, `parallel_tool_calls`, ...) are ignored. Fields whose
non-default value would change the answer in a way we cannot honour
(`functions`, `echo`, `logit_bias`, ...) are refused with a 400 instead of being
silently dropped. The non-standard `top_k`, `min_tokens` and
`repetition_penalty` (vLLM's names) are accepted.

Responses are built from these models too, and /openapi.json is generated
from their JSON schemas.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from engine.sampling_params import MAX_LOGPROBS, MAX_N
from gateway.schemas.structured import (
    MAX_TOOLS,
    ResponseFormatParam,
    StructuredOutputs,
    Tool,
    ToolCall,
    ToolCallDelta,
    ToolChoice,
)
from gateway.schemas.text import StoredText, stored_text

MAX_STOP = 4
MAX_STOP_CHARS = 256  # each stop string is matched against the output text every step
MAX_MESSAGES = 1024  # each one is templated
_INT64 = 2**63

# A list field is checked item by item and, by default, pydantic reports
# every bad item: a 4 MiB body of two million of them costs seconds of CPU
# with the GIL held, which a worker thread does not hide from the event
# loop. Every request list stops at its first bad item, and a list with a
# count limit is refused on its length before any item is looked at.
def _list_of(item):
    return Annotated[list[item], Field(fail_fast=True)]


def _at_most(field: str, limit: int, what: str):
    """A validator that refuses a list of more than `limit` items on its length alone."""

    def check(cls, value: object) -> object:
        if isinstance(value, list) and len(value) > limit:
            raise ValueError(f"at most {limit} {what} are allowed, got {len(value)}")
        return value

    return field_validator(field, mode="before")(classmethod(check))

_REQUEST = ConfigDict(extra="ignore", strict=True)

# JSON schemas for /openapi.json of rules the validators below enforce with
# their own messages (one prompt per request, non-empty stop strings).
_TEXT = {"type": "string", "minLength": 1}
_STOP_TEXT = {**_TEXT, "maxLength": MAX_STOP_CHARS}
_TOKEN_ID = {"type": "integer", "minimum": 0}


def _list(items: dict, *, min_items: int = 1, max_items: int | None = None) -> dict:
    out = {"type": "array", "items": items, "minItems": min_items}
    return out if max_items is None else {**out, "maxItems": max_items}


def _one_of(value: object, choices: tuple) -> bool:
    """`value in choices` with types as strict as the fields': Python has
    True == 1 == 1.0 and 0 == False, so `"best_of": true` would pass as 1."""
    return any(type(value) is type(choice) and value == choice for choice in choices)


class StreamOptions(BaseModel):
    model_config = _REQUEST
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """The fields chat and text completions share."""

    model_config = _REQUEST
    # Fields we do not implement, with the values that make them no-ops; any
    # other value is refused (see `unsupported_field`).
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {"logit_bias": (None, {}), "best_of": (None, 1)}

    model: StoredText = Field(min_length=1, description="the base model's id, or an adapter: NAME or NAME@VERSION")
    max_tokens: int | None = Field(None, ge=1, description="default: the rest of the context window")
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    # Never None once parsed (`_n_null_is_one`); null in the schema, as in OpenAI's.
    n: int | None = Field(1, ge=1, le=MAX_N, description="null means the default, 1")
    stop: str | _list_of(str) | None = Field(
        None, validate_default=True,
        description=f"up to {MAX_STOP} non-empty stop strings of at most {MAX_STOP_CHARS} characters",
        json_schema_extra={"anyOf": [_STOP_TEXT, _list(_STOP_TEXT, min_items=0, max_items=MAX_STOP),
                                     {"type": "null"}]})
    seed: int | None = Field(None, ge=-_INT64, lt=_INT64)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    user: stored_text(max_length=256) | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # Not in OpenAI's API; vLLM's names.
    top_k: int | None = Field(None, ge=-1, lt=_INT64, description="non-standard; 0 or -1 turns top-k off")
    min_tokens: int | None = Field(None, ge=0, description="non-standard")
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0, description="non-standard")
    structured_outputs: StructuredOutputs | None = Field(
        None, description="non-standard (vLLM's): exactly one of regex, choice, grammar, json, json_object")

    @classmethod
    def unsupported_field(cls, body: dict) -> str | None:
        """The first field of a raw body that asks for something we cannot do."""
        return next((name for name, no_ops in cls.UNSUPPORTED.items()
                     if name in body and not _one_of(body[name], no_ops)), None)

    _stop_count = _at_most("stop", MAX_STOP, "stop sequences")

    @field_validator("n", mode="before")
    @classmethod
    def _n_null_is_one(cls, value: object) -> object:
        return 1 if value is None else value

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop sequence is at most {MAX_STOP_CHARS} characters long")
        return stops

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value: StreamOptions | None, info: ValidationInfo):
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class ContentPart(BaseModel):
    """Only text parts: an image or audio part is refused, not dropped."""

    model_config = _REQUEST
    type: Literal["text"]
    text: str

    @field_validator("type", mode="before")
    @classmethod
    def _text_only(cls, value: object) -> object:
        if value != "text":  # say why, rather than a union's "Input should be a valid string"
            raise ValueError(f"only text content parts are supported, got type {value!r}")
        return value


class ChatMessage(BaseModel):
    # `_what_each_role_needs`, stated in /openapi.json too.
    model_config = ConfigDict(**_REQUEST, json_schema_extra={"anyOf": [
        {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
        {"required": ["tool_calls"], "properties": {"role": {"const": "assistant"},
                                                    "tool_calls": {"type": "array", "minItems": 1}}},
    ]})
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | _list_of(ContentPart) | None = None
    name: str | None = None
    tool_calls: _list_of(ToolCall) | None = Field(None, description="assistant messages only",
                                                  json_schema_extra={"maxItems": MAX_TOOLS})
    tool_call_id: str | None = Field(None, description="tool messages: the call this answers")

    _tool_call_count = _at_most("tool_calls", MAX_TOOLS, "tool calls")

    @field_validator("tool_calls")
    @classmethod
    def _calls_are_the_assistants(cls, value: list[ToolCall] | None, info: ValidationInfo):
        if value and info.data.get("role") != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return value

    @model_validator(mode="after")
    def _what_each_role_needs(self) -> ChatMessage:
        """OpenAI's rule: only an assistant's turn may leave out content,
        and then it makes tool calls. (A tool message without its
        tool_call_id stays accepted, as vLLM accepts it: nothing here needs
        the id.)"""
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            needs = "content or tool_calls" if self.role == "assistant" else "content"
            article = "an" if self.role == "assistant" else "a"
            raise ValueError(f"{article} {self.role} message needs {needs}")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingRequest):
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        **_SamplingRequest.UNSUPPORTED, "functions": (None, []), "function_call": (None, "none", "auto"),
        "audio": (None,)}

    messages: _list_of(ChatMessage) = Field(min_length=1, description=f"at most {MAX_MESSAGES}",
                                            json_schema_extra={"maxItems": MAX_MESSAGES})
    max_completion_tokens: int | None = Field(None, ge=1, description="preferred over max_tokens")
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormatParam | None = None
    tools: _list_of(Tool) | None = Field(None, description=f"at most {MAX_TOOLS}",
                                         json_schema_extra={"maxItems": MAX_TOOLS})
    tool_choice: ToolChoice | None = Field(None, description='default "auto" with tools, else "none"')

    _message_count = _at_most("messages", MAX_MESSAGES, "messages")
    _tool_count = _at_most("tools", MAX_TOOLS, "tools")

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: int | None, info: ValidationInfo):
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs to be true")
        return value

    def output_limit(self) -> tuple[int | None, str]:
        """(max tokens to generate or None, the field it came from)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_SamplingRequest):
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        **_SamplingRequest.UNSUPPORTED, "echo": (None, False), "suffix": (None, "")}

    # Token ids first: the long list is matched by the first branch tried.
    prompt: str | _list_of(int) | _list_of(str) | _list_of(_list_of(int)) = Field(
        description="a string, a list of one string, token ids, or a list of one token-id list",
        json_schema_extra={"anyOf": [_TEXT, _list(_TEXT, max_items=1), _list(_TOKEN_ID),
                                     _list(_list(_TOKEN_ID), max_items=1)]})
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, prompt: object) -> object:
        if isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], (str, list)):
            raise ValueError("only one prompt per request is supported")
        return prompt

    def output_limit(self) -> tuple[int | None, str]:
        return self.max_tokens, "max_tokens"

    def engine_logprobs(self) -> int | None:
        return self.logprobs


# ---- responses ----------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


FinishReason = Literal["stop", "length", "abort", "tool_calls"]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: FinishReason | None
    logprobs: ChatLogprobs | None = None


class _Response(BaseModel):
    """What every response and chunk starts with; `model` is what the request asked for."""

    id: str
    created: int
    model: str


class ChatCompletion(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    finish_reason: FinishReason | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: FinishReason | None = None
    logprobs: CompletionLogprobs | None = None


class Completion(_Response):
    """A text completion, and also each streamed chunk of one (OpenAI uses
    the same object for both; chunks carry `usage: null`)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    parent: str | None = Field(None, description="the base model an adapter applies to")
    root: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str


class ErrorResponse(BaseModel):
    error: ErrorDetail
