"""Tool calls: what the model is told, what its output may be, and how the
output is read back into OpenAI's `tool_calls`.

`tool_choice` picks the constraint on the output:
  "required"  a JSON object {"name": <a tool's name>, "arguments": <its
              parameters>}: anyOf over the tools, the name a const, first;
  named       the arguments of that function only (its parameters schema);
  "auto"      free text that does not start with "<", or exactly one
              `<tool_call>{"name": ..., "arguments": ...}</tool_call>`;
  "none"      nothing, and the tools are not shown to the model.

The tools reach the model through its chat template when the template
renders a `tools` list; otherwise (SmolLM2's template does not) they are
written into the system turn in the `<tool_call>` format that "auto" reads,
see `tools_system_text`. JSON output is compact (engine/structured/grammar.py).
"""

from __future__ import annotations

import enum
import json
import uuid
from dataclasses import dataclass

from engine.structured.spec import StructuredSpec
from engine.chat_template import ChatFeatures
from gateway.errors import InvalidRequest
from gateway.json_body import has_lone_surrogate, load_json
from gateway.schemas.openai import ChatMessage
from gateway.schemas.structured import FunctionCall, NamedToolChoice, Tool, ToolCall

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
# The inline JSON of an "auto" grammar is compact, as every JSON constraint is.
_COMPACT = {"whitespace_flexible": False}


class ToolMode(enum.Enum):
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def compact_json(value: object) -> str:
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    if has_lone_surrogate(text):  # a `\ud800` the grammar let through: kept escaped, as the model wrote it
        return json.dumps(value, ensure_ascii=True, separators=(",", ":"))
    return text


@dataclass(frozen=True)
class ToolReader:
    """How a choice's output text becomes a tool call. `function` names the
    function of a named tool_choice."""

    mode: ToolMode
    function: str | None = None

    def parse(self, text: str) -> FunctionCall | None:
        """The call the whole output makes, or None when it is not one (plain
        text under "auto", or output cut short by max_tokens or a stop string)."""
        if self.mode is ToolMode.NAMED:
            return FunctionCall(name=self.function, arguments=text) if isinstance(_loads(text), dict) else None
        if self.mode is ToolMode.AUTO:
            if not (text.startswith(TOOL_CALL_OPEN) and text.endswith(TOOL_CALL_CLOSE)):
                return None
            text = text[len(TOOL_CALL_OPEN):-len(TOOL_CALL_CLOSE)]
        call = _loads(text)
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)
                and isinstance(call.get("arguments"), dict)):
            return None
        return FunctionCall(name=call["name"], arguments=compact_json(call["arguments"]))

    def call_in(self, text: str, finish_reason: str | None) -> FunctionCall | None:
        """The call a finished output makes: only one the engine ended on
        its own ("stop"). One cut short is content, as OpenAI has it, except
        a named call (`cut_call`)."""
        return self.parse(text) if finish_reason == "stop" else None

    def cut_call(self, text: str, finish_reason: str | None) -> FunctionCall | None:
        """A named call that `call_in` does not take (cut by max_tokens or a
        stop string): its arguments so far, still a call of that function.
        Its stream sent them as the call's deltas, and OpenAI and vLLM
        return a named call so; under "required" and "auto" the name may be
        cut too, so such an output is content."""
        if self.mode is ToolMode.NAMED and finish_reason is not None:
            return FunctionCall(name=self.function, arguments=text)
        return None

    def may_be_call(self, prefix: str) -> bool:
        """Whether an output that starts with `prefix` may still be a call:
        under "auto" a streamed text that cannot be one is sent as it comes."""
        if self.mode is not ToolMode.AUTO:
            return True
        return prefix.startswith(TOOL_CALL_OPEN) or TOOL_CALL_OPEN.startswith(prefix)


