"""A live gateway for the structured-output and tool tests (SmolLM2, or the
tiny Llama that shares its tokenizer and template): one tenant, the
official `openai` client, and raw HTTP for bodies the client would not send."""

from __future__ import annotations

import contextlib

import httpx
import openai

from engine.config import EngineConfig
from gateway.config import GatewayConfig
from gateway.tenancy import Tier
from tests.gateway.live import ADMIN_TOKEN, build_in_process_gateway, seed_tenants, start_live_server

CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "the time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]


@contextlib.contextmanager
def structured_gateway(model_dir, tmp_path):
    db_url = f"sqlite+aiosqlite:///{tmp_path / 'loragw.db'}"
    keys = seed_tenants(db_url, {"acme": Tier.STANDARD})
    engine = EngineConfig.from_flat(model=str(model_dir), max_model_len=1024, max_num_seqs=8,
                                    num_kv_blocks=512, data_dir=str(tmp_path / "data"))
    gw = build_in_process_gateway(GatewayConfig(db_url=db_url, admin_token=ADMIN_TOKEN, engine=engine,
                                                data_dir=tmp_path / "data"))
    server = start_live_server(gw)
    server.key = keys["acme"]
    server.model = gw.served_model_name
    try:
        yield server
    finally:
        server.stop()


def client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=live.key, max_retries=0)


def post(live, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{live.url}/v1/{path}", json={"model": live.model, **body},
                      headers={"Authorization": f"Bearer {live.key}"}, timeout=60)


def chat(live, **body) -> httpx.Response:
    return post(live, "chat/completions", {"messages": CHAT, "max_tokens": 4, **body})
