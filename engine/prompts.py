"""Prompts to token ids, and token ids back to text: the tokenizer's side of
serving, which needs the tokenizer but not the weights.

The gateway holds one (it tokenizes and templates every request, so a worker
receives only token ids); the offline engine holds one too.
"""

from __future__ import annotations

from pathlib import Path

from engine.chat_template import ChatTokenizer
from engine.errors import ValidationError
from engine.token_floor import max_chars_per_token


class PromptEncoder:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self._chat: ChatTokenizer | None = None  # built on first use
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

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Prompt ids of a chat; text typed in a message never becomes a
        control token (engine/chat_template.py)."""
        if self._chat is None:
            self._chat = ChatTokenizer(self.tokenizer)
        return self._chat.encode(messages)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def token_floor(self, text: str) -> int:
        """The fewest tokens `text` can tokenize to (engine/token_floor.py);
        0 when the tokenizer gives no such bound."""
        per_token = self._max_chars_per_token
        return -(-len(text) // per_token) if per_token else 0

    def chat_token_floor(self, messages: list[dict]) -> int:
        if not self._max_chars_per_token or not getattr(self.tokenizer, "chat_template", None):
            return 0
        # Rendering is string work; tokenizing the result is what costs.
        return self.token_floor(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                                   tokenize=False))