def _loads(text: str) -> object:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _arguments(text: str) -> object:
    """A call's arguments as a value when they are a JSON object (what
    templates and the `<tool_call>` text want), else as the text sent. They
    come from a request, so load_json's rules apply: a lone surrogate or a
    nesting too deep leaves them as text."""
    try:
        value = load_json(text)
    except InvalidRequest:
        return text
    return value if isinstance(value, dict) else text


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools change: the output constraint, how to read
    the output, and how the tools reach the prompt."""

    spec: StructuredSpec
    reader: ToolReader
    tools: list[Tool]

    def template_tools(self) -> list[dict]:
        """The tools as HF chat templates take them."""
        return [tool.model_dump(mode="json", exclude_none=True) for tool in self.tools]


def plan_tools(tools: list[Tool], choice: str | NamedToolChoice) -> ToolPlan | None:
    """None for tool_choice "none". A named function must be among `tools`
    (the caller checked)."""
    if choice == "none":
        return None
    if isinstance(choice, NamedToolChoice):
        index, tool = next((i, t) for i, t in enumerate(tools) if t.function.name == choice.function.name)
        spec = StructuredSpec.json_schema(tool.function.parameters_schema(),
                                          param=f"tools[{index}].function.parameters")
        return ToolPlan(spec, ToolReader(ToolMode.NAMED, tool.function.name), tools)
    call_schema = _call_schema(tools)
    if choice == "required":
        return ToolPlan(StructuredSpec.json_schema(call_schema, param="tools"), ToolReader(ToolMode.REQUIRED), tools)
    inline = {**call_schema, "x-guidance": _COMPACT}
    grammar = (f"start: text | call\n"
               f"text: /[^<][\\s\\S]*/ | \"\"\n"
               f"call: {compact_json(TOOL_CALL_OPEN)} %json {compact_json(inline)} "
               f"{compact_json(TOOL_CALL_CLOSE)}\n")
    return ToolPlan(StructuredSpec.grammar(grammar, param="tools"), ToolReader(ToolMode.AUTO), tools)


def _call_schema(tools: list[Tool]) -> dict:
    calls = [{"type": "object",
              "properties": {"name": {"const": t.function.name}, "arguments": t.function.parameters_schema()},
              "required": ["name", "arguments"], "additionalProperties": False}
             for t in tools]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def tools_system_text(tools: list[Tool]) -> str:
    """The tools, described in the system turn for a template that does not
    render them: one compact JSON line per function."""
    lines = [compact_json(t.function.model_dump(mode="json", exclude_none=True, exclude={"strict"}))
             for t in tools]
    return ("# Tools\n\nYou may call one of these functions. To call one, reply with nothing but\n"
            f'{TOOL_CALL_OPEN}{{"name": <function name>, "arguments": <its arguments as a JSON object>}}'
            f"{TOOL_CALL_CLOSE}\n\nFunctions:\n" + "\n".join(lines))


def call_text(call: ToolCall) -> str:
    """An earlier call of the history, as the model would have written it."""
    body = {"name": call.function.name, "arguments": _arguments(call.function.arguments)}
    return f"{TOOL_CALL_OPEN}{compact_json(body)}{TOOL_CALL_CLOSE}"


def chat_messages(messages: list[ChatMessage], features: ChatFeatures, plan: ToolPlan | None) -> list[dict]:
    """The request's messages as the chat template takes them, with the
    tools in the system turn when the template does not render them.

    Calls and results of the history: a template that renders tools gets
    them in HF's shape (`tool_calls`, role "tool" with `tool_call_id`).
    Otherwise an assistant's calls become their `<tool_call>` text, and a
    result is a "tool" turn if the template renders that role (SmolLM2's
    renders any role), else a user turn that names the call it answers."""
    out: list[dict] = []
    names: dict[str, str] = {}  # call id -> function name, for the results that follow
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        text = m.text()
        if m.tool_calls:
            names.update((c.id, c.function.name) for c in m.tool_calls)
            if features.tools:
                calls = [{"id": c.id, "type": "function",
                          "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                         for c in m.tool_calls]
                out.append({"role": role, "content": text, "tool_calls": calls})
                continue
            text += "".join(call_text(c) for c in m.tool_calls)
        if role == "tool" and features.tools:
            name = names.get(m.tool_call_id or "", m.name or "")
            out.append({"role": role, "content": text, "tool_call_id": m.tool_call_id or "", "name": name})
            continue
        if role == "tool" and not features.tool_role:
            name = names.get(m.tool_call_id or "", m.name or "a tool")
            role, text = "user", f"[result of {name}, call {m.tool_call_id or '?'}]\n{text}"
        out.append({"role": role, "content": text})
    if plan is not None and not features.tools:
        tools_text = tools_system_text(plan.tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{tools_text}"}
        else:
            out.insert(0, {"role": "system", "content": tools_text})
    return out
