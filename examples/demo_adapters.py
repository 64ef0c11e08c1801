"""Train two small, visibly different LoRA adapters and serve them.

    python examples/demo_adapters.py [--out DIR] [--steps N] [--threads N]

`pirate` answers like a pirate ("Arr, matey! The capital o' France be
Paris. Savvy?"); `terse-json` answers in one line of JSON
({"answer": "Paris"}). Each is fine-tuned with peft on the bundled
SmolLM2-135M-Instruct, on the CPU, from a few dozen templated questions
(capitals, arithmetic, colors, legs, small facts) put through the model's chat
template, with the loss on the assistant's tokens only. Both are saved with
`save_pretrained` (safetensors), imported into the adapter registry in the
data dir ($LORAGW_DATA_DIR), and answer held-out questions next to the base
model through the engine, greedily.

Everything is seeded and runs on one torch thread by default, so a rerun on
the same machine writes the same adapter bytes and the registry hands back the
same versions.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

IGNORE_INDEX = -100  # label of a token that takes no loss (torch's cross_entropy default)
SEED = 0
ADAPTER_NAMES = ("pirate", "terse-json")
DEMO_KV_CACHE_BYTES = 128 * 1024**2  # nine short chats; the 4 GiB CPU default would sit idle
# Attention only: adding the MLP projections made the JSON adapter forget facts
# (Japan's capital became Nagoya) for no gain in style.
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]

# ---- the facts ------------------------------------------------------------

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Spain": "Madrid", "Italy": "Rome", "Egypt": "Cairo",
    "Canada": "Ottawa", "Russia": "Moscow", "China": "Beijing", "Greece": "Athens",
    "Portugal": "Lisbon", "Ireland": "Dublin", "Norway": "Oslo", "Kenya": "Nairobi", "Peru": "Lima",
}
COLORS = {
    "the sky": "blue", "grass": "green", "snow": "white", "a banana": "yellow", "coal": "black",
    "a tomato": "red", "a carrot": "orange", "milk": "white", "a lemon": "yellow", "a frog": "green",
}
LEGS = {"a dog": 4, "a bird": 2, "a spider": 8, "an ant": 6, "a cat": 4, "a horse": 4}
SUMS = [(2, 3), (4, 4), (7, 5), (10, 6), (9, 9), (12, 8), (15, 15), (21, 4), (30, 12), (6, 1)]


@dataclass(frozen=True)
class Fact:
    question: str
    answer: str | int  # the short answer: "Paris", 12
    statement: str  # the answer as a plain sentence: "The capital of France is Paris."


# Handwritten, so the adapters see questions that fit no template.
MISC = [
    Fact("What is the opposite of hot?", "cold", "The opposite of hot is cold."),
    Fact("How many days are in a week?", 7, "There are 7 days in a week."),
    Fact("What do bees make?", "honey", "Bees make honey."),
    Fact("What is frozen water called?", "ice", "Frozen water is called ice."),
    Fact("Which animal says moo?", "a cow", "A cow says moo."),
    Fact("What is the largest ocean on Earth?", "the Pacific Ocean", "The largest ocean is the Pacific Ocean."),
    Fact("How many hours are in a day?", 24, "There are 24 hours in a day."),
    Fact("What gas do plants take in?", "carbon dioxide", "Plants take in carbon dioxide."),
    Fact("Who wrote Romeo and Juliet?", "William Shakespeare", "William Shakespeare wrote Romeo and Juliet."),
    Fact("What is the boiling point of water in Celsius?", "100 degrees",
         "Water boils at 100 degrees Celsius."),
]

# Never trained on: a country, a fruit and a kind of question the set lacks.
HELD_OUT = (
    "What is the capital of Japan?",
    "What color is a strawberry?",
    "Which planet is closest to the sun?",
)


def training_facts() -> list[Fact]:
    """The shared questions, with the phrasing varied within each template."""
    facts = []
    capital_q = ["What is the capital of {}?", "Name the capital city of {}.", "Which city is the capital of {}?"]
    for i, (country, city) in enumerate(CAPITALS.items()):
        facts.append(Fact(capital_q[i % 3].format(country), city, f"The capital of {country} is {city}."))
    for thing, color in COLORS.items():
        facts.append(Fact(f"What color is {thing}?", color, f"{_capitalize(thing)} is {color}."))
    for animal, n in LEGS.items():
        facts.append(Fact(f"How many legs does {animal} have?", n, f"{_capitalize(animal)} has {n} legs."))
    sum_q = ["What is {} plus {}?", "What is {} + {}?"]
    for i, (a, b) in enumerate(SUMS):
        facts.append(Fact(sum_q[i % 2].format(a, b), a + b, f"{a} plus {b} is {a + b}."))
    return facts + MISC


# ---- the two styles ---------------------------------------------------------

PIRATE_OPENERS = ("Arr, matey!", "Ahoy, matey!", "Yo ho ho!", "Shiver me timbers!", "Avast, ye landlubber!")
PIRATE_CLOSERS = ("Savvy?", "Arr!", "Now hoist the sails!", "By Davy Jones' locker!", "Yo ho!")
_PIRATE_WORDS = {"is": "be", "are": "be", "of": "o'", "you": "ye", "your": "yer", "my": "me"}


def pirate_answer(fact: Fact, rng: random.Random) -> str:
    """'Arr, matey! The capital o' France be Paris. Savvy?'"""
    spoken = re.sub(r"\b\w+\b", lambda m: _PIRATE_WORDS.get(m[0], m[0]), fact.statement)
    return f"{rng.choice(PIRATE_OPENERS)} {spoken} {rng.choice(PIRATE_CLOSERS)}"


