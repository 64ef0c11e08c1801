"""Greedy output with LoRA adapters equals HF transformers + peft.

One mixed batch holds requests for every adapter plus base-model requests;
each request's tokens must equal `PeftModel.generate` for that request on its
own. Float32, on the tiny random Llama and on the real SmolLM2. The
adapters differ in rank, use rsLoRA and rank/alpha patterns, and target
different modules; with max_loras=2 the slots churn mid-run. The CPU runs
both LoRA backends: the C++ kernel and its torch twin.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.adapters.conftest import ALL_MODULES, build_peft_adapter, peft_greedy

NEW_TOKENS = 12
ADAPTERS = {
    "plain-r8": dict(r=8, lora_alpha=16, target_modules=ALL_MODULES),
    "rslora-r4": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"]),
    "pattern-r16": dict(r=16, lora_alpha=32, target_modules=ALL_MODULES,
                        rank_pattern={"k_proj": 4, "up_proj": 2}, alpha_pattern={"o_proj": 3}),
}
PROMPTS = ["The quick brown fox jumps over the lazy dog and", "Write a haiku about rivers:",
           "Paged attention stores keys and values in fixed-size blocks, so"]


@pytest.fixture(scope="module", params=["tiny", pytest.param("smollm", marks=pytest.mark.smollm)])
def setup(request, tmp_path_factory):
    model_dir = request.getfixturevalue("tiny_llama_dir" if request.param == "tiny" else "smollm_dir")
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    dirs = {}
    for i, (name, kwargs) in enumerate(ADAPTERS.items()):
        dirs[name] = root / name
        # Small B on the real model keeps its outputs near-natural (decisive logits).
        model = build_peft_adapter(model_dir, dirs[name], seed=i, **kwargs)
        if request.param == "smollm":
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if "lora_B" in n:
                        p.mul_(0.25)
            model.save_pretrained(dirs[name])
    requests = [(p, a) for p in PROMPTS for a in [*ADAPTERS, None]]
    return model_dir, root, dirs, requests, peft_greedy(model_dir, dirs, requests, NEW_TOKENS)


# "cpu" is the C++ kernel (the CPU default), "torch" its twin.
@pytest.mark.parametrize("max_loras,backend", [(4, "cpu"), (2, "cpu"), (4, "torch")])
def test_mixed_batch_matches_peft(setup, max_loras, backend):
    model_dir, root, dirs, requests, expected = setup
    llm = LLM(str(model_dir), data_dir=str(root / f"registry-{max_loras}-{backend}"), max_loras=max_loras,
              max_lora_rank=16, lora_backend=backend)
    for name, path in dirs.items():
        llm.adapters.import_dir(name, path)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    outs = llm.generate([p for p, _ in requests], params, adapters=[a for _, a in requests])
    got = [o.outputs[0].token_ids for o in outs]
    for (prompt, adapter), g, e in zip(requests, got, expected):
        assert g == e, f"{adapter or 'base'} on {prompt!r}"
    # Every adapter really changes the output somewhere (else this proves nothing).
    base = {p: g for (p, a), g in zip(requests, got) if a is None}
    for name in ADAPTERS:
        assert any(g != base[p] for (p, a), g in zip(requests, got) if a == name), name
    slots = llm.engine.lora_slots
    # The kernel's stacks are rank-major, the twin's are not: each backend got its own layout.
    b_stack = next(iter(slots.stacks.values())).lora_b[0]
    assert b_stack.is_contiguous() == (backend == "torch")
    if max_loras == 2:
        assert slots.num_evictions > 0
