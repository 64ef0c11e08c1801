"""The OpenAI-compatible API against a live uvicorn server, through the
official `openai` client: responses, streaming rules, sampling controls,
adapter selection, and every error as the client's typed exception.

One server per module, on the tiny random Llama: its text is gibberish, so
tests compare outputs with each other and with the offline engine, never
with expected words.
"""

from __future__ import annotations

import datetime as dt
import threading
import time

import httpx
import openai
import pytest

from engine.config import EngineConfig
from gateway.config import GatewayConfig
from gateway.store import schema
from gateway.tenancy import TenantLimits, Tier
from tests.gateway.live import build_in_process_gateway, ADMIN_TOKEN, run_with_store, start_live_server

PROMPT = "The quick brown fox"
CHAT = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def live(tiny_llama_dir, tiny_adapter_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("live-openai")
    db_url = f"sqlite+aiosqlite:///{tmp / 'loragw.db'}"
    schema.upgrade(db_url)
    now = dt.datetime.now(dt.UTC)

    async def seed(store):
        keys = {}
        for name, limits in [("acme", TenantLimits()), ("rival", TenantLimits()),
                             ("limited", TenantLimits(max_concurrent=1))]:
            await store.create_tenant(name, Tier.STANDARD, limits)
            keys[name] = (await store.create_key(name, now=now)).secret
        revoked = await store.create_key("acme", now=now)
        await store.revoke_key(revoked.info.id, now=now)
        keys["revoked"] = revoked.secret
        expired = await store.create_key("acme", now=now - dt.timedelta(hours=2),
                                         expires_at=now - dt.timedelta(hours=1))
        keys["expired"] = expired.secret
        await store.grant_adapter("tiny-lora", owner="acme", shared=False)
        await store.grant_adapter("shared-lora", owner=None, shared=True)
        return keys

    keys = run_with_store(db_url, seed)
    engine = EngineConfig.from_flat(model=str(tiny_llama_dir), max_num_seqs=16, num_kv_blocks=512,
                                    data_dir=str(tmp / "data"))
    gw = build_in_process_gateway(GatewayConfig(db_url=db_url, admin_token=ADMIN_TOKEN, engine=engine,
                                     data_dir=tmp / "data"))
    server = start_live_server(gw)
    gw.registry.import_dir("tiny-lora", tiny_adapter_dir)
    gw.registry.import_dir("shared-lora", tiny_adapter_dir)
    server.keys = keys
    server.model = gw.served_model_name
    yield server
    server.stop()


def client(live, tenant: str = "acme", **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=live.keys[tenant], **{"max_retries": 0, **kwargs})


def complete(live, **kwargs):
    args = {"model": live.model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, **kwargs}
    return client(live).completions.create(**args)


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


# ---- typed errors ----


@pytest.mark.parametrize("key", ["wrong", "revoked", "expired"])
def test_bad_keys_are_authentication_errors(live, key):
    api_key = "lgw-not-a-real-key" if key == "wrong" else live.keys[key]
    c = openai.OpenAI(base_url=f"{live.url}/v1", api_key=api_key, max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        c.completions.create(model=live.model, prompt=PROMPT, max_tokens=2)
    assert err.value.code == "invalid_api_key"
    assert err.value.response.headers["x-request-id"]


def test_missing_key_is_an_authentication_error(live):
    with pytest.raises(openai.AuthenticationError, match="missing API key"):
        client(live).models.list(extra_headers={"Authorization": ""})


def test_another_tenants_adapter_is_not_found_like_an_unknown_model(live):
    with pytest.raises(openai.NotFoundError) as theirs:
        client(live, "rival").completions.create(model="tiny-lora", prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.NotFoundError) as unknown:
        client(live, "rival").completions.create(model="no-such-lora", prompt=PROMPT, max_tokens=2)
    assert theirs.value.code == unknown.value.code == "model_not_found"
    assert theirs.value.message.replace("tiny-lora", "X") == unknown.value.message.replace("no-such-lora", "X")
    with pytest.raises(openai.NotFoundError):
        complete(live, model="tiny-lora@9")
    with pytest.raises(openai.NotFoundError):
        complete(live, model="../etc/passwd")


@pytest.mark.parametrize("kwargs, param", [
    ({"max_tokens": 5000}, "max_tokens"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"n": 17}, "n"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"logprobs": 21}, "logprobs"),
    ({"extra_body": {"min_tokens": 9}}, "min_tokens"),  # more than max_tokens
    ({"echo": True}, "echo"),
    ({"prompt": [[1, 2], [3]]}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
])
def test_invalid_completion_requests_are_bad_requests(live, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        complete(live, **kwargs)
    assert err.value.param == param, err.value.message
    assert isinstance(err.value.code, str)


@pytest.mark.parametrize("kwargs, param", [
    ({"max_completion_tokens": 5000}, "max_completion_tokens"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"n": 17}, "n"),
    ({"temperature": -1}, "temperature"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    ({"functions": [{"name": "f"}]}, "functions"),  # the legacy form of tools
    ({"tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools[0].function.name"),
])
def test_invalid_chat_requests_are_bad_requests(live, kwargs, param):
    args = {"model": live.model, "messages": CHAT, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as err:
        client(live).chat.completions.create(**args)
    assert err.value.param == param, err.value.message


def test_prompt_over_the_context_is_a_bad_request(live):
    ids = [42] * 2048
    with pytest.raises(openai.BadRequestError) as err:
        complete(live, prompt=ids, max_tokens=None)
    assert err.value.code == "context_length_exceeded" and err.value.param == "prompt"


def test_bad_json_and_wrong_types_are_bad_requests(live):
    headers = {"Authorization": f"Bearer {live.keys['acme']}"}
    for body in (b"{not json", b"[1, 2]", b'{"model": "m", "prompt": "x", "n": "2"}',
                 b'{"model": "m", "prompt": "x", "max_tokens": true}'):
        r = httpx.post(f"{live.url}/v1/completions", content=body, headers=headers)
        assert r.status_code == 400, body
        assert r.json()["error"]["type"] == "invalid_request_error"


def test_admission_rejection_is_a_rate_limit_error_with_retry_after(live):
    c = client(live, "limited")
    stream = c.completions.create(model=live.model, prompt=PROMPT, max_tokens=200, stream=True)
    next(iter(stream))  # the one allowed request is now running
    with pytest.raises(openai.RateLimitError) as err:
        c.completions.create(model=live.model, prompt=PROMPT, max_tokens=2)
    assert err.value.response.headers["retry-after"] == "1"
    assert err.value.code == "max_concurrent" and "concurrent" in err.value.message

    # The client honours Retry-After: its retry, a second later, finds the
    # slot that closing the stream freed.
    result = {}

    def retrying():
        retrying_client = client(live, "limited", max_retries=3)
        start = time.monotonic()
        result["resp"] = retrying_client.completions.create(model=live.model, prompt=PROMPT, max_tokens=2)
        result["elapsed"] = time.monotonic() - start

    t = threading.Thread(target=retrying)
    t.start()
    time.sleep(0.3)
    stream.close()
    t.join(timeout=30)
    assert result["resp"].usage.completion_tokens == 2
    assert result["elapsed"] >= 0.9


def test_client_disconnect_aborts_the_engine_request(live):
    stream = client(live).completions.create(model=live.model, prompt=PROMPT, max_tokens=1500,
                                             extra_body={"min_tokens": 1500}, stream=True)
    next(iter(stream))
    assert live.gateway.in_flight >= 1
    stream.close()
    _assert_engine_idle_soon(live)


def _assert_engine_idle_soon(live):
    """Within 5 s, far less than the 1500 tokens asked for would take."""
    deadline = time.monotonic() + 5
    while live.gateway.in_flight and time.monotonic() < deadline:
        time.sleep(0.02)
    assert live.gateway.in_flight == 0
    llm_engine = live.gateway.engine._engine.engine
    while llm_engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not llm_engine.has_unfinished()


# ---- HTTP-level guarantees ----


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "internal.admin", "evil.example:80"])
def test_a_crafted_host_header_does_not_bypass_auth(live, host):
    r = httpx.get(f"{live.url}/v1/models", headers={"Host": host})
    assert r.status_code == 401
    r = httpx.get(f"{live.url}/admin/tenants", headers={"Host": host,
                                                        "Authorization": f"Bearer {live.keys['acme']}"})
    assert r.status_code == 401
    r = httpx.post(f"{live.url}/v1/completions", headers={"Host": host, "X-Forwarded-For": "127.0.0.1"},
                   json={"model": live.model, "prompt": "x"})
    assert r.status_code == 401


def test_every_response_has_a_request_id(live):
    auth = {"Authorization": f"Bearer {live.keys['acme']}"}
    for method, path, kwargs in [
        ("GET", "/health", {}), ("GET", "/ready", {}), ("GET", "/openapi.json", {}),
        ("GET", "/v1/models", {"headers": auth}), ("GET", "/v1/models", {}),
        ("GET", "/v1/nope", {"headers": auth}), ("DELETE", "/v1/models", {"headers": auth}),
        ("POST", "/v1/completions", {"headers": auth, "json": {"model": "nope", "prompt": "x"}}),
        ("POST", "/v1/completions", {"headers": auth, "json": {"model": live.model, "prompt": "x",
                                                               "max_tokens": 2, "stream": True}}),
    ]:
        r = httpx.request(method, f"{live.url}{path}", **kwargs)
        assert len(r.headers.get("x-request-id", "")) >= 16, (method, path, r.status_code)
    r = httpx.get(f"{live.url}/health", headers={"x-request-id": "trace-abc-123"})
    assert r.headers["x-request-id"] == "trace-abc-123"


def test_health_ready_and_openapi(live):
    assert httpx.get(f"{live.url}/health").json() == {"status": "ok", "workers": {"0": "ready"}}
    assert httpx.get(f"{live.url}/ready").json()["status"] == "ready"
    doc = httpx.get(f"{live.url}/openapi.json").json()
    assert doc["openapi"].startswith("3.1")
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/admin/tenants",
                 "/admin/adapters", "/admin/keys/{key_id}"):
        assert path in doc["paths"]
    schemas = doc["components"]["schemas"]
    assert {"ChatCompletionRequest", "ChatCompletion", "ChatCompletionChunk", "TenantCreate"} <= set(schemas)
    assert schemas["CompletionRequest"]["properties"]["n"]["maximum"] == 16


def test_draining_refuses_new_requests_but_health_answers(live):
    live.gateway.draining = True
    try:
        with pytest.raises(openai.InternalServerError) as err:
            complete(live, max_tokens=2)
        assert err.value.status_code == 503 and err.value.code == "draining"
        assert httpx.get(f"{live.url}/health").status_code == 200
        assert httpx.get(f"{live.url}/ready").status_code == 503
    finally:
        live.gateway.draining = False


def test_a_client_that_hangs_up_on_a_non_streamed_request_aborts_it(live):
    body = {"model": live.model, "prompt": PROMPT, "max_tokens": 1500, "min_tokens": 1500}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{live.url}/v1/completions", json=body, timeout=0.5,
                   headers={"Authorization": f"Bearer {live.keys['acme']}"})
    _assert_engine_idle_soon(live)


def test_health_answers_fast_while_the_engine_is_saturated(live):
    body = {"model": live.model, "prompt": PROMPT, "max_tokens": 60, "min_tokens": 60, "stream": True}
    headers = {"Authorization": f"Bearer {live.keys['acme']}"}

    def drain_stream():
        with httpx.stream("POST", f"{live.url}/v1/completions", json=body, headers=headers, timeout=60) as r:
            for _ in r.iter_lines():
                pass

    load = [threading.Thread(target=drain_stream) for _ in range(12)]
    for t in load:
        t.start()
    _wait_until(lambda: live.gateway.in_flight >= 8)
    with httpx.Client(base_url=live.url) as probe:
        latencies = []
        for _ in range(20):
            start = time.perf_counter()
            assert probe.get("/health").status_code == 200
            latencies.append(time.perf_counter() - start)
            time.sleep(0.01)
    busy = live.gateway.in_flight
    for t in load:
        t.join(timeout=60)
    assert busy >= 1, "the load finished before the probes did"
    assert max(latencies) < 0.1, sorted(latencies)[-3:]


def _wait_until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
