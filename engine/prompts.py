"""Prompts to token ids, and token ids back to text: the tokenizer's side of
serving, which needs the tokenizer but not the weights.

The gateway holds one (it tokenizes and templates every request, so a worker
receives only token ids); the offline engine holds one too.
"""

from __future__ import annotations

import threading
from pathlib import Path

from engine.chat_template import ChatFeatures, ChatTokenizer
from engine.errors import ValidationError
from engine.token_floor import max_chars_per_token


class PromptEncoder:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self._chat: ChatTokenizer | None = None  # built on first use
        self._ll_tokenizer = None  # llguidance's view of the tokenizer, built with the first structured request
        self._ll_lock = threading.Lock()
        self._max_chars_per_token = max_chars_per_token(tokenizer)

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> PromptEncoder:
        from engine.model.loader import load_tokenizer

        return cls(load_tokenizer(model_dir))

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a text prompt; a token-id prompt comes back checked
        against the vocabulary."""
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt).input_ids)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValidationError("prompt", "token-id prompts must be lists of integers")
        if any(t < 0 or t >= self.vocab_size for t in prompt):
            raise ValidationError("prompt", f"token ids must be in [0, {self.vocab_size})")
        return list(prompt)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Prompt ids of a chat; text typed in a message never becomes a
        control token (engine/chat_template.py). `tools` go to a template
        that takes them (see `chat_features`)."""
        return self._chat_tokenizer().encode(messages, tools)

    def chat_features(self) -> ChatFeatures:
        """What the model's chat template can render besides plain turns."""
        return self._chat_tokenizer().features

    def _chat_tokenizer(self) -> ChatTokenizer:
        if self._chat is None:
            self._chat = ChatTokenizer(self.tokenizer)
        return self._chat

    def check_structured(self, spec) -> None:
        """Raise ValidationError naming `spec.param` unless the spec compiles
        and yields a first token mask and its forced tokens within
        llguidance's fuel. Thread-safe; the llguidance tokenizer (about half
        a second) is built once."""
        from engine.structured.grammar import check_spec, llguidance_limits, to_llguidance
        from llguidance import LLMatcher
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

        ll_tokenizer = self._llguidance_tokenizer()
        check_spec(spec, ll_tokenizer)
        # Compiling is lazy: a grammar too complex for its fuel shows only
        # when a mask is computed or a token consumed. The engine would then
        # allow nothing but EOS and end the output there; a 400 says why
        # instead. The forced tokens are where that shows first (`a{1000000}`
        # forces 62,501 tokens of "aaaa" and its lexer gives up on them; a
        # required property whose schema is its object's forces `{"a":{"a":`
        # ... past the parser's item limit), and consuming them is the work
        # the engine's first tokens would do anyway. A grammar that runs out
        # of fuel only after a choice of the model's still ends at EOS.
        matcher = LLMatcher(ll_tokenizer, to_llguidance(spec), log_level=0, limits=llguidance_limits())
        if not matcher.is_error():
            fill_next_token_bitmask(matcher, allocate_token_bitmask(1, ll_tokenizer.vocab_size), 0)
        if not matcher.is_error():
            forced = matcher.compute_ff_tokens()
            if forced:
                matcher.consume_tokens(forced)
        if matcher.is_error():
            reason = matcher.get_error().strip().splitlines()[0][:300]
            raise ValidationError(spec.param, f"the constraint is too complex to enforce: {reason}")

    def _llguidance_tokenizer(self):
        with self._ll_lock:
            if self._ll_tokenizer is None:
                from engine.structured.grammar import make_tokenizer

                eos = self.tokenizer.eos_token_id
                self._ll_tokenizer = make_tokenizer(self.tokenizer, self.vocab_size,
                                                    frozenset() if eos is None else frozenset({eos}))
            return self._ll_tokenizer

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def token_floor(self, text: str) -> int:
        """The fewest tokens `text` can tokenize to (engine/token_floor.py);
        0 when the tokenizer gives no such bound."""
        per_token = self._max_chars_per_token
        return -(-len(text) // per_token) if per_token else 0

    def chat_token_floor(self, messages: list[dict], tools: list[dict] | None = None) -> int:
        if not self._max_chars_per_token or not getattr(self.tokenizer, "chat_template", None):
            return 0
        # Rendering is string work; tokenizing the result is what costs.
        return self.token_floor(self._chat_tokenizer().render(messages, tools))
