"""Clients that hang up, for the abort tests: raw sockets (so the test, not
an HTTP client's pool, decides when a connection closes), an observer that
counts the requests the gateway admitted and ended, and the checks that a
gateway holds nothing afterwards."""

from __future__ import annotations

import json
import socket
import struct
from urllib.parse import urlsplit

from billing.records import REQUEST, UsageRecord
from gateway.lifecycle import RequestObserver, RequestRecord
from tests.billing.live_helpers import ledger_records


def send_request(url: str, path: str, body: dict, key: str, *, request_id: str) -> socket.socket:
    """POST `body` as one HTTP/1.1 request on a fresh connection and return
    the socket, unread: closing it is the client hanging up."""
    parts = urlsplit(url)
    payload = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
            f"X-Request-Id: {request_id}\r\n\r\n").encode()
    sock = socket.create_connection((parts.hostname, parts.port), timeout=30)
    sock.sendall(head + payload)
    return sock


def hang_up(sock: socket.socket, *, reset: bool = False) -> None:
    """Close the connection: an orderly FIN, or with `reset` an RST (a
    client killed, or a proxy giving up), the two ways a server hears it."""
    if reset:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


class CountingObserver(RequestObserver):
    """Request ids the gateway admitted and ended, as it reports them."""

    def __init__(self):
        self.started: list[str] = []
        self.ended: list[RequestRecord] = []

    def on_request_start(self, request_id, principal, adapter_key, adapter_owner) -> None:
        self.started.append(request_id)

    def on_request_end(self, record: RequestRecord) -> None:
        self.ended.append(record)


def client_request_id(engine_request_id: str) -> str:
    """The X-Request-Id a client sent, from the engine request id
    `<x-request-id>-<32 hex>` the ledger keys on."""
    return engine_request_id.rsplit("-", 1)[0]


def request_records_by_client(db_url: str) -> dict[str, list[UsageRecord]]:
    """The ledger's request records, by the X-Request-Id their client sent."""
    by_client: dict[str, list[UsageRecord]] = {}
    for r in ledger_records(db_url):
        if r.kind == REQUEST:
            by_client.setdefault(client_request_id(r.request_id), []).append(r)
    return by_client


def engine_idle(gw) -> bool:
    """No sequence running or waiting, and no KV block in use (cached
    prefix blocks are free: evictable)."""
    stats = gw.engine.stats()
    return (not any(stats.num_running.values()) and not any(stats.num_waiting.values())
            and stats.kv_used_blocks == 0)


def admission_empty(gw) -> bool:
    """No request in flight, and no tier holding a queue slot or queued tokens."""
    return gw.in_flight == 0 and all(s["waiting"] == 0 and s["queued_tokens"] == 0
                                     for s in gw.admission.snapshot().values())
