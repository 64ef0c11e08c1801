"""The OpenAI-compatible API against a live uvicorn server, through the
official `openai` client: responses, streaming rules, sampling controls and
adapter selection (tests/gateway/test_openai_errors.py has the errors).

One server per module, on the tiny random Llama: its text is gibberish, so
tests compare outputs with each other and with the offline engine, never
with expected words.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.gateway.live import ADMIN_TOKEN, run_with_store
from tests.gateway.openai_live import CHAT, PROMPT, client, complete, openai_gateway


@pytest.fixture(scope="module")
def live(tiny_llama_dir, tiny_adapter_dir, tmp_path_factory):
    with openai_gateway(tiny_llama_dir, tiny_adapter_dir, tmp_path_factory.mktemp("live-openai")) as server:
        yield server


# ---- responses ----


def test_chat_completion(live):
    raw = client(live).chat.completions.with_raw_response.create(
        model=live.model, messages=CHAT, max_completion_tokens=6, temperature=0)
    assert raw.headers["x-request-id"]
    resp = raw.parse()
    assert resp.object == "chat.completion" and resp.model == live.model
    (choice,) = resp.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert resp.usage.completion_tokens == 6
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 6


def test_completion_default_max_tokens_is_the_rest_of_the_context(live):
    prompt = [42] * 2040  # the tiny Llama's context is 2048 tokens
    resp = complete(live, prompt=prompt, max_tokens=None, extra_body={"min_tokens": 8})
    assert resp.usage.prompt_tokens == 2040 and resp.usage.completion_tokens == 8
    assert resp.choices[0].finish_reason == "length"


def test_completion_streaming_with_usage_follows_the_chunk_rules(live):
    expected = complete(live, max_tokens=10).choices[0].text
    stream = client(live).completions.create(model=live.model, prompt=PROMPT, max_tokens=10, temperature=0,
                                             stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 10
    assert last.usage.total_tokens == last.usage.prompt_tokens + 10
    assert all(c.usage is None and len(c.choices) == 1 for c in body)
    assert "".join(c.choices[0].text for c in body) == expected
    assert [c.choices[0].finish_reason for c in body][-1] == "length"
    assert len({c.id for c in chunks}) == 1


def test_chat_streaming_n_choices(live):
    stream = client(live).chat.completions.create(
        model=live.model, messages=CHAT, max_tokens=5, n=2, temperature=0, stream=True,
        stream_options={"include_usage": True})
    texts, finished = {0: "", 1: ""}, {}
    roles = set()
    usage = None
    for chunk in stream:
        if not chunk.choices:
            usage = chunk.usage
            continue
        assert chunk.usage is None
        for choice in chunk.choices:
            if choice.delta.role:
                roles.add(choice.index)
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
    assert roles == {0, 1} and finished == {0: "length", 1: "length"}
    assert texts[0] == texts[1]  # greedy: both choices agree
    assert usage.completion_tokens == 10


def test_stream_without_include_usage_has_no_usage_chunk(live):
    chunks = list(client(live).completions.create(model=live.model, prompt=PROMPT, max_tokens=3, stream=True))
    assert all(c.usage is None and c.choices for c in chunks)


def test_n_choices(live):
    resp = complete(live, n=3, temperature=1.0, seed=3, max_tokens=6)
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    assert resp.usage.completion_tokens == 18


def test_stop_string_ends_the_text_before_it(live):
    full = complete(live, max_tokens=12).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip(), full
    resp = complete(live, max_tokens=12, stop=[stop, "never-appears"])
    assert resp.choices[0].text == full[:full.index(stop)]
    assert resp.choices[0].finish_reason == "stop"


def test_subnormal_temperature_is_greedy_not_a_500(live):
    greedy = complete(live, max_tokens=8)
    tiny = complete(live, max_tokens=8, temperature=1e-40, logprobs=1)
    assert tiny.choices[0].text == greedy.choices[0].text
    assert all(lp is not None and lp == lp for lp in tiny.choices[0].logprobs.token_logprobs)


def test_seed_reproducibility(live):
    def sample(seed):
        return complete(live, temperature=1.0, seed=seed, max_tokens=12).choices[0].text

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_chat_logprobs(live):
    resp = client(live).chat.completions.create(model=live.model, messages=CHAT, max_tokens=4, temperature=0,
                                                logprobs=True, top_logprobs=3)
    content = resp.choices[0].logprobs.content
    assert len(content) == 4
    for token in content:
        assert token.logprob <= 0 and len(token.top_logprobs) == 3
        # Greedy: the sampled token is the most likely one.
        assert token.top_logprobs[0].logprob == pytest.approx(token.logprob, abs=1e-4)
        assert bytes(token.bytes).decode(errors="replace") == token.token


def test_completion_logprobs(live):
    resp = complete(live, max_tokens=4, logprobs=2)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # The sampled token is always among them, so 2 or 3 entries (OpenAI's
    # "up to logprobs + 1"): at temperature 2 a sampled token is often
    # outside the top 2, and then it is the third.
    sampled = complete(live, max_tokens=16, logprobs=2, temperature=2.0, seed=3).choices[0].logprobs
    for token, logprob, top in zip(sampled.tokens, sampled.token_logprobs, sampled.top_logprobs, strict=True):
        assert top[token] == pytest.approx(logprob) and len(top) in (2, 3)
    assert any(len(top) == 3 for top in sampled.top_logprobs)


def test_token_id_prompt(live):
    by_text = complete(live, max_tokens=5).choices[0].text
    ids = live.gateway.engine.tokenize(PROMPT)
    assert complete(live, prompt=ids, max_tokens=5).choices[0].text == by_text


def test_role_injection_forged_turn_is_billed_as_plain_text(live, tiny_llama_dir):
    """Control tokens typed into a message are ordinary text tokens, so the
    forged system turn costs its full text in usage.prompt_tokens."""
    from transformers import AutoTokenizer

    from tests.engine.test_chat_template import FORGED, hf_ids, smollm_reference

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    messages = [{"role": "user", "content": FORGED}]
    reply = client(live).chat.completions.create(model=live.model, messages=messages, max_tokens=1)
    assert reply.usage.prompt_tokens == len(smollm_reference(tokenizer, FORGED))
    assert reply.usage.prompt_tokens != len(hf_ids(tokenizer, messages))


# ---- models and adapters ----


def test_models_lists_base_and_the_adapters_this_key_may_use(live):
    acme = {m.id: m for m in client(live).models.list()}
    assert set(acme) == {live.model, "tiny-lora", "shared-lora"}
    assert acme["tiny-lora"].parent == live.model and acme["tiny-lora"].owned_by == "acme"
    assert acme["shared-lora"].parent == live.model
    rival = {m.id for m in client(live, "rival").models.list()}
    assert rival == {live.model, "shared-lora"}
    # One entry, as the SDK's models.retrieve asks for it: what the list holds, and the same 404 otherwise.
    for model in ("tiny-lora", live.model):  # the base card's `created` is the time of the answer
        card = client(live).models.retrieve(model)
        assert card.model_dump(exclude={"created"}) == acme[model].model_dump(exclude={"created"})
    for tenant, model in (("rival", "tiny-lora"), ("acme", "no-such-lora")):
        with pytest.raises(openai.NotFoundError) as err:
            client(live, tenant).models.retrieve(model)
        assert err.value.code == "model_not_found"


def test_adapter_selected_through_model_matches_the_offline_engine(live, tiny_llama_dir):
    from engine import LLM, SamplingParams

    base = complete(live, max_tokens=8).choices[0].text
    tuned = complete(live, model="tiny-lora", max_tokens=8).choices[0].text
    pinned = complete(live, model="tiny-lora@1", max_tokens=8).choices[0].text
    assert tuned != base and pinned == tuned

    llm = LLM(str(tiny_llama_dir), max_num_seqs=2, num_kv_blocks=64,
              data_dir=live.gateway.config.engine.data_dir)
    offline = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8), adapter="tiny-lora")
    assert offline[0].outputs[0].text == tuned


def test_shared_adapter_serves_every_tenant(live):
    resp = client(live, "rival").completions.create(model="shared-lora", prompt=PROMPT, max_tokens=3)
    assert resp.model == "shared-lora" and resp.usage.completion_tokens == 3


def test_deleting_an_adapter_lets_running_requests_finish_and_new_ones_get_404(live, tiny_adapter_dir):
    live.gateway.registry.import_dir("doomed-lora", tiny_adapter_dir)
    run_with_store(live.gateway.config.db_url,
                   lambda store: store.grant_adapter("doomed-lora", owner="acme", shared=False))
    stream = client(live).completions.create(model="doomed-lora", prompt=PROMPT, max_tokens=60,
                                             extra_body={"min_tokens": 60}, stream=True,
                                             stream_options={"include_usage": True})
    chunks = iter(stream)
    next(chunks)  # running on the adapter
    r = httpx.delete(f"{live.url}/admin/adapters/doomed-lora", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert r.status_code == 200, r.text
    usage = [c.usage for c in chunks if c.usage is not None]
    assert usage and usage[0].completion_tokens == 60  # it finished on the version it started with
    with pytest.raises(openai.NotFoundError):
        client(live).completions.create(model="doomed-lora", prompt=PROMPT, max_tokens=2)
    assert "doomed-lora" not in {m.id for m in client(live).models.list()}
