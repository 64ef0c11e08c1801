"""The incremental detokenizer against full decodes of real tokenizers, all
built offline: a tiny byte-level BPE (GPT-2 / SmolLM2 style) and a tiny
SentencePiece-style BPE with byte fallback (Llama style, whose decoder strips
the first token's leading space), both trained here in well under a second,
and the SmolLM2 tokenizer when its converted checkpoint is in the cache."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams

CORPUS = [
    "The naïve café serves crème brûlée and jalapeño.",
    "日本語のテキストです。東京は大きい。",
    "Hello 🙂 world 🙂🙂! Emoji 👩‍💻 and flags 🇫🇷.",
    "Stop here.\n\nNext paragraph, with numbers 12345 and symbols <>&.",
    "Ελληνικά και русский текст, ça va?",
]
SAMPLE_TEXTS = ["naïve café 日本語 🙂", "Hello 🙂 world. Stop here.\n\nNext", "ça 👩‍💻 東京!!",
                "Spaces before , and ! do n't go ."]
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def train_byte_level_bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420, special_tokens=["<|endoftext|>", "<|im_start|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def train_sentencepiece_style_bpe():
    """Metaspace pre-tokenizer, <0xNN> byte-fallback tokens for characters
    outside the vocabulary, and Llama's decoder chain."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    metaspace = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.pre_tokenizer = metaspace
    base.train_from_iterator(CORPUS * 10, trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, limit_alphabet=40, show_progress=False))
    trained = json.loads(base.to_str())["model"]
    vocab = {t: i for i, t in enumerate(specials + [f"<0x{b:02X}>" for b in range(256)])}
    for token in sorted(trained["vocab"], key=trained["vocab"].get):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = metaspace
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def cached_smollm2_dir() -> Path | None:
    """The converted SmolLM2 checkpoint, if the model loader already made one."""
    root = os.environ.get("LORAGW_CACHE_DIR")
    if root is None:
        import platformdirs

        root = platformdirs.user_cache_dir("loragw")
    found = sorted(Path(root).expanduser().glob("models/SmolLM2*/tokenizer.json"))
    return found[-1].parent if found else None


@pytest.fixture(scope="module", params=["byte_level", "sentencepiece", "smollm2"])
def tokenizer(request):
    if request.param == "byte_level":
        return train_byte_level_bpe()
    if request.param == "sentencepiece":
        return train_sentencepiece_style_bpe()
    model_dir = cached_smollm2_dir()
    if model_dir is None:
        pytest.skip("no converted SmolLM2 checkpoint in the loragw cache")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def decode(tokenizer, ids: list[int], skip_special_tokens: bool = True) -> str:
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                            clean_up_tokenization_spaces=False)


def full_decode_is_prefix_stable(tokenizer, full_text: str) -> bool:
    """False where the full decode is no reference: byte-fallback decoders
    turn a run of <0xNN> tokens that is not valid UTF-8 into one U+FFFD per
    byte, complete characters in the run included, so a stream (which emits
    those characters as they complete) cannot be a prefix of it."""
    return "\ufffd" not in full_text or "<0x00>" not in tokenizer.get_vocab()


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def stream(tokenizer, ids: list[int], chunks: list[int] | None = None, **params):
    """Feed ids in chunks of the given sizes (default one by one); returns the
    detokenizer and the new_text of every append."""
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(**params))
    pieces, at, sizes = [], 0, iter(chunks or [])
    while at < len(ids) and not detok.finished:
        size = max(1, next(sizes, 1))
        pieces.append(detok.append(ids[at:at + size]))
        at += size
    return detok, pieces


def reference_stop(text: str, stops: list[str]) -> tuple[str, str | None]:
    """Naive: the stop string that completes first (the longest on a tie)."""
    for end in range(1, len(text) + 1):
        for stop in sorted(stops, key=len, reverse=True):
            if text[:end].endswith(stop):
                return text[:end - len(stop)], stop
    return text, None


@SETTINGS
@given(data=st.data())
def test_stream_equals_full_decode_for_any_ids(tokenizer, data):
    vocab = len(tokenizer)
    ids = data.draw(st.lists(st.integers(0, vocab - 1), max_size=40))
    chunks = data.draw(st.lists(st.integers(1, 4), max_size=40))
    skip = data.draw(st.booleans())
    detok, pieces = stream(tokenizer, ids, chunks, skip_special_tokens=skip)
    full = decode(tokenizer, ids, skip)
    # Incomplete characters are held back, never streamed as U+FFFD.
    assert not detok.output_text.endswith("\ufffd")
    assert all(p.stop_matched is None for p in pieces)
    detok.finish()
    assert detok.output_text == detok.text
    if full_decode_is_prefix_stable(tokenizer, full):
        assert detok.output_text == full


def test_every_prefix_matches_the_full_decode(tokenizer):
    ids = encode(tokenizer, " ".join(SAMPLE_TEXTS))
    for k in range(len(ids) + 1):
        detok, pieces = stream(tokenizer, ids[:k])
        streamed = "".join(p.new_text for p in pieces)
        assert streamed == detok.output_text
        full = decode(tokenizer, ids[:k])
        if full_decode_is_prefix_stable(tokenizer, full):
            assert full.startswith(streamed)
            assert streamed + detok.finish() == full
    assert detok.text == " ".join(SAMPLE_TEXTS)


