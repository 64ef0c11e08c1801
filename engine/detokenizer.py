"""Incremental detokenization with stop strings, for one sequence.

Decoding: the prefix-offset / read-offset technique (HF TGI, vLLM). Each
`append` decodes only a small window, the tokens from `prefix_offset` on,
and emits what that window adds beyond the already-emitted tokens
`[prefix_offset, read_offset)`. Keeping those tokens in front as context
keeps tokenizers whose decoder strips the first token's leading space
(SentencePiece) right. While the window ends in U+FFFD (a multi-byte
character split across tokens) nothing is emitted and the offsets stay, so
the character comes out whole once its last byte arrives. The cost per token
is O(window), independent of the sequence's length.

The output equals `tokenizer.decode(all_ids)` once finished, with two known
differences: no prompt context, so a SentencePiece model's first output
token loses its leading space (as in decode(output_ids)); and with byte-
fallback tokenizers, a run of <0xNN> tokens that is not valid UTF-8 decodes
in full as one U+FFFD per byte, complete characters in the run included,
while the stream keeps the characters it already emitted.

Stop strings: the decoded text is searched for every stop string; on a
match the text is cut before it and nothing past it is ever emitted. Text
that could still be the start of a stop string (the longest suffix that is
a proper prefix of one) is held back from `new_text` until later text rules
it out, or until `finish()` flushes it. A stop string may straddle any
number of tokens.

Decoding uses `clean_up_tokenization_spaces=False` (the cleanup is not
prefix-stable) and the request's `skip_special_tokens`. No torch here.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, Sequence

from engine.sampling_params import SamplingParams

_REPLACEMENT = "\ufffd"


class Tokenizer(Protocol):
    """What the detokenizer needs of a HF tokenizer."""

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = ...,
               clean_up_tokenization_spaces: bool = ...) -> str: ...


class DetokenizerResult(NamedTuple):
    # Text to send to the client now (possibly empty).
    new_text: str
    # The stop string that ended the sequence in this call, else None.
    stop_matched: str | None


class IncrementalDetokenizer:
    """Text of one sequence's output tokens, streamed as they arrive."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams):
        self._tokenizer = tokenizer
        self._skip_special_tokens = params.skip_special_tokens
        self._stops = list(params.stop)
        self._token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._emitted: list[str] = []
        # Decoded text held back because it may start a stop string.
        self._pending = ""
        self.stop_matched: str | None = None
        self._done = False

    @property
    def output_text(self) -> str:
        """What append() and finish() have returned so far."""
        return "".join(self._emitted)

    @property
    def text(self) -> str:
        """All text decoded so far, cut before a matched stop string: the
        output text plus what is held back. The output's final text once
        finished."""
        return self.output_text + self._pending

    @property
    def has_stop_strings(self) -> bool:
        return bool(self._stops)

    @property
    def finished(self) -> bool:
        """A stop string matched, or finish() was called."""
        return self._done

    def append(self, new_token_ids: Sequence[int]) -> DetokenizerResult:
        """Add generated tokens; return the text now safe to stream and the
        stop string, if one matched. Appending once finished is a no-op."""
        if self._done:
            return DetokenizerResult("", None)
        self._token_ids.extend(new_token_ids)
        return self._emit(self._decode_window(final=False), final=False)

    def finish(self) -> str:
        """End the sequence (EOS, length, abort): flush the held-back text and
        any trailing incomplete character, decoded as the full text would be."""
        if self._done:
            return ""
        result = self._emit(self._decode_window(final=True), final=True)
        self._done = True
        return result.new_text

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens,
                                      clean_up_tokenization_spaces=False)

    def _decode_window(self, final: bool) -> str:
        """The new stable text of the window, advancing the offsets. With
        final=True a trailing incomplete character is let out as U+FFFD."""
        ids = self._token_ids
        prefix_text = self._decode(ids[self._prefix_offset:self._read_offset])
        window_text = self._decode(ids[self._prefix_offset:])
        if len(window_text) <= len(prefix_text):
            return ""
        if window_text.endswith(_REPLACEMENT) and not final:
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        return window_text[len(prefix_text):]

    def _emit(self, chunk: str, final: bool) -> DetokenizerResult:
        text = self._pending + chunk
        match = self._first_stop(text)
        if match is not None:
            start, stop = match
            out, self._pending = text[:start], ""
            self.stop_matched, self._done = stop, True
        else:
            stop = None
            hold = 0 if final else self._stop_prefix_len(text)
            out, self._pending = text[:len(text) - hold], text[len(text) - hold:]
        if out:
            self._emitted.append(out)
        return DetokenizerResult(out, stop)

    def _first_stop(self, text: str) -> tuple[int, str] | None:
        """(start, stop) of the stop string that completes first in `text`;
        among those ending at the same place, the longest. `text` is the held
        back text (which holds no complete stop) plus the new chunk."""
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            start = text.find(stop)
            if start < 0:
                continue
            end = start + len(stop)
            if best is None or (end, start) < (best[0], best[1]):
                best = (end, start, stop)
        return None if best is None else (best[1], best[2])

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that a stop string starts with."""
        hold = 0
        for stop in self._stops:
            q = text.find(stop[0], max(0, len(text) - len(stop) + 1))
            while q != -1 and len(text) - q > hold:
                if stop.startswith(text[q:]):
                    hold = len(text) - q
                    break
                q = text.find(stop[0], q + 1)
        return hold
