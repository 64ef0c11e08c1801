"""Engine outputs in OpenAI's shapes: whole responses, streamed chunks,
usage and logprobs, for chat and text completions alike.

`ResponseFormat` holds what every piece of one response shares (its id,
model, creation time, and how to spell a token), so the route and the
streaming loop build their bodies with one call each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from gateway.schemas.structured import ToolCall
from gateway.tool_stream import ToolCallStream
from gateway.tools import ToolReader, new_call_id
from gateway.schemas.openai import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    ChatTokenLogprob,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    PromptTokensDetails,
    TopLogprob,
    Usage,
)

# JSON has no -inf; OpenAI clients expect a finite float.
_MIN_LOGPROB = -9999.0


def usage_of(out: RequestOutput) -> Usage:
    prompt = len(out.prompt_token_ids)
    completion = out.num_output_tokens  # cumulative even in a delta
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=out.num_cached_tokens))


@dataclass
class ResponseFormat:
    """One response's identity and its token spelling. `chat` picks
    chat.completion(.chunk) over text_completion."""

    id: str
    model: str
    created: int
    chat: bool
    decode: Callable[[list[int]], str]
    tools: ToolReader | None = None  # reads tool calls out of chat outputs
    _spelled: dict[int, str] = field(default_factory=dict)
    _tool_streams: dict[int, ToolCallStream] = field(default_factory=dict)  # by choice index

    # ---- whole responses ----

    def response(self, out: RequestOutput) -> dict:
        usage = usage_of(out)
        if self.chat:
            choices = [self._chat_choice(c) for c in out.outputs]
            body = ChatCompletion(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)
        else:
            choices = [CompletionChoice(index=c.index, text=c.text, finish_reason=c.finish_reason,
                                        logprobs=self._completion_logprobs(c.logprobs, 0))
                       for c in out.outputs]
            body = Completion(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)
        return body.model_dump(mode="json")

    def _chat_choice(self, c: CompletionOutput) -> ChatChoice:
        call = self.tools.call_in(c.text, c.finish_reason) if self.tools is not None else None
        finish = "tool_calls" if call is not None else c.finish_reason
        if call is None and self.tools is not None:
            call = self.tools.cut_call(c.text, c.finish_reason)
        if call is None:
            message = AssistantMessage(content=c.text)
        else:
            message = AssistantMessage(content=None, tool_calls=[ToolCall(id=new_call_id(), function=call)])
        return ChatChoice(index=c.index, message=message, finish_reason=finish,
                          logprobs=self._chat_logprobs(c.logprobs))

    # ---- streamed chunks ----

    def role_chunk(self, n: int) -> dict | None:
        """Chat streams open with the assistant role for every choice."""
        if not self.chat:
            return None
        return self._chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))
                            for i in range(n)])

    def delta_chunk(self, c: CompletionOutput, text_offset: int) -> dict | None:
        """The chunk for one choice's delta (engine/outputs.py), or None while
        a possible tool call is held back (gateway/tool_stream.py), and for a
        delta that carries nothing: text held while a stop string may still
        match it (vLLM sends no such chunk either; a client counting chunks
        as tokens would count them). `text_offset` is how much of this
        choice's text earlier chunks carried (for completion logprobs)."""
        if not c.text and c.finish_reason is None and not c.logprobs:
            return None
        if self.chat and self.tools is not None:
            stream = self._tool_streams.setdefault(c.index, ToolCallStream(self.tools))
            piece = stream.feed(c)
            if piece is None:
                return None
            choice = ChatChunkChoice(index=c.index, delta=piece.delta, finish_reason=piece.finish_reason,
                                     logprobs=self._chat_logprobs(piece.logprobs))
        elif self.chat:
            choice = ChatChunkChoice(index=c.index, delta=ChatDelta(content=c.text),
                                     finish_reason=c.finish_reason, logprobs=self._chat_logprobs(c.logprobs))
        else:
            choice = CompletionChoice(index=c.index, text=c.text, finish_reason=c.finish_reason,
                                      logprobs=self._completion_logprobs(c.logprobs, text_offset))
        return self._chunk([choice])

    def usage_chunk(self, out: RequestOutput) -> dict:
        return self._chunk([], usage=usage_of(out))

    def _chunk(self, choices: list, usage: Usage | None = None) -> dict:
        cls = ChatCompletionChunk if self.chat else Completion
        return cls(id=self.id, created=self.created, model=self.model, choices=choices,
                   usage=usage).model_dump(mode="json")

    # ---- logprobs ----

    def spell(self, token_id: int) -> str:
        text = self._spelled.get(token_id)
        if text is None:
            text = self._spelled[token_id] = self.decode([token_id])
        return text

    def _chat_logprobs(self, logprobs: list[TokenLogprob] | None) -> ChatLogprobs | None:
        if logprobs is None:
            return None
        content = []
        for lp in logprobs:
            token = self.spell(lp.token_id)
            top = [TopLogprob(token=(t := self.spell(tid)), logprob=_finite(v), bytes=list(t.encode()))
                   for tid, v in lp.top_logprobs]
            content.append(ChatTokenLogprob(token=token, logprob=_finite(lp.logprob), bytes=list(token.encode()),
                                            top_logprobs=top))
        return ChatLogprobs(content=content)

    def _completion_logprobs(self, logprobs: list[TokenLogprob] | None, offset: int) -> CompletionLogprobs | None:
        if logprobs is None:
            return None
        out = CompletionLogprobs()
        for lp in logprobs:
            token = self.spell(lp.token_id)
            out.tokens.append(token)
            out.token_logprobs.append(_finite(lp.logprob))
            # OpenAI's legacy completions: the N most likely and always the
            # sampled token, so up to N + 1 entries (vLLM's shape too). Keyed
            # by text, so a sampled token that decodes like one of the N
            # (byte pieces of a character all read "\ufffd") shares its entry.
            top = {self.spell(tid): _finite(v) for tid, v in lp.top_logprobs}
            top.setdefault(token, _finite(lp.logprob))
            out.top_logprobs.append(top)
            out.text_offset.append(offset)
            offset += len(token)
        return out


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _MIN_LOGPROB
