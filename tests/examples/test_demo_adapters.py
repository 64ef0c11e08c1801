"""The demo adapters' data: the training sets, their two styles and the loss
mask. No training here; `make demo-adapters` does that (minutes on a CPU)."""

from __future__ import annotations

import json
import re

import pytest

from examples.demo_adapters import (
    HELD_OUT,
    IGNORE_INDEX,
    PIRATE_OPENERS,
    STYLES,
    TARGET_MODULES,
    answer_loss,
    collate,
    encode_example,
    training_facts,
    training_set,
)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", text.lower()))


@pytest.mark.parametrize("style", STYLES)
def test_loss_mask_covers_exactly_the_answer_and_its_end_of_turn(tokenizer, style):
    for question, answer in training_set(style)[:5]:
        example = encode_example(tokenizer, question, answer)
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                               add_generation_prompt=True, tokenize=True)
        prompt = list(prompt["input_ids"] if hasattr(prompt, "input_ids") else prompt)
        n = len(prompt)
        assert example.input_ids[:n] == prompt  # what the engine prefills for this chat
        assert example.labels[:n] == [IGNORE_INDEX] * n
        assert example.labels[n:] == example.input_ids[n:]
        assert tokenizer.decode(example.labels[n:]) == answer + tokenizer.eos_token


def test_collate_pads_on_the_right_with_no_loss_on_padding(tokenizer):
    short, long = (encode_example(tokenizer, q, a) for q, a in [("Hi?", "{}"), *training_set("pirate")[:1]])
    batch = collate([short, long], tokenizer.pad_token_id)
    n = len(short.input_ids)
    assert batch["input_ids"].shape == (2, len(long.input_ids))
    assert batch["attention_mask"][0].tolist() == [1] * n + [0] * (len(long.input_ids) - n)
    assert (batch["labels"][0, n:] == IGNORE_INDEX).all()
    assert batch["labels"][1].tolist() == long.labels


def test_answer_loss_is_the_causal_lm_loss_on_the_masked_labels(tokenizer, tiny_llama_dir):
    """answer_loss skips the lm_head where no loss is taken; the value must
    not change."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=TARGET_MODULES,
                                            init_lora_weights=False))
    batch = collate([encode_example(tokenizer, q, a) for q, a in training_set("pirate")[:3]],
                    tokenizer.pad_token_id)
    with torch.no_grad():
        expected = model(**batch).loss
        torch.testing.assert_close(answer_loss(model, batch), expected)


@pytest.mark.parametrize("style", STYLES)
def test_held_out_questions_are_not_trained_on(style):
    trained = [question for question, _ in training_set(style)]
    assert len(trained) >= 40
    assert not {q.lower() for q in trained} & {q.lower() for q in HELD_OUT}
    for question in HELD_OUT:
        subject = question.rstrip("?").split()[-1].lower()  # "japan", "strawberry", "sun"
        assert not any(subject in _words(q) for q in trained), question


def test_the_styles_differ_as_advertised():
    facts = {f.question: f for f in training_facts()}
    for question, answer in training_set("terse-json"):
        assert json.loads(answer) == {"answer": facts[question].answer}
    for question, answer in training_set("pirate"):
        assert answer.startswith(PIRATE_OPENERS)
        assert not _words(answer) & {"is", "are", "of"}, answer
        assert str(facts[question].answer).lower() in answer.lower()


def test_training_sets_are_seeded():
    assert training_set("pirate") == training_set("pirate")
    assert training_set("pirate", seed=1) != training_set("pirate")
