"""The fewest tokens a text can become, known without tokenizing it.

The rule: every token the model emits for a text stands for a piece of that
text (after normalization), at most as long as the longest string in the
vocabulary. So a text of C characters is at least ceil(C / L) tokens, L
being the longest vocabulary entry in characters, special tokens included.
Byte-level BPE (Llama 3, SmolLM2) stores each entry as one character per
byte, so L counts bytes, and a byte is never more than one character; byte
fallback entries (`<0x0A>`) are longer than the one byte they stand for,
which only makes L larger and the bound weaker, never wrong.

The rule needs the text to reach the model whole: a normalizer or
pre-tokenizer that deletes characters (BERT's whitespace split, `strip`) or
merges them (NFC composes two code points into one), or a model that fuses a
run of unknown characters into one token, could turn many characters into
few tokens. For any tokenizer with such a step, or one whose pipeline we
cannot read, there is no bound (None), and the gateway then learns the
prompt's length only by tokenizing it.
"""

from __future__ import annotations

import json

# Pipeline steps that keep every input character (they add, split or
# replace one character by one or more, never fewer).
_KEEPS_CHARACTERS = {"ByteLevel", "Metaspace", "Prepend", "Digits", "Split", "Punctuation", "Sequence"}


def max_chars_per_token(tokenizer) -> int | None:
    """L for a Hugging Face fast tokenizer, or None when no such bound holds."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
    except (ValueError, AttributeError):
        return None
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or not _covers_every_character(model, spec.get("pre_tokenizer")):
        return None
    if not (_keeps_characters(spec.get("normalizer")) and _keeps_characters(spec.get("pre_tokenizer"))):
        return None
    # A special token that strips the whitespace beside it covers any amount of it.
    if any(added.get("lstrip") or added.get("rstrip") for added in spec.get("added_tokens") or []):
        return None
    return max(len(entry) for entry in tokenizer.get_vocab())


def _covers_every_character(model: dict, pre_tokenizer: dict | None) -> bool:
    """Whether every character becomes some token: BPE without an unknown
    token silently drops characters it has no entry for, and with
    `fuse_unk` a run of them is one token."""
    if model.get("byte_fallback") or _has_step(pre_tokenizer, "ByteLevel"):
        return True  # every byte has an entry
    return model.get("unk_token") is not None and not model.get("fuse_unk")


def _has_step(step: dict | None, kind: str) -> bool:
    if step is None:
        return False
    return step.get("type") == kind or any(_has_step(part, kind) for part in step.get("pretokenizers") or [])


def _keeps_characters(step: dict | None) -> bool:
    if step is None:
        return True
    kind = step.get("type")
    if kind == "Replace":
        pattern = step.get("pattern") or {}
        return "String" in pattern and len(step.get("content", "")) >= len(pattern["String"])
    if kind not in _KEEPS_CHARACTERS or step.get("behavior") == "Removed":
        return False
    parts = step.get("normalizers") or step.get("pretokenizers") or []
    return all(_keeps_characters(part) for part in parts)
