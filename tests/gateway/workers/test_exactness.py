"""Exactness through the wire: greedy completions served by two worker
processes through the gateway's HTTP API equal the offline engine's
(`engine.llm.LLM` on the same weights and adapters), token for token, for
the base model and several adapters mixed in concurrent requests, and for
a streamed one."""

from __future__ import annotations

import asyncio
import json

import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.gateway.workers.conftest import LORAS

MAX_TOKENS = 8
PROMPTS = [[(13 * i + 7 * j) % 500 + 5 for j in range(9 + 5 * i)] for i in range(4)] + ["The quick brown fox"]
ADAPTERS = [None] + [name for name, _ in LORAS[:3]]
# Every prompt with every adapter (and the base model): 20 requests at once.
JOBS = [(prompt, adapter) for prompt in PROMPTS for adapter in ADAPTERS]


@pytest.fixture(scope="module")
def offline(tiny_llama_dir, lora_dirs, tmp_path_factory):
    """The reference: the offline engine on the same weights and adapters,
    greedy: each job's (tokens as the API spells them, logprobs, text)."""
    llm = LLM(str(tiny_llama_dir), data_dir=str(tmp_path_factory.mktemp("offline")), max_loras=4, num_threads=1)
    for name in ADAPTERS[1:]:
        llm.adapters.import_dir(name, lora_dirs[name])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0)
    outs = [o.outputs[0] for o in llm.generate([p for p, _ in JOBS], params, adapters=[a for _, a in JOBS])]
    # Each token spelled as the API spells it (alone, special tokens kept).
    return [([llm.tokenizer.decode([t], skip_special_tokens=False) for t in c.token_ids],
             [lp.logprob for lp in c.logprobs], c.text) for c in outs]


def _body(server, prompt, adapter, **extra) -> dict:
    return {"model": adapter or server.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "n": 1, "logprobs": 0, **extra}


async def _complete(client, server, prompt, adapter):
    r = await client.post("/v1/completions", json=_body(server, prompt, adapter), headers=server.headers("acme"))
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    return choice["logprobs"]["tokens"], choice["logprobs"]["token_logprobs"], choice["text"]


async def _stream(client, server, prompt, adapter):
    tokens, logprobs, text = [], [], ""
    body = _body(server, prompt, adapter, stream=True)
    async with client.stream("POST", "/v1/completions", json=body, headers=server.headers("acme")) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            (choice,) = json.loads(line[len("data: "):])["choices"]
            text += choice["text"]
            if choice["logprobs"]:
                tokens += choice["logprobs"]["tokens"]
                logprobs += choice["logprobs"]["token_logprobs"]
    return tokens, logprobs, text


def _assert_same(got, want, what: str) -> None:
    (tokens, logprobs, text), (want_tokens, want_logprobs, want_text) = got, want
    assert tokens == want_tokens, what
    assert text == want_text, what
    assert logprobs == pytest.approx(want_logprobs, abs=1e-3), what


def test_greedy_through_two_workers_equals_the_offline_engine(fleet_server, offline):
    async def run():
        async with fleet_server.client() as client:
            return await asyncio.gather(*(_complete(client, fleet_server, p, a) for p, a in JOBS))

    before = {w: s.steps for w, s in fleet_server.snapshots().items()}
    results = asyncio.run(run())
    for (prompt, adapter), got, want in zip(JOBS, results, offline):
        _assert_same(got, want, f"prompt {prompt!r} with adapter {adapter}")
    # Both workers served some of them (the router spread the load).
    after = fleet_server.snapshots()
    assert set(after) == {"0", "1"}
    assert all(after[w].steps > before.get(w, 0) for w in after), (before, after)


def test_a_streamed_completion_equals_the_offline_engine(fleet_server, offline):
    async def run():
        async with fleet_server.client() as client:
            return await _stream(client, fleet_server, *JOBS[-1])

    got = asyncio.run(run())
    assert len(got[0]) == MAX_TOKENS
    _assert_same(got, offline[-1], "the streamed request")
