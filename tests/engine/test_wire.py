"""The worker protocol (engine/wire.py): every message survives the codec,
a peer of another protocol version is refused with both versions named,
and a worker listens beyond loopback only with a shared secret.

The last tests speak the protocol by hand, with a raw ZeroMQ DEALER,
to a real `python -m engine.worker` process on the tiny Llama: version and
secret checks, commands of a refused peer ignored, and a new session
taking over the old one's requests.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import msgspec
import pytest
import zmq

from engine.config import EngineConfig
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from engine.request import Tier
from engine.sampling_params import SamplingParams
from engine.snapshot import EngineSnapshot
from engine.step_io import AdapterLoad, Preemption, RequestStepUsage, StepUsage
from engine.structured.spec import StructuredSpec
from engine.wire import (PROTOCOL_VERSION, Abort, AddRequest, Codec, Fatal, Hello, ProtocolError, Refused,
                         Rejection, Status, StepOutputs, WorkerInfo, is_local_endpoint)
from engine.worker import WorkerConfigError, check_listen

LORA = ("lora-a", 2, "9f86d081884c7d65")
SNAPSHOT = EngineSnapshot(
    num_running={Tier.PREMIUM: 1, Tier.STANDARD: 3}, num_waiting={Tier.PREMIUM: 0, Tier.STANDARD: 5},
    num_preemptions={Tier.STANDARD: 2}, kv_num_blocks=64, kv_used_blocks=40, kv_free_blocks=24,
    kv_premium_reserved_blocks=8, kv_used_by_tier={Tier.PREMIUM: 6, Tier.STANDARD: 34}, block_size=16,
    prefix_cache_queries=900, prefix_cache_hits=320, num_lora_slots=2, resident_adapters=(LORA,),
    host_adapters=(LORA, ("lora-b", 1, "aa")), waiting_adapters=(("lora-c", 2, "bb"),), adapter_loads=3,
    adapter_evictions=1, recent_adapter_load_seconds=(0.25, 0.125), steps=41, busy_time_us=123456)
OUTPUTS = [
    RequestOutput("r1", None, [1, 2, 3], [CompletionOutput(
        0, "ab", [5, 6], logprobs=[TokenLogprob(5, -0.25, ((5, -0.25), (7, -1.5))), TokenLogprob(6, -0.5)])],
        metrics=RequestMetrics(1.0, 1.5, 2.0), num_output_tokens=2),
    RequestOutput("r2", None, [9], [CompletionOutput(1, "z", [8], finish_reason="stop", stop_reason=2)],
                  finished=True, num_cached_tokens=16, error=None, num_output_tokens=7),
]
USAGE = StepUsage(
    step_id=7, busy_time_us=4321,
    requests=(RequestStepUsage("r1", Tier.PREMIUM, LORA, 3, 16, 0, 0, group_id="r1"),
              RequestStepUsage("r2-1", Tier.STANDARD, None, 0, 0, 12, 1, group_id="r2")),
    preemptions=(Preemption("r2-1", Tier.STANDARD, "r1"),), adapter_loads=(AdapterLoad(LORA, 250),))
TO_WORKER = [
    Hello(PROTOCOL_VERSION, "gw-1", "s3cret"),
    Hello(PROTOCOL_VERSION, "gw-2"),
    AddRequest("r1", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4, stop=["x"], logprobs=2),
               Tier.PREMIUM, LORA, "salt"),
    AddRequest("r2", [4], SamplingParams(), Tier.STANDARD, None, None),
    AddRequest("r3", [4], SamplingParams(structured=StructuredSpec.json_schema({"type": "object"}, param="p")),
               Tier.STANDARD, None, "salt"),
    Abort(["r1", "r2"]),
]
TO_GATEWAY = [
    Refused("wrong or missing worker secret"),
    Status(PROTOCOL_VERSION),
    Status(PROTOCOL_VERSION, WorkerInfo("/models/tiny", 2048, 49152, "cpu", 4242), snapshot=SNAPSHOT),
    Status(PROTOCOL_VERSION, load_error="OSError: no such file"),
    StepOutputs(OUTPUTS, USAGE, SNAPSHOT, [Rejection("r3", "model", "no such adapter")]),
    StepOutputs([], None, None),
    Fatal("RuntimeError: CUDA error"),
]


@pytest.mark.parametrize("message", TO_WORKER, ids=lambda m: type(m).__name__)
def test_messages_to_the_worker_round_trip(message):
    codec = Codec()
    assert codec.decode_to_worker(codec.encode(message)) == message


@pytest.mark.parametrize("message", TO_GATEWAY, ids=lambda m: type(m).__name__)
def test_messages_to_the_gateway_round_trip(message):
    codec = Codec()
    decoded = codec.decode_to_gateway(codec.encode(message))
    assert decoded == message
    if isinstance(message, StepOutputs) and message.snapshot is not None:
        # Types survive too, not just values: tier keys are Tiers, adapter keys tuples.
        assert all(isinstance(t, Tier) for t in decoded.snapshot.num_running)
        assert decoded.usage.requests[0].adapter_key == LORA
        assert isinstance(decoded.outputs[0].outputs[0].logprobs[0], TokenLogprob)


def test_a_message_for_the_other_side_is_a_protocol_error():
    codec = Codec()
    with pytest.raises(ProtocolError):
        codec.decode_to_worker(codec.encode(TO_GATEWAY[0]))
    with pytest.raises(ProtocolError):
        codec.decode_to_gateway(codec.encode(TO_WORKER[0]))


def test_a_frame_of_another_version_names_both_versions():
    # A version-999 Hello whose fields changed shape: it cannot decode as
    # ours, but its version still reads.
    frame = msgspec.msgpack.encode({"type": "hello", "protocol_version": 999, "session_id": 5, "nonce": "x"})
    with pytest.raises(ProtocolError) as err:
        Codec().decode_to_worker(frame)
    assert "999" in str(err.value) and f"this side {PROTOCOL_VERSION}" in str(err.value)


@pytest.mark.parametrize("frame", [b"\xc1 not msgpack", msgspec.msgpack.encode({"type": "hello", "session": 5}),
                                   msgspec.msgpack.encode({"protocol_version": PROTOCOL_VERSION, "x": 1})])
def test_a_malformed_frame_of_our_version_is_a_protocol_error(frame):
    with pytest.raises(ProtocolError) as err:
        Codec().decode_to_worker(frame)
    assert "mismatch" not in str(err.value)


@pytest.mark.parametrize("endpoint, local", [
    ("ipc:///run/loragw/worker-0.sock", True), ("inproc://outbox", True), ("tcp://127.0.0.1:7100", True),
    ("tcp://127.8.9.10:7100", True), ("tcp://localhost:7100", True), ("tcp://[::1]:7100", True),
    ("tcp://0.0.0.0:7100", False), ("tcp://*:7100", False), ("tcp://[::]:7100", False),
    ("tcp://10.0.0.5:7100", False), ("tcp://192.168.1.2:7100", False), ("tcp://worker.example.com:7100", False),
    ("tcp://eth0:7100", False), ("udp://127.0.0.1:7100", False), ("127.0.0.1:7100", False),
])
def test_is_local_endpoint(endpoint, local):
    assert is_local_endpoint(endpoint) is local


def test_listening_beyond_loopback_needs_a_secret():
    for secret in (None, ""):
        with pytest.raises(WorkerConfigError, match="secret"):
            check_listen("tcp://0.0.0.0:7100", secret)
    check_listen("tcp://0.0.0.0:7100", "s3cret")
    check_listen("tcp://127.0.0.1:7100", None)
    check_listen("ipc:///tmp/w.sock", None)


# ---- a real worker process, spoken to by hand -----------------------------------------

SECRET = "wire-test-secret"


class Peer:
    """A raw DEALER: a gateway that speaks the protocol by hand."""

    def __init__(self, context: zmq.Context, endpoint: str):
        self.codec = Codec()
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)
        self.received: list = []

    def send(self, message) -> None:
        self.socket.send(self.codec.encode(message))

    def hello(self, secret: str | None = SECRET, version: int = PROTOCOL_VERSION, session: str | None = None) -> None:
        self.send(Hello(version, session or uuid.uuid4().hex[:8], secret))

    def receive(self, timeout_s: float):
        """The next message, or None if none came within `timeout_s`."""
        if not self.socket.poll(int(timeout_s * 1000)):
            return None
        message = self.codec.decode_to_gateway(self.socket.recv())
        self.received.append(message)
        return message

    def until(self, predicate, timeout_s: float = 60.0, what: str = "a message"):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            message = self.receive(max(0.0, deadline - time.monotonic()))
            if message is not None and predicate(message):
                return message
        raise AssertionError(f"timed out waiting for {what}")

    def outputs_of(self, request_id: str) -> list[RequestOutput]:
        return [o for m in self.received if isinstance(m, StepOutputs) for o in m.outputs if o.request_id == request_id]

    def close(self) -> None:
        self.socket.close(linger=0)


@pytest.fixture(scope="module")
def worker(tiny_llama_dir, tmp_path_factory):
    """One worker process with a shared secret, on a Unix socket; yields its endpoint."""
    tmp = tmp_path_factory.mktemp("wire-worker")
    endpoint = f"ipc://{tmp}/worker.sock"
    config = EngineConfig.from_flat(model=str(tiny_llama_dir), num_kv_blocks=64, num_threads=1, max_loras=0)
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine.worker", "--listen", endpoint, "--config-json",
         msgspec.json.encode(config).decode(), "--log-level", "warning"],
        env={**os.environ, "LORAGW_WORKER_SECRET": SECRET}, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == f"loragw worker listening on {endpoint}"
        yield endpoint
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


@pytest.fixture
def peers(worker):
    context = zmq.Context()
    made: list[Peer] = []

    def make() -> Peer:
        made.append(Peer(context, worker))
        return made[-1]

    yield make
    for peer in made:
        peer.close()
    context.term()


def _session(make, session: str | None = None) -> Peer:
    """A peer with an open session on a worker whose model has loaded."""
    peer = make()
    peer.hello(session=session)
    peer.until(lambda m: isinstance(m, Status) and m.worker is not None, 120.0, "the model to load")
    return peer


def _long_request(request_id: str) -> AddRequest:
    params = SamplingParams(temperature=0.0, max_tokens=1500, min_tokens=1500)
    return AddRequest(request_id, [5, 6, 7, 8], params, Tier.STANDARD, None, None)


@pytest.mark.parametrize("frame", [
    Codec().encode(Hello(999, "gw-999", SECRET)),
    # A version-999 Hello with fields we do not know: decodable, or not.
    msgspec.msgpack.encode({"type": "hello", "protocol_version": 999, "session": "s", "secret": SECRET, "k": 1}),
    msgspec.msgpack.encode({"type": "hello", "protocol_version": 999, "session": {"id": 5}, "nonce": "x"}),
], ids=["hello", "extra-fields", "changed-fields"])
def test_a_hello_of_another_version_is_refused(peers, frame):
    peer = peers()
    peer.socket.send(frame)
    refused = peer.until(lambda m: True, what="an answer")
    assert isinstance(refused, Refused)
    assert "999" in refused.reason and f"this side {PROTOCOL_VERSION}" in refused.reason


def test_without_the_secret_a_peer_is_refused_and_its_requests_ignored(peers):
    intruders = [peers(), peers()]
    for intruder, secret in zip(intruders, [None, "not-the-secret"]):
        intruder.hello(secret=secret)
        refused = intruder.until(lambda m: True, what="an answer")
        assert isinstance(refused, Refused) and "secret" in refused.reason
        intruder.send(_long_request(f"intruder-{secret}"))
    # A gateway with the secret opens a session, runs a request and sees
    # only its own: the intruders' requests never entered the engine.
    gateway = _session(peers)
    assert gateway.received[0].protocol_version == PROTOCOL_VERSION
    gateway.send(AddRequest("mine", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4), Tier.STANDARD,
                            None, None))
    gateway.until(lambda m: isinstance(m, StepOutputs) and any(o.finished for o in m.outputs), what="its output")
    steps = [m for m in gateway.received if isinstance(m, StepOutputs)]
    assert {o.request_id for m in steps for o in m.outputs} == {"mine"}
    assert {r.request_id for m in steps if m.usage for r in m.usage.requests} == {"mine"}
    assert all(m.snapshot.num_requests <= 1 for m in steps)
    for intruder in intruders:
        assert intruder.receive(0.5) is None  # nothing after the Refused
        assert len(intruder.received) == 1


def test_a_reconnecting_gateway_takes_over_and_aborts_its_old_sockets_requests(peers):
    old = _session(peers, session="gw-restarting")
    old.send(_long_request("old-1"))
    old.until(lambda m: isinstance(m, StepOutputs) and old.outputs_of("old-1"), what="old-1 to run")
    new = _session(peers, session="gw-restarting")
    # The old session's request ends as aborted long before its 1500 tokens.
    new.until(lambda m: isinstance(m, StepOutputs) and any(o.request_id == "old-1" and o.finished
                                                           for o in m.outputs), what="old-1 to be aborted")
    (final,) = [o for o in old.outputs_of("old-1") + new.outputs_of("old-1") if o.finished]
    assert final.outputs[0].finish_reason == "abort"
    assert sum(len(c.token_ids) for o in old.outputs_of("old-1") + new.outputs_of("old-1") for c in o.outputs) < 1500
    # The old session's commands are now ignored, and the engine is idle.
    old.send(_long_request("old-2"))
    status = new.until(lambda m: isinstance(m, Status), what="a heartbeat")
    status = new.until(lambda m: isinstance(m, Status), what="a heartbeat")
    assert status.snapshot.num_requests == 0 and status.snapshot.kv_used_blocks == 0
    assert not new.outputs_of("old-2")


def test_two_gateways_share_a_worker_each_seeing_only_its_own_requests(peers):
    a, b = _session(peers), _session(peers)
    idle = b.until(lambda m: isinstance(m, Status) and m.snapshot.num_requests == 0, what="an idle worker")
    params = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=24)
    a.send(AddRequest("a-1", [5, 6, 7, 8], params, Tier.STANDARD, None, None))
    b.send(AddRequest("b-1", [9, 10, 11], params, Tier.STANDARD, None, None))
    for peer, mine in ((a, "a-1"), (b, "b-1")):
        peer.until(lambda m, p=peer, r=mine: any(o.finished for o in p.outputs_of(r)), what=f"{mine} to finish")
    # Each saw only its own request, complete.
    assert not a.outputs_of("b-1") and not b.outputs_of("a-1")
    for peer, mine in ((a, "a-1"), (b, "b-1")):
        assert sum(len(c.token_ids) for o in peer.outputs_of(mine) for c in o.outputs) == 24
    # Each step's busy time reached the gateways exactly once in all: the
    # usage each saw names only its own requests, and the shares add up to
    # the worker's own count of busy time.
    steps = {}
    for peer, mine in ((a, "a-1"), (b, "b-1")):
        for m in peer.received:
            if isinstance(m, StepOutputs) and m.usage is not None:
                assert {r.request_id for r in m.usage.requests} <= {mine}
                steps.setdefault(m.usage.step_id, 0)
                steps[m.usage.step_id] += m.usage.busy_time_us
    last = a.until(lambda m: isinstance(m, Status), what="a heartbeat").snapshot
    assert sum(steps.values()) == last.busy_time_us - idle.snapshot.busy_time_us > 0


def test_a_gateway_that_disappears_has_its_requests_aborted(peers):
    gone, stays = _session(peers), _session(peers)
    gone.send(_long_request("gone-1"))
    gone.until(lambda m: isinstance(m, StepOutputs) and gone.outputs_of("gone-1"), what="gone-1 to run")
    gone.close()
    # The worker notices at its next heartbeat to the closed socket and
    # frees the request long before its 1500 tokens.
    stays.until(lambda m: isinstance(m, Status) and m.snapshot.num_requests == 0
                and m.snapshot.kv_used_blocks == 0, 30.0, "gone-1 to be aborted")
