"""The worker protocol: what crosses between a gateway and an engine worker.

ZeroMQ carries the messages (the worker binds a ROUTER socket, each gateway
connects a DEALER) and msgspec encodes them as MessagePack, as vLLM's engine
core does. One message is one ZeroMQ frame: a tagged struct, so either side
decodes a union of the messages it may receive.

A session opens with `Hello` (the protocol version and, for a worker that
listens beyond loopback, the shared secret); the worker answers `Status`, or
`Refused` and ignores that peer. After that:

  gateway -> worker   AddRequest (token ids, sampling with any grammar
                      spec, tier, adapter key, cache salt), Abort
  worker -> gateway   StepOutputs after every engine step: each changed
                      request's output as a delta, the step's usage for the
                      meter, and a fresh snapshot of the engine; Status as a
                      heartbeat; Fatal when the engine died (the process exits)

Everything is a plain value. The gateway never reads an engine otherwise.
`PROTOCOL_VERSION` changes whenever a message changes shape; a peer with
another version is refused with a message that names both.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

import msgspec

from engine.outputs import RequestOutput
from engine.request import AdapterKey, Tier
from engine.sampling_params import SamplingParams
from engine.snapshot import EngineSnapshot
from engine.step_io import StepUsage

# 2: SamplingParams gained `structured` (a grammar spec).
# 3: EngineSnapshot gained `waiting_adapters`.
# 4: EngineSnapshot gained the spec_decode_* counters.
PROTOCOL_VERSION = 4


class WorkerInfo(msgspec.Struct, frozen=True):
    """What a loaded worker serves, sent once it can take requests."""

    model_dir: str
    max_model_len: int
    vocab_size: int
    device: str
    pid: int


# ---- gateway -> worker ----------------------------------------------------------


class Hello(msgspec.Struct, tag="hello", frozen=True):
    protocol_version: int
    session: str  # the gateway's id for this connection, in the worker's logs
    secret: str | None = None


class AddRequest(msgspec.Struct, tag="add", frozen=True):
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    tier: Tier
    adapter_key: AdapterKey | None
    cache_salt: str | None


class Abort(msgspec.Struct, tag="abort", frozen=True):
    request_ids: list[str]


# ---- worker -> gateway ----------------------------------------------------------


class Refused(msgspec.Struct, tag="refused", frozen=True):
    reason: str
    protocol_version: int = PROTOCOL_VERSION


class Status(msgspec.Struct, tag="status", frozen=True):
    """The answer to Hello, and the heartbeat. `worker` is None while the
    model loads; `load_error` says why it never will."""

    protocol_version: int
    worker: WorkerInfo | None = None
    load_error: str | None = None
    snapshot: EngineSnapshot | None = None


class Rejection(msgspec.Struct, frozen=True):
    """An AddRequest the engine refused (a duplicate id, an adapter it cannot
    load): that request ends with this error, nothing else does."""

    request_id: str
    param: str | None
    message: str


class StepOutputs(msgspec.Struct, tag="step", frozen=True):
    outputs: list[RequestOutput]  # deltas, as RequestOutput documents
    usage: StepUsage | None  # None when no forward pass ran (only aborts were applied)
    snapshot: EngineSnapshot | None
    rejected: list[Rejection] = []


class Fatal(msgspec.Struct, tag="fatal", frozen=True):
    """The worker stops serving: its step loop failed (every request on it
    has ended with an error output) or it is shutting down; the process
    exits."""

    error: str


ToWorker = Hello | AddRequest | Abort
ToGateway = Refused | Status | StepOutputs | Fatal


class ProtocolError(Exception):
    """A frame that is not a message of this protocol version."""


class Codec:
    """Encoder and decoders, made once per socket owner (msgspec's encoders
    reuse a buffer, so one must not be shared between threads)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._to_worker = msgspec.msgpack.Decoder(ToWorker)
        self._to_gateway = msgspec.msgpack.Decoder(ToGateway)

    def encode(self, message: msgspec.Struct) -> bytes:
        return self._encoder.encode(message)

    def decode_to_worker(self, frame: bytes) -> Hello | AddRequest | Abort:
        return self._decode(self._to_worker, frame)

    def decode_to_gateway(self, frame: bytes) -> Refused | Status | StepOutputs | Fatal:
        return self._decode(self._to_gateway, frame)

    @staticmethod
    def _decode(decoder, frame: bytes):
        try:
            return decoder.decode(frame)
        except msgspec.DecodeError as exc:
            raise ProtocolError(_version_hint(frame) or f"not a protocol-{PROTOCOL_VERSION} message: {exc}") from exc


def _version_hint(frame: bytes) -> str | None:
    """For a frame of another protocol version, say so plainly: its struct
    may not decode at all, but its `protocol_version` field still reads."""
    try:
        raw = msgspec.msgpack.decode(frame)
    except msgspec.DecodeError:
        return None
    if isinstance(raw, dict) and isinstance(raw.get("protocol_version"), int):
        theirs = raw["protocol_version"]
        if theirs != PROTOCOL_VERSION:
            return version_mismatch(theirs)
    return None


def version_mismatch(theirs: int) -> str:
    return f"worker protocol version mismatch: the peer speaks version {theirs}, this side {PROTOCOL_VERSION}"


def is_local_endpoint(endpoint: str) -> bool:
    """True for a Unix socket (ipc://) or a TCP endpoint on a loopback
    address: those need no shared secret."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    parts = urlsplit(endpoint)
    if parts.scheme != "tcp" or not parts.hostname:
        return False
    if parts.hostname == "localhost":
        return True
    try:
        return ipaddress.ip_address(parts.hostname).is_loopback
    except ValueError:
        return False
