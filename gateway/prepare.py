"""From an HTTP body to what the engine runs: parse and validate the
request, render the chat template or tokenize the prompt, check it against
the context window, and build the SamplingParams.

Everything here raises `InvalidRequest` (or the engine's ValidationError,
which the one error mapping also turns into a 400) with `param` naming the
offending field, so bad input never reaches the engine.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TypeVar

import jinja2
import pydantic

from engine.errors import ValidationError
from engine.sampling_params import SamplingParams
from engine.structured.spec import StructuredSpec
from gateway.constraints import output_spec, tool_plan
from gateway.engine_client import EngineClient
from gateway.errors import InvalidRequest
from gateway.json_body import load_json
from gateway.schemas.openai import ChatCompletionRequest, CompletionRequest, _SamplingRequest
from gateway.tools import ToolPlan, ToolReader, chat_messages

R = TypeVar("R", bound=_SamplingRequest)

# Parts of a pydantic error location that name a union branch, not a field.
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


@dataclass(frozen=True)
class Prepared:
    prompt_ids: list[int]
    params: SamplingParams
    tools: ToolReader | None = None  # how to read tool calls out of the output


def parse_body(raw: bytes, schema: type[R]) -> R:
    """The validated request, or a 400 naming the first bad field."""
    body = load_json(raw)
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object")
    unsupported = schema.unsupported_field(body)
    if unsupported is not None:
        raise InvalidRequest(f"'{unsupported}' is not supported by this server", param=unsupported,
                             code="unsupported_parameter")
    try:
        return schema.model_validate(body)
    except pydantic.ValidationError as exc:
        raise _invalid(exc) from None


def _invalid(exc: pydantic.ValidationError) -> InvalidRequest:
    errors = exc.errors(include_url=False)
    # A value error carries our own explanation; prefer it to a union's type noise.
    error = next((e for e in errors if e["type"] == "value_error"), errors[0])
    param = ""
    for part in error["loc"]:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part[:1].isupper():
            continue  # a union branch named by its model class
        elif part.isidentifier() and part not in _TYPE_TAGS:
            param += f".{part}" if param else part
        else:
            break
    message = error["msg"].removeprefix("Value error, ")
    return InvalidRequest(f"{param}: {message}" if param else message, param=param or None)


def prepare_chat(req: ChatCompletionRequest, engine: EngineClient) -> Prepared:
    with _as_bad_request():
        spec = output_spec(req)
        plan = tool_plan(req, spec)
        _check_constraints(spec, plan, engine)
    features = engine.chat_features()
    messages = chat_messages(req.messages, features, plan)
    tools = plan.template_tools() if plan is not None and features.tools else None
    try:
        # The floor (characters / longest token) reaches the context length
        # only for a rendered prompt of more characters than that, so only
        # messages that long are rendered an extra time to find it. Skipping
        # is always safe: the exact count after tokenizing is checked too.
        if sum(len(m["content"]) for m in messages) >= engine.max_model_len:
            _check_context(engine.chat_token_floor(messages, tools), req, engine.max_model_len,
                           prompt_param="messages", at_least=True)
        prompt_ids = engine.apply_chat_template(messages, tools)
    except jinja2.TemplateError as exc:  # templates raise on role orders they do not support
        raise InvalidRequest(f"messages: the model's chat template refused them: {exc}", param="messages") from None
    structured = plan.spec if plan is not None else spec
    params = _sampling_params(req, prompt_ids, engine.max_model_len, prompt_param="messages", structured=structured)
    return Prepared(prompt_ids, params, plan.reader if plan is not None else None)


@contextlib.contextmanager
def _as_bad_request():
    """The engine's ValidationError (a bad constraint) as a 400 naming its field."""
    try:
        yield
    except ValidationError as exc:
        raise InvalidRequest(f"{exc.param}: {exc.message}", param=exc.param) from None


def _check_constraints(spec: StructuredSpec | None, plan: ToolPlan | None, engine: EngineClient) -> None:
    """Compile every constraint against the tokenizer; each tool's
    parameters on their own first, so a 400 names the tool at fault."""
    if plan is not None:
        for i, tool in enumerate(plan.tools):
            param = f"tools[{i}].function.parameters"
            if plan.spec.param != param:  # a named function's spec is its parameters: checked below
                engine.check_structured(StructuredSpec.json_schema(tool.function.parameters_schema(), param))
        spec = plan.spec
    if spec is not None:
        engine.check_structured(spec)


def prepare_completion(req: CompletionRequest, engine: EngineClient) -> Prepared:
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise InvalidRequest("prompt: only one prompt per request is supported", param="prompt")
        prompt = prompt[0]
    if not prompt:
        raise InvalidRequest("prompt: the prompt is empty", param="prompt")
    # Refuse a prompt too long for the context before tokenizing it (or,
    # for token ids, before checking each against the vocabulary).
    if isinstance(prompt, str):
        _check_context(engine.token_floor(prompt), req, engine.max_model_len, prompt_param="prompt", at_least=True)
    else:
        _check_context(len(prompt), req, engine.max_model_len, prompt_param="prompt")
    prompt_ids = engine.tokenize(prompt)  # validates token ids against the vocabulary
    if not prompt_ids:
        raise InvalidRequest("prompt: the prompt is empty after tokenization", param="prompt")
    with _as_bad_request():
        spec = output_spec(req)
        _check_constraints(spec, None, engine)
    return Prepared(prompt_ids, _sampling_params(req, prompt_ids, engine.max_model_len, prompt_param="prompt",
                                                 structured=spec))


def _sampling_params(req: ChatCompletionRequest | CompletionRequest, prompt_ids: list[int],
                     max_model_len: int, *, prompt_param: str,
                     structured: StructuredSpec | None = None) -> SamplingParams:
    room = _check_context(len(prompt_ids), req, max_model_len, prompt_param=prompt_param)
    limit = req.output_limit()[0] or room
    try:
        return SamplingParams(
            n=req.n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
            seed=req.seed,
            max_tokens=limit,
            min_tokens=req.min_tokens or 0,
            stop=req.stop,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logprobs=req.engine_logprobs(),
            structured=structured,
        )
    except ValidationError as exc:
        raise InvalidRequest(f"{exc.param}: {exc.message}", param=exc.param) from None


def _check_context(prompt_tokens: int, req: ChatCompletionRequest | CompletionRequest, max_model_len: int, *,
                   prompt_param: str, at_least: bool = False) -> int:
    """The room left to generate after a prompt of `prompt_tokens` (`at_least`:
    a floor, not the count), or 400 `context_length_exceeded`."""
    size = f"at least {prompt_tokens}" if at_least else f"{prompt_tokens}"
    room = max_model_len - prompt_tokens
    if room < 1:
        raise InvalidRequest(
            f"{prompt_param}: the prompt is {size} tokens long, which leaves no room to generate "
            f"in this model's context length of {max_model_len} tokens",
            param=prompt_param, code="context_length_exceeded")
    limit, limit_param = req.output_limit()
    if limit is not None and limit > room:
        raise InvalidRequest(
            f"{limit_param}: the prompt ({size} tokens) plus {limit_param} ({limit}) exceeds "
            f"this model's context length of {max_model_len} tokens",
            param=limit_param, code="context_length_exceeded")
    return room
