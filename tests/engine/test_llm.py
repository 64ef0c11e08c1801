"""The offline API end to end on the tiny random Llama: sampling semantics,
n-way forks, stop strings, logprobs, chat and validation errors."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import ValidationError
from engine.request import Tier

PROMPTS = ["The quick brown fox", "Paged attention stores keys", "Hello there", "One two three four"]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir))


def _texts(outs):
    return [o.outputs[0].text for o in outs]


def test_seed_reproduces_whatever_else_is_batched(llm):
    params = SamplingParams(temperature=1.0, seed=42, max_tokens=12)
    alone = llm.generate(PROMPTS[0], params)[0].outputs[0].token_ids
    other = SamplingParams(temperature=1.0, max_tokens=12)
    batched = llm.generate(PROMPTS, [params, other, other, other])[0].outputs[0].token_ids
    assert alone == batched
    different = llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, seed=43, max_tokens=12))
    assert different[0].outputs[0].token_ids != alone


def test_top_k_one_equals_greedy(llm):
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=10))
    top1 = llm.generate(PROMPTS, SamplingParams(temperature=0.8, top_k=1, max_tokens=10))
    assert [o.outputs[0].token_ids for o in top1] == [o.outputs[0].token_ids for o in greedy]


def test_subnormal_temperature_is_greedy(llm):
    # 1e-40 is below float32's smallest normal: dividing the logits by it gave inf/NaN.
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=10, logprobs=1))
    tiny = llm.generate(PROMPTS, SamplingParams(temperature=1e-40, max_tokens=10, logprobs=1, seed=5))
    assert [o.outputs[0].token_ids for o in tiny] == [o.outputs[0].token_ids for o in greedy]
    logprobs = [lp.logprob for o in tiny for lp in o.outputs[0].logprobs]
    assert logprobs and all(torch.isfinite(torch.tensor(logprobs)))


def test_stop_string_is_cut_from_output(llm):
    full = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=20))[0].outputs[0].text
    assert len(full) > 6
    stop = full[3:6]
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=20, stop=[stop]))[0]
    comp = out.outputs[0]
    assert comp.finish_reason == "stop" and comp.stop_reason == stop
    assert comp.text == full[:full.index(stop)]
    assert stop not in comp.text


def test_stop_token_id_and_max_tokens(llm):
    full = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=8))[0].outputs[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 8
    stop_id = full.token_ids[3]
    cut = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=8,
                                                  stop_token_ids=[stop_id]))[0].outputs[0]
    first = full.token_ids.index(stop_id)
    assert cut.token_ids == full.token_ids[:first + 1]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop_id


def test_logprobs_match_log_softmax_of_the_model(llm, tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    out = llm.generate(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=3, logprobs=5))[0]
    comp = out.outputs[0]
    assert len(comp.logprobs) == 3
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    ids = torch.tensor([out.prompt_token_ids + comp.token_ids])
    with torch.inference_mode():
        ref = torch.log_softmax(hf(ids).logits[0].float(), dim=-1)
    n = len(out.prompt_token_ids)
    for i, lp in enumerate(comp.logprobs):
        row = ref[n - 1 + i]
        assert lp.token_id == comp.token_ids[i]
        assert lp.logprob == pytest.approx(row[lp.token_id].item(), abs=1e-4)
        top = torch.topk(row, 5)
        assert [t for t, _ in lp.top_logprobs] == top.indices.tolist()
        assert [v for _, v in lp.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
    assert comp.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in comp.logprobs))


def test_n_completions_are_distinct_and_reproducible(llm):
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8)
    a = llm.generate(PROMPTS[3], params)[0]
    b = llm.generate(PROMPTS[3], params)[0]
    assert [c.index for c in a.outputs] == [0, 1, 2, 3]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1
    # Sample 0 of a seeded n-request is the same stream as the n=1 request.
    single = llm.generate(PROMPTS[3], SamplingParams(temperature=1.0, seed=7, max_tokens=8))[0]
    assert single.outputs[0].token_ids == a.outputs[0].token_ids


def test_n_shares_the_prompt_blocks(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), block_size=16, enable_prefix_caching=False)
    engine = llm.engine
    prompt = list(range(100, 140))  # 40 tokens: 2 full blocks and a partial one
    engine.add_request(prompt, SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=5), request_id="g")
    engine.step()  # prefill, three first tokens, fork
    kv = engine.scheduler.kv
    tables = [kv.block_table(r) for r in ("g", "g#1", "g#2")]
    assert tables[0] == tables[1] == tables[2] and len(tables[0]) == 3
    assert kv.usage().num_used == 3
    engine.step()  # every sequence writes into the shared partial block: copy-on-write
    tables = [kv.block_table(r) for r in ("g", "g#1", "g#2")]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]
    assert len({t[2] for t in tables}) == 3
    assert kv.usage().num_used == 5
    while engine.has_unfinished():
        engine.step()
    assert kv.num_free_blocks() == kv.block_pool.num_blocks


def test_forked_children_read_their_own_kv(tiny_llama_dir):
    """After copy-on-write each child must see exactly its own history: the
    logprob of every sampled token equals HF's on that child's sequence."""
    from transformers import AutoModelForCausalLM

    llm = LLM(str(tiny_llama_dir), block_size=16)
    prompt = list(range(200, 237))  # ends inside a block, so the fork shares a partial block
    out = llm.generate(prompt, SamplingParams(n=3, temperature=1.5, seed=11, max_tokens=12, logprobs=0))[0]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    for comp in out.outputs:
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + comp.token_ids])).logits[0].float()
        ref = torch.log_softmax(logits, dim=-1)
        for i, lp in enumerate(comp.logprobs):
            assert lp.logprob == pytest.approx(ref[len(prompt) - 1 + i, lp.token_id].item(), abs=1e-4)
    kv = llm.engine.scheduler.kv
    assert kv.num_free_blocks() == kv.block_pool.num_blocks


def test_chat_applies_the_template(llm):
    messages = [{"role": "user", "content": "Hi"}]
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=4))[0]
    expected = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert llm.tokenizer.decode(out.prompt_token_ids) == expected
    assert expected.endswith("<|im_start|>assistant\n")


def test_token_id_prompts_and_per_prompt_params(llm):
    ids = llm.tokenizer("Hello there").input_ids
    a = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=5))[0]
    b = llm.generate("Hello there", SamplingParams(temperature=0.0, max_tokens=5))[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    outs = llm.generate(PROMPTS[:2], [SamplingParams(max_tokens=2), SamplingParams(max_tokens=5)])
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 5]


def test_tiers_change_order_not_results(llm):
    params = SamplingParams(temperature=0.0, max_tokens=6)
    std = llm.generate(PROMPTS, params)
    mixed = llm.generate(PROMPTS, params, tier=[Tier.PREMIUM, "standard", "premium", Tier.STANDARD])
    assert _texts(std) == _texts(mixed)


@pytest.mark.parametrize("kwargs, param", [
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"n": 17}, "n"),
    ({"logprobs": 21}, "logprobs"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"stop": [""]}, "stop"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"top_k": 1.5}, "top_k"),
    ({"seed": "x"}, "seed"),
])
def test_invalid_sampling_params_name_the_parameter(kwargs, param):
    with pytest.raises(ValidationError) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param


def test_invalid_prompts_are_rejected_and_leave_no_state(llm):
    vocab = len(llm.tokenizer)
    for bad in ([vocab], [-1], [1.5]):
        with pytest.raises(ValidationError) as err:
            llm.generate([bad], SamplingParams(max_tokens=2))
        assert err.value.param == "prompt"
    with pytest.raises(ValidationError):
        llm.generate([""], SamplingParams(max_tokens=2))
    too_long = [5] * llm.engine.max_model_len
    with pytest.raises(ValidationError) as err:
        llm.generate([too_long], SamplingParams(max_tokens=2))
    assert "tokens" in err.value.message
    with pytest.raises(ValidationError):
        llm.generate(PROMPTS, [SamplingParams()] * 3)
    assert not llm.engine.has_unfinished()
    assert llm.generate("ok", SamplingParams(max_tokens=2))[0].finished


def test_abort_returns_partial_output_and_frees_blocks(llm):
    engine = llm.engine
    engine.add_request("Count with me", SamplingParams(temperature=0.0, max_tokens=50), request_id="ab")
    engine.step(final_only=True)
    engine.step(final_only=True)
    out = engine.abort("ab")  # the output not yet taken: here all of it
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert len(out.outputs[0].token_ids) == out.num_output_tokens == 2
    assert not engine.has_unfinished()
    kv = engine.scheduler.kv
    assert kv.num_free_blocks() == kv.block_pool.num_blocks
