"""The whole engine on a CUDA GPU: greedy output equals HF transformers and
peft, through the Triton attention, SGMV, norm, rotary and SiLU kernels.

CI has no GPU, so this module skips there. `benchmarks/gpu_check.sh` runs it
on one, beside the kernel tests (tests/engine/attention/test_backends.py and
tests/adapters/ops/test_sgmv.py pick CUDA when they find it); the section
"On a GPU" of docs/benchmarks.md says when it last ran and what it gave.

The references run on the CPU in float32, so the GPU is checked against
code that shares none of its kernels.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention.triton_backend import TritonAttentionBackend
from tests.adapters.conftest import build_peft_adapter, peft_greedy
from tests.adapters.test_lora_exactness import ADAPTERS, PROMPTS
from tests.engine.test_exactness import GREEDY, hf_greedy, make_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    prompts = make_prompts()
    return tiny_llama_dir, prompts, hf_greedy(tiny_llama_dir, prompts)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _cuda_llm(model_dir, **knobs) -> LLM:
    llm = LLM(str(model_dir), device="cuda", dtype="float32", **knobs)
    runner = llm.engine.core.runner
    # "auto" must have picked the GPU kernels, or this proves nothing about them.
    assert isinstance(runner.attn_backend, TritonAttentionBackend), type(runner.attn_backend)
    assert next(runner.model.parameters()).is_cuda
    layer = runner.model.layers[0]
    assert layer.mlp.gpu_elementwise and layer.self_attn.gpu_elementwise and layer.input_layernorm.gpu_kernel
    return llm


@pytest.mark.parametrize("knobs", [
    {},
    {"max_num_batched_tokens": 37},  # chunked prefill across many steps
    {"num_kv_blocks": 40, "enable_prefix_caching": False},  # preemption by recompute
], ids=["batched", "chunked", "preempted"])
def test_greedy_matches_hf(reference, knobs):
    model_dir, prompts, expected = reference
    llm = _cuda_llm(model_dir, **knobs)
    assert _tokens(llm.generate(prompts, GREEDY)) == expected
    if "num_kv_blocks" in knobs:
        assert sum(llm.engine.scheduler.num_preemptions.values()) > 0


def test_prefix_cache_hits_keep_the_output(reference):
    model_dir, prompts, expected = reference
    llm = _cuda_llm(model_dir)
    llm.generate(prompts, GREEDY)
    second = llm.generate(prompts, GREEDY)
    assert _tokens(second) == expected
    assert any(o.num_cached_tokens >= 16 for o in second)


def test_bfloat16_stays_close_to_float32(reference):
    """bfloat16, the GPU's default, is not exact: its greedy tokens agree
    with float32 HF on most positions, and the figure is printed for the
    record (docs/benchmarks.md)."""
    model_dir, prompts, expected = reference
    llm = LLM(str(model_dir), device="cuda", dtype="bfloat16")
    got = _tokens(llm.generate(prompts, GREEDY))
    # Tokens up to each output's first divergence, over all tokens.
    prefix = sum(next((i for i, (a, b) in enumerate(zip(g, e)) if a != b), len(e)) for g, e in zip(got, expected))
    share = prefix / sum(len(e) for e in expected)
    print(f"bfloat16 on CUDA: {share:.1%} of float32 HF's greedy tokens before the first divergence")
    assert share >= 0.5


def test_lora_mixed_batch_matches_peft(tiny_llama_dir, tmp_path):
    dirs = {}
    for i, (name, kwargs) in enumerate(ADAPTERS.items()):
        dirs[name] = tmp_path / name
        build_peft_adapter(tiny_llama_dir, dirs[name], seed=i, **kwargs)
    requests = [(p, a) for p in PROMPTS for a in [*ADAPTERS, None]]
    new_tokens = 12
    expected = peft_greedy(tiny_llama_dir, dirs, requests, new_tokens)

    # Two slots for three adapters: the stacks churn on the GPU mid-run.
    llm = _cuda_llm(tiny_llama_dir, data_dir=str(tmp_path / "registry"), max_loras=2, max_lora_rank=16)
    ops = llm.engine.core.runner.lora.ops
    assert type(ops).__name__ == "TritonLoraOps", type(ops)
    for name, path in dirs.items():
        llm.adapters.import_dir(name, path)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens)
    outs = llm.generate([p for p, _ in requests], params, adapters=[a for _, a in requests])
    for (prompt, adapter), got, want in zip(requests, _tokens(outs), expected):
        assert got == want, f"{adapter or 'base'} on {prompt!r}"
    assert llm.engine.lora_slots.num_evictions > 0
