"""The token floor (engine/token_floor.py): ceil(characters / L) never
exceeds the real token count, checked against the real SmolLM2 tokenizer on
text built to pack the most characters into the fewest tokens; and no bound
at all for tokenizers that may drop or merge characters."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from engine.token_floor import max_chars_per_token


@pytest.fixture(scope="module")
def smollm_tokenizer(smollm_dir):
    return AutoTokenizer.from_pretrained(smollm_dir)


def floor(text: str, per_token: int) -> int:
    return -(-len(text) // per_token)


def test_no_token_decodes_to_more_characters_than_the_bound(smollm_tokenizer):
    per_token = max_chars_per_token(smollm_tokenizer)
    assert per_token is not None
    longest = max(len(smollm_tokenizer.decode([i])) for i in range(len(smollm_tokenizer)))
    assert longest <= per_token


def test_the_floor_never_exceeds_the_real_count(smollm_tokenizer):
    per_token = max_chars_per_token(smollm_tokenizer)
    vocab = smollm_tokenizer.get_vocab()
    longest_ids = sorted(vocab.values(), key=lambda i: -len(smollm_tokenizer.decode([i])))[:50]
    rng = random.Random(0)
    texts = [smollm_tokenizer.decode(longest_ids * 20), smollm_tokenizer.decode([longest_ids[0]] * 300),
             "\n" + " " * 5000, "#" * 10_000, "=" * 10_000, "<|im_start|>" * 500, "🙂" * 1000,
             "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(5000)),
             "".join(rng.choice("ab \n") for _ in range(5000)), "The quick brown fox. " * 300]
    for text in texts:
        count = len(smollm_tokenizer(text).input_ids)
        assert floor(text, per_token) <= count, (text[:40], count)
        rendered = smollm_tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                        add_generation_prompt=True)
        assert floor(rendered, per_token) <= len(smollm_tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)["input_ids"])


def _tokenizer(pre_tokenizer=None, normalizer=None, **bpe) -> PreTrainedTokenizerFast:
    vocab = {"a": 0, "b": 1, "ab": 2, " ": 3, "[UNK]": 4}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")], **{"unk_token": "[UNK]", **bpe}))
    if pre_tokenizer is not None:
        tok.pre_tokenizer = pre_tokenizer
    if normalizer is not None:
        tok.normalizer = normalizer
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_a_tokenizer_that_keeps_every_character_has_a_bound():
    assert max_chars_per_token(_tokenizer()) == len("[UNK]")
    # Llama 2's SentencePiece pipeline, as Hugging Face converts it.
    metaspace = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    assert max_chars_per_token(_tokenizer(normalizer=metaspace, byte_fallback=True)) == len("[UNK]")
    assert max_chars_per_token(_tokenizer(pre_tokenizers.ByteLevel(), unk_token=None)) is not None


@pytest.mark.parametrize("make", [
    lambda: _tokenizer(pre_tokenizers.Whitespace()),  # drops whitespace
    lambda: _tokenizer(pre_tokenizers.Split(" ", behavior="removed")),
    lambda: _tokenizer(normalizer=normalizers.NFC()),  # composes two code points into one
    lambda: _tokenizer(normalizer=normalizers.Strip()),
    lambda: _tokenizer(normalizer=normalizers.Replace("ab", "")),
    lambda: _tokenizer(unk_token=None),  # characters without an entry vanish
    lambda: _tokenizer(fuse_unk=True),  # a run of unknown characters is one token
])
def test_no_bound_for_a_tokenizer_that_may_drop_or_merge_characters(make):
    assert max_chars_per_token(make()) is None


def test_no_bound_when_a_special_token_strips_whitespace():
    from tokenizers import AddedToken

    tok = _tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [AddedToken("<s>", rstrip=True)]})
    assert max_chars_per_token(tok) is None