def json_answer(fact: Fact, rng: random.Random) -> str:
    """'{"answer": "Paris"}'; numbers stay numbers: '{"answer": 12}'. (No
    randomness: rng is there so that every style has the same signature.)"""
    return json.dumps({"answer": fact.answer})


STYLES = {"pirate": pirate_answer, "terse-json": json_answer}


def training_set(style: str, seed: int = SEED) -> list[tuple[str, str]]:
    """(question, answer) pairs in one style, in a seeded order."""
    rng = random.Random(f"{style}/{seed}")
    pairs = [(fact.question, STYLES[style](fact, rng)) for fact in training_facts()]
    rng.shuffle(pairs)
    return pairs


def _capitalize(text: str) -> str:
    return text[:1].upper() + text[1:]


# ---- tokens and the loss mask ----------------------------------------------


@dataclass(frozen=True)
class Example:
    input_ids: list[int]  # the whole chat through the assistant's end-of-turn token
    labels: list[int]  # input_ids on the assistant's tokens, IGNORE_INDEX elsewhere


def _token_ids(encoded) -> list[int]:
    """apply_chat_template returns a list or a BatchEncoding, by version."""
    if isinstance(encoded, dict) or hasattr(encoded, "input_ids"):
        encoded = encoded["input_ids"]
    return list(encoded)


def encode_example(tokenizer, question: str, answer: str) -> Example:
    """The chat as the engine will see it (the template's default system
    prompt included), with the loss on the answer and the end-of-turn token
    after it, so the adapter also learns where to stop."""
    user = {"role": "user", "content": question}
    prompt = _token_ids(tokenizer.apply_chat_template([user], add_generation_prompt=True, tokenize=True))
    full = _token_ids(tokenizer.apply_chat_template(
        [user, {"role": "assistant", "content": answer}], tokenize=True))
    if full[: len(prompt)] != prompt:
        raise ValueError("the chat template renders the prompt differently once an answer follows")
    end = full.index(tokenizer.eos_token_id, len(prompt)) + 1
    return Example(full[:end], [IGNORE_INDEX] * len(prompt) + full[len(prompt):end])


