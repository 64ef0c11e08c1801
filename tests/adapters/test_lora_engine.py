"""LoRA inside the engine: KV never shared across adapters or versions,
adapters replaced or lost mid-flight, and clear errors."""

from __future__ import annotations

import pytest

from adapters.errors import AdapterNotFound
from engine import LLM, SamplingParams
from engine.errors import ValidationError
from tests.adapters.conftest import ALL_MODULES, build_peft_adapter

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6)
PROMPT = list(range(300, 340))  # 40 tokens: two full blocks of 16 to share, or not


@pytest.fixture(scope="module")
def adapter_dirs(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("engine-adapters")
    dirs = {}
    for i, name in enumerate(["a", "a-v2", "b"]):
        dirs[name] = root / name
        build_peft_adapter(tiny_llama_dir, dirs[name], seed=10 + i, r=4, lora_alpha=8,
                           target_modules=ALL_MODULES)
    return dirs


@pytest.fixture
def llm(tiny_llama_dir, adapter_dirs, tmp_path):
    llm = LLM(str(tiny_llama_dir), data_dir=str(tmp_path), max_loras=2, max_lora_rank=8)
    llm.adapters.import_dir("a", adapter_dirs["a"])
    llm.adapters.import_dir("b", adapter_dirs["b"])
    return llm


def _run(llm, adapter):
    out = llm.generate(PROMPT, GREEDY, adapter=adapter)[0]
    return out.outputs[0].token_ids, out.num_cached_tokens


def test_prefix_cache_never_crosses_adapters_or_versions(llm, adapter_dirs):
    base_tokens, cached = _run(llm, None)
    assert cached == 0
    a_tokens, cached = _run(llm, "a")
    assert cached == 0 and a_tokens != base_tokens
    assert _run(llm, "a") == (a_tokens, 32)  # same adapter: both full blocks hit
    assert _run(llm, "b")[1] == 0
    llm.adapters.import_dir("a", adapter_dirs["a-v2"])  # new content: version 2
    v2_tokens, cached = _run(llm, "a")
    assert cached == 0 and v2_tokens != a_tokens
    assert _run(llm, "a@1") == (a_tokens, 32)


def test_running_requests_finish_on_the_version_they_started_with(llm, adapter_dirs):
    expected_v1 = _run(llm, "a")[0]
    engine = llm.engine
    engine.add_request(PROMPT, GREEDY, request_id="old", adapter="a")
    engine.step(final_only=True)
    llm.adapters.import_dir("a", adapter_dirs["a-v2"])
    engine.add_request(PROMPT, GREEDY, request_id="new", adapter="a")
    done = {}
    while engine.has_unfinished():
        for out in engine.step(final_only=True):
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert done["old"] == expected_v1
    assert done["new"] == _run(llm, "a@2")[0] != expected_v1


def test_an_adapter_that_cannot_load_fails_only_its_requests(llm, tmp_path):
    manifest = llm.adapters.resolve("b")
    for blob in (tmp_path / "adapters" / "blobs").glob(f"{manifest.digest}*"):
        blob.unlink()
    engine = llm.engine
    engine.add_request(PROMPT, GREEDY, request_id="doomed", adapter="b")
    engine.add_request(PROMPT, GREEDY, request_id="fine", adapter="a")
    done = {}
    for _ in range(200):
        for out in engine.step(final_only=True):
            if out.finished:
                done[out.request_id] = out
        if not engine.has_unfinished():
            break
    assert done["doomed"].outputs[0].finish_reason == "error"
    assert "could not be loaded" in done["doomed"].error
    assert done["fine"].outputs[0].finish_reason == "length"


def test_unknown_adapter_and_disabled_lora_are_clear_errors(llm, tiny_llama_dir):
    with pytest.raises(AdapterNotFound) as err:
        llm.generate("hi", GREEDY, adapter="nope")
    assert err.value.param == "model"
    plain = LLM(str(tiny_llama_dir), max_loras=0)
    with pytest.raises(ValidationError) as err:
        plain.generate("hi", GREEDY, adapter="a")
    assert err.value.param == "adapter"


def test_more_queued_adapters_than_the_host_cache_holds_all_finish(tiny_llama_dir, adapter_dirs, tmp_path):
    # One slot and one host entry for three adapters, all queued at once:
    # loading one evicts another from the host before its request runs.
    llm = LLM(str(tiny_llama_dir), data_dir=str(tmp_path), max_loras=1, max_cpu_loras=1, max_lora_rank=8)
    for name in ("a", "a-v2", "b"):
        llm.adapters.import_dir(name, adapter_dirs[name])
    engine = llm.engine
    for name in ("a", "a-v2", "b"):
        engine.add_request(PROMPT, GREEDY, request_id=name, adapter=name)
    finished = set()
    for _ in range(2000):  # bounded: a request stranded without its adapter fails here, not hangs
        finished |= {o.request_id for o in engine.step(final_only=True) if o.finished}
        if not engine.has_unfinished():
            break
    assert finished == {"a", "a-v2", "b"}
