"""Robustness test 14: schemathesis against /openapi.json of a live gateway.

Every /v1 and /admin operation is called with generated requests, valid
and invalid by the schema, on a real uvicorn server with the tiny Llama, on
both stores. No answer may be a 5xx, and every answer must conform to the
document: its status is declared, its content type is declared, its body
matches the declared schema. Generation is derandomized, so a run is the
same on every machine; docs/gateway.md has the command that reproduces one.
"""

from __future__ import annotations

import os
import time
from collections import Counter

import hypothesis
import hypothesis.errors
import pytest
import schemathesis
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from engine.config import EngineConfig
from gateway.config import GatewayConfig
from gateway.routes.openapi import OPERATIONS
from gateway.tenancy import Tier
from tests.gateway.live import build_in_process_gateway, ADMIN_TOKEN, seed_tenants, start_live_server

# Examples per operation and generation mode (valid and invalid input): about
# 20 to 40 seconds per store on the tiny model. LORAGW_FUZZ_EXAMPLES digs deeper.
MAX_EXAMPLES = int(os.environ.get("LORAGW_FUZZ_EXAMPLES", "50"))


@pytest.fixture
def fuzz_target(db_url, tiny_llama_dir, tmp_path):
    keys = seed_tenants(db_url, {"acme": Tier.STANDARD})
    # A short context keeps generated completions (max_tokens unset means
    # "the rest of the context") to a few milliseconds each.
    engine = EngineConfig.from_flat(model=str(tiny_llama_dir), max_model_len=128, max_num_seqs=8, num_kv_blocks=256,
                                    data_dir=str(tmp_path / "data"))
    gw = build_in_process_gateway(GatewayConfig(db_url=db_url, admin_token=ADMIN_TOKEN, engine=engine,
                                     data_dir=tmp_path / "data"))
    server = start_live_server(gw)
    server.tenant_key = keys["acme"]
    yield server
    server.stop()


@pytest.fixture
def api_schema(fuzz_target):
    schema = schemathesis.openapi.from_url(f"{fuzz_target.url}/openapi.json")
    served = fuzz_target.gateway.served_model_name

    @schema.hook
    def map_body(context, body):
        return _for_the_served_model(_integral_floats_as_ints(body), served)

    # Through schemathesis' auth, not headers added at call time: a negative
    # case that drops the Authorization header on purpose must stay without it.
    @schema.auth(refresh_interval=None)
    class Bearer:
        def get(self, case, context):
            return ADMIN_TOKEN if context.operation.path.startswith("/admin") else fuzz_target.tenant_key

        def set(self, case, token, context):
            case.headers = {**(case.headers or {}), "Authorization": f"Bearer {token}"}

    return schema


def _integral_floats_as_ints(value):
    """JSON Schema counts 1.0 as an integer; the API parses types strictly
    and refuses it (a documented choice). Sending 1 instead keeps a valid
    case valid, and leaves every other number alone."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        return int(value)
    if isinstance(value, list):
        return [_integral_floats_as_ints(v) for v in value]
    if isinstance(value, dict):
        return {k: _integral_floats_as_ints(v) for k, v in value.items()}
    return value


def _for_the_served_model(body, served: str):
    """Random text almost never names the served model, so half of the
    completions (chosen by the generated name itself, to stay deterministic)
    ask for it and reach the engine."""
    if isinstance(body, dict) and isinstance(body.get("model"), str) and len(body["model"]) % 2 == 0:
        return {**body, "model": served}
    return body


# Operations where a schema-valid request may rightly be refused, for a
# reason a static schema does not state. Every other check still runs on
# them, and this one on every other operation.
_CONTEXT_DEPENDENT = {
    # the served model's context length, its vocabulary (token-id prompts),
    # its chat template's role order; rules between fields (top_logprobs needs logprobs)
    ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
    ("POST", "/admin/tenants/{tenant}/keys"),  # expires_at must be after now
    ("POST", "/admin/adapters"),  # the files must be a PEFT adapter that fits the base model
}


def _excluded_checks(operation, case) -> list:
    # /admin/usage's cursor is opaque: a string its schema allows is almost
    # never one the endpoint gave, and is rightly refused. A case without one
    # still holds every other parameter to the schema both ways, and a random
    # cursor still goes through decoding under the other checks (no 5xx).
    if (operation.method.upper(), operation.path) in _CONTEXT_DEPENDENT or (
            operation.path == "/admin/usage" and (case.query or {}).get("cursor")):
        return [positive_data_acceptance]
    return []


def test_openapi_fuzz_finds_no_5xx_and_every_answer_conforms(api_schema, fuzz_target):
    # Driven operation by operation here rather than by schemathesis' pytest
    # plugin (`from_fixture`), which does not run under pytest 9.
    start = time.monotonic()
    tried: dict[str, int] = {}
    statuses: Counter[tuple[str, int]] = Counter()
    failures: dict[str, str] = {}
    for result in api_schema.get_all_operations():
        operation = result.ok()  # an Err (an operation schemathesis cannot read) raises
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            label = f"{mode.value} {operation.label}"
            tried[label] = 0

            @hypothesis.given(operation.as_strategy(generation_mode=mode))
            @hypothesis.settings(max_examples=MAX_EXAMPLES, derandomize=True, deadline=None, database=None,
                                 suppress_health_check=list(hypothesis.HealthCheck),
                                 phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate])
            def call(case):
                tried[label] += 1
                response = case.call_and_validate(timeout=60, excluded_checks=_excluded_checks(operation, case))
                statuses[(label, response.status_code)] += 1

            try:
                call()
            except hypothesis.errors.Unsatisfiable:
                assert mode is GenerationMode.NEGATIVE  # nothing to get wrong: /health takes no input
            except (AssertionError, BaseExceptionGroup) as exc:  # try every operation, then show all failures
                failures[label] = str(exc)
    print(f"schemathesis: {len(tried)} operation-modes, {sum(tried.values())} requests in "
          f"{time.monotonic() - start:.1f} s", tried, sorted(statuses.items()))
    assert not failures, "\n\n".join(f"== {label}\n{text}" for label, text in failures.items())
    # Some generated completions got through to the engine and back, so the
    # run covered the generation path, not only the refusals in front of it.
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert statuses[(f"positive POST {path}", 200)] > 0, statuses
    assert not [key for key in statuses if key[1] >= 500]
    # Every operation the gateway documents was fuzzed (none was unreadable or skipped).
    assert {label.split(" ", 1)[1] for label in tried} == {f"{op.method.upper()} {op.path}" for op in OPERATIONS}