@SETTINGS
@given(text=st.text(max_size=60), chunks=st.lists(st.integers(1, 3), max_size=60))
def test_valid_text_never_streams_a_replacement_char(tokenizer, text, chunks):
    ids = encode(tokenizer, text)
    full = decode(tokenizer, ids, False)
    detok, pieces = stream(tokenizer, ids, chunks, skip_special_tokens=False)
    if "\ufffd" not in full:  # SmolLM2 lacks a few byte tokens (e.g. for U+40000)
        assert all("\ufffd" not in p.new_text for p in pieces)
    assert detok.output_text + detok.finish() == full


def test_multibyte_characters_split_across_tokens(tokenizer):
    text = "naïve café 日本語 🙂👩‍💻"
    ids = encode(tokenizer, text)
    alone = [decode(tokenizer, [i]) for i in ids]
    assert any("\ufffd" in a for a in alone)  # the test really splits characters
    detok, pieces = stream(tokenizer, ids)
    assert all("\ufffd" not in p.new_text for p in pieces)
    assert detok.output_text == text
    assert detok.finish() == ""


def test_decode_windows_stay_short(tokenizer):
    calls: list[int] = []

    class Counting:
        def decode(self, ids, **kw):
            calls.append(len(ids))
            return tokenizer.decode(ids, **kw)

    ids = encode(tokenizer, " ".join(SAMPLE_TEXTS * 30))
    detok, _ = stream(Counting(), ids)
    assert detok.output_text + detok.finish() == decode(tokenizer, ids)
    assert len(ids) > 300 and max(calls) <= 8  # O(window) per token, not O(length)


@pytest.mark.parametrize("stops, expected, matched", [
    (["\n\n"], "Hello 🙂 world. Stop here.", "\n\n"),
    (["Stop"], "Hello 🙂 world. ", "Stop"),
    (["lo 🙂 wo"], "Hel", "lo 🙂 wo"),  # straddles several tokens, multi-byte inside
    (["Hello"], "", "Hello"),  # at the very start
    (["H"], "", "H"),
    (["Next", "here"], "Hello 🙂 world. Stop ", "here"),
    (["ld. Stop here", "world"], "Hello 🙂 ", "world"),  # completes first
    (["world. Stop", "d. S"], "Hello 🙂 worl", "d. S"),  # completes first, starts later
    (["o 🙂 world", "lo 🙂 world"], "Hel", "lo 🙂 world"),  # same end: the longest
    (["absent", "Next!"], "Hello 🙂 world. Stop here.\n\nNext", None),
])
def test_stop_strings_cut_the_text(tokenizer, stops, expected, matched):
    text = "Hello 🙂 world. Stop here.\n\nNext"
    ids = encode(tokenizer, text)
    for chunks in ([1] * len(ids), [3] * len(ids), [len(ids)]):
        detok, pieces = stream(tokenizer, ids, chunks, stop=stops)
        streamed = "".join(p.new_text for p in pieces)
        assert [p.stop_matched for p in pieces if p.stop_matched] == ([matched] if matched else [])
        assert detok.stop_matched == matched
        if matched:
            assert streamed == detok.text == expected
            assert detok.finish() == ""
            assert detok.append(encode(tokenizer, "more")).new_text == ""
        else:
            assert streamed + detok.finish() == expected
        assert detok.output_text == expected


@pytest.mark.parametrize("stops, streamed_before_finish", [
    (["xyz"], "Hello world "),
    (["d xy!", "xyz"], "Hello worl"),  # the longest suffix that may start a stop
    (["Hello world xy!"], ""),
    (["abc"], "Hello world xy"),
])
def test_held_back_text_is_flushed_by_finish(tokenizer, stops, streamed_before_finish):
    text = "Hello world xy"
    detok, pieces = stream(tokenizer, encode(tokenizer, text), stop=stops)
    assert "".join(p.new_text for p in pieces) == streamed_before_finish
    assert detok.text == text
    assert detok.finish() == text[len(streamed_before_finish):]
    assert detok.output_text == text and detok.stop_matched is None
    assert detok.finish() == ""


@SETTINGS
@given(data=st.data())
def test_stop_strings_against_a_naive_reference(tokenizer, data):
    text = data.draw(st.sampled_from(SAMPLE_TEXTS + CORPUS))
    text = text[:data.draw(st.integers(1, len(text)))]
    stops = data.draw(st.lists(
        st.one_of(st.builds(lambda a, n: text[a:a + n], st.integers(0, len(text) - 1), st.integers(1, 6)),
                  st.text(alphabet="aeo 🙂日.\n", min_size=1, max_size=3)),
        min_size=1, max_size=3))
    ids = encode(tokenizer, text)
    chunks = data.draw(st.lists(st.integers(1, 4), max_size=len(ids)))
    detok, pieces = stream(tokenizer, ids, chunks, stop=stops)
    expected, matched = reference_stop(decode(tokenizer, ids), stops)
    assert detok.stop_matched == matched
    for i in range(len(pieces)):
        seen = "".join(p.new_text for p in pieces[:i + 1])
        assert expected.startswith(seen)  # never streams text past a stop
    assert detok.output_text + detok.finish() == expected


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tokenizer, skip):
    eos = tokenizer.eos_token_id
    ids = encode(tokenizer, "Hi") + [eos] + encode(tokenizer, " there 🙂") + [eos]
    detok, pieces = stream(tokenizer, ids, skip_special_tokens=skip)
    streamed = "".join(p.new_text for p in pieces) + detok.finish()
    expected = decode(tokenizer, ids, skip)
    assert streamed == expected
    assert (tokenizer.eos_token in streamed) is not skip
