"""A float32 model's float16 KV cache (`kv_cache_dtype`, engine/builder.py).

Which cache `auto` picks where; that float16 holds twice the blocks in a
budget; that every path reads the K/V as the cache holds them, so prefix
caching, chunked prefill and speculation change no output, as they change
none with a float32 cache (the attention kernels themselves are tested
against the float64 reference in tests/engine/attention/); and, on the real
SmolLM2, greedy agreement with a float32 cache at the stated rate.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.builder import AUTO_FLOAT16_CACHE_ENV, resolve_kv_cache_dtype
from engine.config import EngineConfig
from engine.errors import ValidationError
from tests.engine.spec_decode.test_spec_exactness import SPEC, mixed_prompts, with_oracle
from tests.engine.test_exactness import make_prompts
from tests.engine.test_quantization import SMOLLM_PROMPTS

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=24)


@pytest.mark.parametrize("name,dtype,device,backend,expected", [
    ("auto", F32, CPU, "torch", F16),
    ("auto", F32, CPU, "triton", F32),  # the Triton interpreter's kernels read the query's dtype
    ("auto", BF16, CPU, "torch", BF16),
    ("auto", BF16, CUDA, "triton", BF16),
    ("auto", F32, CUDA, "triton", F32),
    ("model", F32, CPU, "torch", F32),
    ("float16", F32, CPU, "torch", F16),
])
def test_auto_is_float16_for_a_float32_model_on_the_cpu(monkeypatch, name, dtype, device, backend, expected):
    monkeypatch.delenv(AUTO_FLOAT16_CACHE_ENV, raising=False)
    assert resolve_kv_cache_dtype(name, dtype, device, backend) == expected


def test_the_switch_keeps_auto_at_the_models_dtype_and_float16_elsewhere_is_refused(monkeypatch):
    monkeypatch.setenv(AUTO_FLOAT16_CACHE_ENV, "0")
    assert resolve_kv_cache_dtype("auto", F32, CPU) == F32
    assert resolve_kv_cache_dtype("float16", F32, CPU) == F16  # asked for by name, it still applies
    for dtype, device, backend in ((BF16, CPU, "torch"), (F32, CUDA, "triton"), (F32, CPU, "triton")):
        with pytest.raises(ValidationError, match="float32 model on the CPU"):
            resolve_kv_cache_dtype("float16", dtype, device, backend)
    with pytest.raises(ValidationError, match="kv_cache_dtype"):
        EngineConfig.from_flat(kv_cache_dtype="fp8")


def test_the_triton_backend_on_the_cpu_keeps_a_float32_cache_by_default(tiny_llama_dir, monkeypatch):
    """Its kernels read the query's dtype: auto must not hand them float16."""
    monkeypatch.delenv(AUTO_FLOAT16_CACHE_ENV, raising=False)
    llm = LLM(str(tiny_llama_dir), dtype="float32", attention_backend="triton", num_kv_blocks=16)
    assert llm.engine.core.runner.kv_caches[0][0].dtype == F32
    with pytest.raises(ValidationError, match="kv_cache_dtype"):
        LLM(str(tiny_llama_dir), dtype="float32", attention_backend="triton", num_kv_blocks=16,
            kv_cache_dtype="float16")


def test_a_float16_cache_holds_twice_the_blocks_of_a_float32_one(tiny_llama_dir):
    budget = 8 * 2**20
    llms = {name: LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory=budget, kv_cache_dtype=name)
            for name in ("model", "float16")}
    caches = {name: llm.engine.core.runner.kv_caches for name, llm in llms.items()}
    assert {k.dtype for k, v in caches["float16"]} == {F16} and {k.dtype for k, v in caches["model"]} == {F32}
    blocks = {name: c[0][0].shape[0] for name, c in caches.items()}
    assert blocks["float16"] == 2 * blocks["model"], blocks


@pytest.fixture(scope="module")
def float16_plain(tiny_llama_dir):
    """Greedy output with a float16 cache, one request at a time through a
    whole-prompt prefill and no prefix cache: what every other path must give."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_dtype="float16", enable_prefix_caching=False,
              speculative="off")
    return [llm.generate(p, GREEDY)[0] for p in make_prompts()[:8]]


def test_batching_chunking_and_prefix_hits_read_the_cache_as_a_lone_request_does(tiny_llama_dir, float16_plain):
    """A prompt attends over its own K/V rounded as the cache holds them, so
    a prefix-cache hit (reading them back) and a chunked prefill (reading
    its earlier chunks) see what the whole prompt's first prefill saw."""
    prompts = make_prompts()[:8]
    want = [o.outputs[0].token_ids for o in float16_plain]
    assert any(len(o.prompt_token_ids) > 32 for o in float16_plain)  # past a 16-token block: prefixes cache
    llm = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_dtype="float16", max_num_batched_tokens=37,
              speculative="off")
    for _ in range(2):  # the second pass hits the prefix cache
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == want
    assert llm.engine.core.scheduler.kv.prefix_hits > 0


def test_speculation_changes_no_output_over_a_float16_cache(tiny_llama_dir):
    """Verification rows go through the decode kernel (or SDPA) over the
    rounded cache as plain decode rows do."""
    plain = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_dtype="float16", speculative="off").generate(
        mixed_prompts(), GREEDY)
    llm = with_oracle(LLM(str(tiny_llama_dir), dtype="float32", kv_cache_dtype="float16", **SPEC), plain)
    outs = llm.generate(mixed_prompts(), GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert llm.engine.scheduler.speculation.stats.num_accepted_tokens > 0


# Greedy agreement with a float32 cache on the real SmolLM2, measured as
# tests/engine/test_quantization.py measures it (8 prompts x 24 tokens,
# position by position), with the defaults otherwise (the GGUF's Q4_1
# weights): see docs/engine.md, "A 16-bit cache for float32 models".
FLOAT16_CACHE_AGREEMENT = 0.9


@pytest.mark.smollm
def test_greedy_agreement_with_a_float32_cache_on_smollm2():
    runs = {}
    for name in ("model", "float16"):
        llm = LLM(dtype="float32", kv_cache_dtype=name, num_kv_blocks=64)
        runs[name] = [o.outputs[0].token_ids for o in llm.generate(SMOLLM_PROMPTS, GREEDY)]
    total = sum(len(t) for t in runs["model"])
    same = sum(a == b for x, y in zip(runs["model"], runs["float16"]) for a, b in zip(x, y))
    print(f"\nfloat16 cache: {same}/{total} tokens agree with a float32 cache")
    assert same / total >= FLOAT16_CACHE_AGREEMENT, f"{same}/{total} tokens agree with a float32 cache"
