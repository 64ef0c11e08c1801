"""Chat messages to prompt token ids, with only the template's own markers
as control tokens.

`tokenizer.apply_chat_template(..., tokenize=True)` renders the messages
into one string and tokenizes it with special-token parsing on, so a user
who types `<|im_end|>\\n<|im_start|>system\\n...` into a message gets a real
system turn: the text is indistinguishable from the template's markers once
rendered. Here the template is rendered a second time with each message's
content replaced by a random placeholder, which tells which characters of
the prompt came from a message. Special tokens found there are tokenized as
the plain text they are.

For content that holds no special-token text the result is exactly what
`apply_chat_template` gives (the common case returns its token ids
unchanged). A template that rewrites content (`| trim`, say) defeats the
placeholders; then forged control tokens are detected by counting, and the
request is refused rather than tokenized unsafely.
"""

from __future__ import annotations

import bisect
import functools
import secrets
from typing import NamedTuple

import jinja2

from engine.errors import ValidationError


class _Rendered(NamedTuple):
    text: str
    # (start, end) character spans of message content in `text`, in order;
    # None when the template rewrote content, so spans are unknown.
    content_spans: list[tuple[int, int]] | None


class ChatFeatures(NamedTuple):
    # The template renders a `tools` list itself (its source mentions them).
    tools: bool
    # A `{"role": "tool"}` message comes out with its content in it.
    tool_role: bool


class ChatTokenizer:
    """Renders and tokenizes chats for one HF fast tokenizer. Thread-safe:
    it never changes the tokenizer's state (HF's `split_special_tokens`
    flips a flag on the shared backend, so a private copy does that job)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._special_ids = frozenset(
            tid for tid, tok in tokenizer.added_tokens_decoder.items() if tok.special)
        self._special_texts = [tok.content for tok in tokenizer.added_tokens_decoder.values() if tok.special]
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise TypeError("the chat template needs a fast (tokenizers-backed) tokenizer")
        # The same vocabulary and pipeline, but special tokens in the input
        # are ordinary text: used for message content only.
        self._plain = type(backend).from_str(backend.to_str())
        self._plain.encode_special_tokens = True

    @functools.cached_property
    def features(self) -> ChatFeatures:
        template = getattr(self.tokenizer, "chat_template", None) or ""
        if not isinstance(template, str):  # a dict of named templates
            template = "".join(template.values())
        probe = f"\ue000{secrets.token_hex(8)}\ue001"
        try:
            tool_role = probe in self._apply([{"role": "user", "content": "?"}, {"role": "tool", "content": probe}])
        except (jinja2.TemplateError, ValueError):
            tool_role = False
        return ChatFeatures(tools="tools" in template, tool_role=tool_role)

    def render(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The prompt text, as `apply_chat_template` renders it."""
        return self._apply(messages, tools)

    def encode(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValidationError("messages", "this model has no chat template")
        if tools and any(t in repr(tools) for t in self._special_texts):
            # Tool definitions are rendered by the template, outside any
            # message, so the placeholders below cannot tell them apart.
            raise ValidationError("tools", "tool definitions may not contain the model's control tokens")
        rendered = self._render(messages, tools)
        enc = self.tokenizer(rendered.text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
        if rendered.content_spans is None:
            return self._refuse_forged(messages, ids, tools)
        if not self._forged(ids, offsets, rendered.content_spans):
            return ids  # what apply_chat_template gives, token for token
        out = self._encode_split(rendered.text, ids, offsets, rendered.content_spans)
        # A special token that began in content and ran into the template's
        # text would have swallowed one of the template's markers.
        if self._count_special(out) != self._count_special(self._encode_template_only(messages, tools)):
            raise ValidationError("messages", "message content may not end in part of a control token")
        return out

    def _render(self, messages: list[dict], tools: list[dict] | None) -> _Rendered:
        text = self._apply(messages, tools)
        nonce = secrets.token_hex(8)
        holders: list[tuple[str, str]] = []
        masked = []
        for i, message in enumerate(messages):
            content = message.get("content")
            if isinstance(content, str) and content:
                # Private-use code points around a secret: no user can type
                # it, and no template has a reason to touch it.
                holder = f"\ue000{nonce}:{i}\ue001"
                holders.append((holder, content))
                message = {**message, "content": holder}
            masked.append(message)
        skeleton = self._apply(masked, tools)
        spans, rebuilt, pos = [], [], 0
        for holder, content in holders:
            at = skeleton.find(holder, pos)
            if at < 0 or skeleton.count(holder) != 1:
                return _Rendered(text, None)  # the template dropped or repeated it
            rebuilt.append(skeleton[pos:at])
            start = sum(len(part) for part in rebuilt)
            rebuilt.append(content)
            spans.append((start, start + len(content)))
            pos = at + len(holder)
        rebuilt.append(skeleton[pos:])
        if "".join(rebuilt) != text:
            return _Rendered(text, None)  # the template rewrote content
        return _Rendered(text, spans)

    def _apply(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)

    def _in_content(self, spans: list[tuple[int, int]]):
        starts = [s for s, _ in spans]

        def inside(offset: int) -> bool:
            k = bisect.bisect_right(starts, offset) - 1
            return k >= 0 and offset < spans[k][1]

        return inside

    def _forged(self, ids: list[int], offsets, spans: list[tuple[int, int]]) -> bool:
        """Whether a special token of `ids` came from inside message content."""
        inside = self._in_content(spans)
        return any(tid in self._special_ids and inside(start) for tid, (start, _) in zip(ids, offsets))

    def _encode_split(self, text: str, ids: list[int], offsets, spans: list[tuple[int, int]]) -> list[int]:
        """Keep the template's special tokens; tokenize the text between them
        with special-token parsing off. HF tokenizers cut the input at every
        special token before anything else, so this is the tokenization the
        prompt would get if the forged markers were not special."""
        inside = self._in_content(spans)
        out: list[int] = []
        pos = 0
        for tid, (start, end) in zip(ids, offsets):
            if tid in self._special_ids and not inside(start):
                if start > pos:
                    out += self._plain.encode(text[pos:start], add_special_tokens=False).ids
                out.append(tid)
                pos = end
        if pos < len(text):
            out += self._plain.encode(text[pos:], add_special_tokens=False).ids
        return out

    def _count_special(self, ids: list[int]) -> int:
        return sum(1 for t in ids if t in self._special_ids)

    def _encode_template_only(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """The chat with every content emptied: the template's markers alone."""
        emptied = [{**m, "content": ""} if isinstance(m.get("content"), str) else m for m in messages]
        return self.tokenizer(self._apply(emptied, tools), add_special_tokens=False)["input_ids"]

    def _refuse_forged(self, messages: list[dict], ids: list[int], tools: list[dict] | None) -> list[int]:
        """Without content spans: the ids if content added no special token."""
        if self._count_special(ids) != self._count_special(self._encode_template_only(messages, tools)):
            raise ValidationError("messages", "message content may not contain the model's control tokens "
                                              "with this chat template")
        return ids
