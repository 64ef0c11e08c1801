"""One choice's streamed deltas when the request has tools, in OpenAI's
tool-call delta shape (`delta.tool_calls[{index, id, type, function}]`).

A named tool_choice streams the arguments as they are generated, after a
first delta that carries the call's id and name. Under "required" the
output is held until it finishes and the call goes out in one delta;
under "auto" it is held only while it may still become a `<tool_call>`
block: text that cannot (it does not start with "<") streams as content.
Held logprobs go out with the text they belong to.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.outputs import CompletionOutput, TokenLogprob
from gateway.schemas.openai import ChatDelta
from gateway.schemas.structured import FunctionCall, FunctionCallDelta, ToolCallDelta
from gateway.tools import ToolMode, ToolReader, new_call_id


@dataclass
class StreamPiece:
    delta: ChatDelta
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None


@dataclass
class ToolCallStream:
    reader: ToolReader
    text: str = ""  # all of this choice's output so far
    call_id: str = field(default_factory=new_call_id)
    _plain: bool = False  # known to be content: stream as it comes
    _opened: bool = False  # a named call's first delta went out
    _held: list[TokenLogprob] | None = None
    _held_text: str = ""

    def feed(self, c: CompletionOutput) -> StreamPiece | None:
        """The delta to send for this engine delta; None while holding."""
        self.text += c.text
        finish = c.finish_reason
        call = self.reader.call_in(self.text, finish) if finish is not None else None
        finish = "tool_calls" if call is not None else finish
        if self.reader.mode is ToolMode.NAMED:
            return StreamPiece(ChatDelta(tool_calls=[self._arguments_delta(c.text)]), c.logprobs, finish)
        if self._plain:
            return StreamPiece(ChatDelta(content=c.text), c.logprobs, finish)
        self._hold(c)
        if call is not None:
            return self._release(ChatDelta(tool_calls=[self._whole_call(call)]), finish)
        if finish is not None or not self.reader.may_be_call(self.text):
            self._plain = True
            return self._release(ChatDelta(content=self._held_text), finish)
        return None

    def _hold(self, c: CompletionOutput) -> None:
        self._held_text += c.text
        if c.logprobs is not None:
            self._held = (self._held or []) + list(c.logprobs)

    def _release(self, delta: ChatDelta, finish: str | None) -> StreamPiece:
        piece = StreamPiece(delta, self._held, finish)
        self._held, self._held_text = None, ""
        return piece

    def _arguments_delta(self, text: str) -> ToolCallDelta:
        if not self._opened:
            self._opened = True
            return ToolCallDelta(index=0, id=self.call_id, type="function",
                                 function=FunctionCallDelta(name=self.reader.function, arguments=text))
        return ToolCallDelta(index=0, function=FunctionCallDelta(arguments=text))

    def _whole_call(self, call: FunctionCall) -> ToolCallDelta:
        return ToolCallDelta(index=0, id=self.call_id, type="function",
                             function=FunctionCallDelta(name=call.name, arguments=call.arguments))
