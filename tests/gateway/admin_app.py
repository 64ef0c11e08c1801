"""A gateway app for admin tests: a real store and adapter registry, no model."""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import json
import time
from pathlib import Path

import torch
from safetensors.torch import load, save
from starlette.testclient import TestClient

from adapters.registry import AdapterRegistry
from gateway.admission import AdmissionController
from gateway.app import Gateway, create_app
from gateway.config import GatewayConfig
from gateway.store.sql import SqlStore
from tests.gateway.fakes import FakeEngineClient
from gateway.tenancy import Tier
from tests.gateway.live import ADMIN_TOKEN

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@contextlib.contextmanager
def admin_client(db_url: str, registry: AdapterRegistry, **config):
    """A TestClient (lifespan run) on a gateway with the admin token set."""
    gw_config = GatewayConfig(admin_token=ADMIN_TOKEN, **config)
    engine = FakeEngineClient(registry)
    admission = AdmissionController({Tier.PREMIUM: gw_config.premium, Tier.STANDARD: gw_config.standard},
                                    lambda: engine.kv_capacity, clock=time.monotonic)
    gateway = Gateway(config=gw_config, store=SqlStore.from_url(db_url), engine=engine, admission=admission)
    with TestClient(create_app(gateway)) as client:
        client.gateway = gateway
        yield client


def call_store(client: TestClient, method: str, *args, **kwargs):
    """Run a store coroutine on the client's event loop (the store's pool lives there)."""
    fn = getattr(client.gateway.store, method)
    return client.portal.call(functools.partial(fn, *args, **kwargs))


def now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def adapter_files(adapter_dir: Path, scale: float = 1.0) -> tuple[bytes, bytes]:
    """(adapter_config.json, adapter_model.safetensors) bytes; `scale` != 1
    multiplies the B matrices, which makes a different valid adapter."""
    config = (adapter_dir / "adapter_config.json").read_bytes()
    weights = (adapter_dir / "adapter_model.safetensors").read_bytes()
    if scale != 1.0:
        tensors = load(weights)
        weights = save({k: (v * scale if "lora_B" in k else v).contiguous() for k, v in tensors.items()})
    return config, weights


def upload_form(name: str | None, config: bytes | None, weights: bytes | None, **fields):
    """(data, files) for client.post(..., data=, files=)."""
    data = {k: str(v).lower() if isinstance(v, bool) else v for k, v in fields.items() if v is not None}
    if name is not None:
        data["name"] = name
    files = {}
    if config is not None:
        files["adapter_config.json"] = ("adapter_config.json", config, "application/json")
    if weights is not None:
        files["adapter_model.safetensors"] = ("adapter_model.safetensors", weights, "application/octet-stream")
    return data, files


def spoil_config(config: bytes, **changes) -> bytes:
    cfg = json.loads(config)
    cfg.update(changes)
    return json.dumps(cfg).encode()


def pickle_weights() -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save({"x": torch.zeros(1)}, buffer)
    return buffer.getvalue()