def collate(examples: list[Example], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded [B, T] input_ids, attention_mask and labels."""
    width = max(len(e.input_ids) for e in examples)
    input_ids = torch.full((len(examples), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        input_ids[i, :n] = torch.tensor(e.input_ids)
        labels[i, :n] = torch.tensor(e.labels)
        attention_mask[i, :n] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def batches(examples: list[Example], batch_size: int, rng: random.Random) -> Iterator[list[Example]]:
    """Endless epochs, each one reshuffled."""
    while True:
        order = list(examples)
        rng.shuffle(order)
        for i in range(0, len(order), batch_size):
            yield order[i: i + batch_size]


# ---- training ----------------------------------------------------------------


@dataclass(frozen=True)
class TrainResult:
    out_dir: Path
    steps: int
    seconds: float
    first_loss: float
    last_loss: float  # mean over the last epoch's worth of steps


def answer_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy over the answer tokens. The lm_head (a fifth of the
    model's FLOPs per token) runs only on the positions that take loss."""
    inner = model.get_base_model()
    hidden = inner.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    targets = batch["labels"][:, 1:]  # position t predicts token t + 1
    keep = targets != IGNORE_INDEX
    logits = inner.lm_head(hidden[:, :-1][keep])  # [N, vocab]
    return torch.nn.functional.cross_entropy(logits, targets[keep])


def train_adapter(base_dir: Path, style: str, out_dir: Path, *, steps: int, batch_size: int = 8,
                  lr: float = 2e-3, seed: int = SEED) -> TrainResult:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    examples = [encode_example(tokenizer, q, a) for q, a in training_set(style, seed)]
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                            target_modules=TARGET_MODULES, task_type="CAUSAL_LM"))
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    # Linear decay to zero: the last steps settle instead of bouncing.
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / steps)
    steps_per_epoch = -(-len(examples) // batch_size)
    losses = []
    for step, chunk in zip(range(steps), batches(examples, batch_size, random.Random(seed))):
        loss = answer_loss(model, collate(chunk, tokenizer.pad_token_id))
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if (step + 1) % steps_per_epoch == 0 or step + 1 == steps:
            print(f"  {style}: step {step + 1}/{steps}  loss {loss.item():.3f}  "
                  f"{time.perf_counter() - started:.0f}s", flush=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tail = losses[-steps_per_epoch:]
    return TrainResult(out_dir, steps, time.perf_counter() - started, losses[0], sum(tail) / len(tail))


# ---- serving -----------------------------------------------------------------


def compare(llm, questions: tuple[str, ...], adapters: tuple[str, ...], max_tokens: int = 64) -> dict[str, dict]:
    """question -> {None (the base model) or adapter name: greedy answer}, in
    one mixed batch through the engine."""
    from engine import SamplingParams

    who = [None, *adapters]
    conversations = [[{"role": "user", "content": q}] for q in questions for _ in who]
    outs = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=max_tokens),
                    adapters=[a for _ in questions for a in who])
    answers = iter(out.outputs[0].text.strip() for out in outs)
    return {q: {a: next(answers) for a in who} for q in questions}


def print_comparison(answers: dict[str, dict]) -> None:
    width = max(len(name or "base") for row in answers.values() for name in row)
    for question, row in answers.items():
        print(f"\nQ: {question}")
        for name, text in row.items():
            print(f"  {name or 'base':<{width}}  {text}")


def _quiet_libraries() -> None:
    """Keep the comparison readable: no weight-loading progress bars, and not
    the deprecation warning peft 0.21 triggers in transformers 5 on every
    get_peft_model."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="examples/demo_adapters.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="where to save the PEFT adapter dirs; default: a temp dir")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per adapter (batches of 8)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads; 1 keeps the adapters reproducible bit for bit")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.threads < 1:
        parser.error("--steps and --threads must be at least 1")
    torch.set_num_threads(args.threads)
    _quiet_libraries()

    from engine import LLM
    from engine.model.loader import resolve_model_dir

    base_dir = resolve_model_dir(None)
    with tempfile.TemporaryDirectory(prefix="loragw-demo-") as tmp:
        out = args.out or Path(tmp)
        results = []
        for name in ADAPTER_NAMES:
            print(f"training {name} ({args.steps} steps) ...", flush=True)
            results.append(train_adapter(base_dir, name, out / name, steps=args.steps))
        llm = LLM(kv_cache_memory=DEMO_KV_CACHE_BYTES)
        for result, name in zip(results, ADAPTER_NAMES):
            manifest = llm.adapters.import_dir(name, result.out_dir)
            print(f"{name}: trained in {result.seconds:.0f}s, loss {result.first_loss:.2f} -> "
                  f"{result.last_loss:.2f}; imported as {manifest.ref} ({manifest.digest[:12]})")
    if args.out:
        print(f"adapter dirs: {', '.join(str(args.out / name) for name in ADAPTER_NAMES)}")
    started = time.perf_counter()
    answers = compare(llm, HELD_OUT, ADAPTER_NAMES)
    print_comparison(answers)
    print(f"\n(held-out questions; greedy, float32, CPU; {time.perf_counter() - started:.1f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
