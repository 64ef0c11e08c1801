"""One admitted request's life in the gateway, and who hears how it ended.

`RequestLifecycle` holds the request's admission ticket and its place in
`Gateway.in_flight` (which the drain waits on) until `close()`, which runs
exactly once whether the request finished, failed or its client left. On
close it builds a `RequestRecord` and hands it to every `RequestObserver`
on the gateway: billing writes it to the ledger, metrics count it.
"""

from __future__ import annotations

import abc
import datetime as dt
import logging
from dataclasses import dataclass

from engine.outputs import RequestMetrics, RequestOutput
from gateway.tenancy import Principal, Tier

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestRecord:
    request_id: str  # the engine request id: unique, the ledger's idempotency key
    tenant_id: str
    tenant: str
    key_id: str
    tier: Tier
    model: str  # as the client asked
    adapter: str | None  # adapter name, None for the base model
    adapter_version: int | None
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # stop, length, abort, client_disconnect or error
    started_at: dt.datetime  # wall clock, when the gateway admitted it
    ended_at: dt.datetime
    queue_time_s: float | None  # engine: arrival -> first scheduled
    ttft_s: float | None  # engine: arrival -> first token
    e2e_s: float  # gateway: admitted -> ended
    # The engine's timestamps (its own clock: only differences mean anything),
    # for time per output token and the trace's queue/prefill/decode spans.
    engine_metrics: RequestMetrics | None = None


class RequestObserver(abc.ABC):
    """Called on the event loop when a request ends. Must not block: queue
    slow work (a database write) rather than doing it here. An exception is
    logged and does not affect the request or the other observers."""

    def on_request_start(self, request_id: str, principal: Principal, adapter_key: tuple[str, int, str] | None,
                         adapter_owner: str | None) -> None:
        """Called once admission let the request in, before it reaches the
        engine. `adapter_owner` is the tenant that owns the adapter, as its
        grant said when the request was checked (None: a platform adapter,
        or the base model)."""

    @abc.abstractmethod
    def on_request_end(self, record: RequestRecord) -> None: ...


class RequestLifecycle:
    def __init__(self, gw, ticket, principal: Principal, *, request_id: str, model: str,
                 adapter_key: tuple[str, int, str] | None, adapter_owner: str | None, prompt_tokens: int):
        self.gw, self.ticket, self.principal = gw, ticket, principal
        self.request_id, self.model, self.adapter_key = request_id, model, adapter_key
        self.prompt_tokens = prompt_tokens
        self.last: RequestOutput | None = None
        # Outputs are deltas: a choice's finish reason comes once, in its own.
        self._finish_reasons: dict[int, str] = {}
        self.closed = False
        self._client_left = False
        self._server_aborted = False
        self._reported = False
        self._started_at = gw.wall_clock()
        self._t0 = gw.clock()
        gw.in_flight += 1
        for observer in gw.observers:
            observer.on_request_start(request_id, principal, adapter_key, adapter_owner)

    def saw(self, out: RequestOutput) -> RequestOutput:
        self.last = out
        self._finish_reasons.update((c.index, c.finish_reason) for c in out.outputs if c.finished)
        self.ticket.started(out.metrics.first_token_time if out.metrics is not None else None)
        if out.finished:
            # Report before the caller sends the last bytes: a client that
            # received the whole response is then sure to be in the ledger,
            # even if the process dies right after.
            self._report()
        return out

    def client_left(self) -> None:
        """The client hung up before the engine's first output: the request
        ends as a disconnect, not as an engine error."""
        self._client_left = True

    def server_aborted(self) -> None:
        """The gateway itself ended the request early (the stream deadline):
        it is recorded as an abort, not as the client leaving."""
        self._server_aborted = True

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.gw.in_flight -= 1
        self.ticket.release(completion_tokens=self._completion_tokens())
        self._report()

    def _completion_tokens(self) -> int | None:
        return None if self.last is None else self.last.num_output_tokens

    def _report(self) -> None:
        if self._reported:
            return
        self._reported = True
        record = self._record(self._completion_tokens() or 0)
        for observer in self.gw.observers:
            try:
                observer.on_request_end(record)
            except Exception:  # noqa: BLE001 - one observer's bug must not break the others
                log.exception("request observer %r failed", observer)

    def _finish_reason(self) -> str:
        last = self.last
        if last is None and self._client_left:
            return "client_disconnect"
        if last is None or last.error is not None:
            return "error"
        if not last.finished:
            # The gateway stops early when its client left, or at a deadline of its own.
            return "abort" if self._server_aborted else "client_disconnect"
        reasons = set(self._finish_reasons.values())
        for reason in ("error", "abort", "length"):
            if reason in reasons:
                return reason
        return "stop"

    def _record(self, completion_tokens: int) -> RequestRecord:
        last, tenant = self.last, self.principal.tenant
        metrics = last.metrics if last is not None else None
        name, version = (self.adapter_key[0], self.adapter_key[1]) if self.adapter_key else (None, None)
        return RequestRecord(
            request_id=self.request_id, tenant_id=tenant.id, tenant=tenant.name, key_id=self.principal.key_id,
            tier=tenant.tier, model=self.model, adapter=name, adapter_version=version,
            prompt_tokens=self.prompt_tokens, cached_prompt_tokens=last.num_cached_tokens if last else 0,
            completion_tokens=completion_tokens, finish_reason=self._finish_reason(),
            started_at=self._started_at, ended_at=self.gw.wall_clock(),
            queue_time_s=metrics.queue_time if metrics else None, ttft_s=metrics.ttft if metrics else None,
            e2e_s=self.gw.clock() - self._t0, engine_metrics=metrics)
