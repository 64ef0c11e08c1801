"""The gateway's side of one engine worker: a DEALER socket, the session,
and the requests in flight on it.

One task per worker reads everything the worker sends. A step's usage goes
to the meter's sinks before that step's outputs go to their requests'
mailboxes (engine/output_mailbox.py), so a request that finished was billed
for its last step by the time its reader sees it. The snapshot of the step
replaces the previous one; the router, admission and /metrics read it.

The worker is lost when it stops heartbeating for `heartbeat_timeout_s`,
sends Fatal, or its supervisor saw the process exit (`mark_lost`; what the
worker sent before it exited is still read, so its Fatal names the cause).
Every request in flight on it then ends with `WorkerLost`, and the connection
dials again: a restarted local worker, or a remote one that came back,
opens a fresh session.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from typing import Callable

import zmq
import zmq.asyncio

from engine.errors import EngineDeadError, ValidationError
from engine.output_mailbox import OutputMailbox
from engine.snapshot import EngineSnapshot
from engine.step_io import StepUsage
from engine.wire import (PROTOCOL_VERSION, Abort, AddRequest, Codec, Fatal, Hello, ProtocolError, Refused, Status,
                         StepOutputs, WorkerInfo, version_mismatch)

log = logging.getLogger(__name__)

# How long to wait before dialling a worker again after losing it, or after
# it refused the session (a wrong secret or version will not fix itself soon).
_REDIAL_S = 0.5
_REFUSED_REDIAL_S = 5.0
# After its process exited, how long frames the worker sent before it died
# are still read: the supervisor may see the exit before this side's socket
# has delivered them, and the Fatal among them says why its requests failed.
EXIT_DRAIN_S = 0.25


class WorkerLost(EngineDeadError):
    """The worker serving a request died, stopped heartbeating or was
    restarted; the request's engine state is gone with it."""


class WorkerState(str, enum.Enum):
    CONNECTING = "connecting"  # no answer to Hello yet
    LOADING = "loading"  # the model is loading
    READY = "ready"
    FAILED = "failed"  # the model failed to load
    REFUSED = "refused"  # the worker refused the session (version, secret)
    DOWN = "down"  # lost; dialling again


class WorkerConnection:
    def __init__(self, worker_id: str, endpoint: str, *, context: zmq.asyncio.Context, session: str,
                 on_usage: Callable[[StepUsage], None], secret: str | None = None,
                 heartbeat_timeout_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.worker_id = worker_id
        self.endpoint = endpoint
        self.context = context
        self.session = session
        self.secret = secret
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.clock = clock
        self._on_usage = on_usage
        self.state = WorkerState.CONNECTING
        self.info: WorkerInfo | None = None
        self.snapshot: EngineSnapshot | None = None
        self.problem: str | None = None  # why it is failed, refused or down
        self.sessions = 0  # sessions opened, so a test can tell a restart happened
        self.ever_ready = False  # a worker still loading for the first time is starting, not down
        self.in_flight: dict[str, OutputMailbox] = {}
        self._codec = Codec()
        self._socket: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task | None = None
        self._lost = asyncio.Event()
        self._exited = False  # `_lost` was set by mark_lost, not by what the worker sent

    @property
    def ready(self) -> bool:
        return self.state is WorkerState.READY

    def describe(self) -> str:
        """The worker's state for /health."""
        return self.state.value if self.problem is None else f"{self.state.value}: {self.problem}"

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"worker-{self.worker_id}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._fail_in_flight("the gateway is shutting down")
        self._close()

    # ---- requests -------------------------------------------------------------------

    def submit(self, request) -> OutputMailbox:
        """Send `request` (a gateway.engine_client.EngineRequest); its
        outputs, or the error that ends it, arrive in the returned mailbox."""
        if not self.ready or self._socket is None:
            raise WorkerLost(f"worker {self.worker_id} is {self.describe()}")
        mailbox = OutputMailbox()
        self.in_flight[request.request_id] = mailbox
        self._send(AddRequest(request.request_id, request.prompt_ids, request.params, request.tier,
                              request.adapter_key, request.cache_salt))
        return mailbox

    def abort(self, request_id: str) -> None:
        """Ask the worker to drop the request; its final output (finish
        reason "abort") still arrives and closes the mailbox."""
        if request_id in self.in_flight and self._socket is not None:
            self._send(Abort([request_id]))

    def mark_lost(self, reason: str) -> None:
        """The supervisor saw the worker's process exit: do not wait for
        the heartbeat to time out."""
        if not self._lost.is_set():  # a Fatal read first says more
            self.problem = reason
        self._exited = True
        self._lose()

    # ---- the session loop -------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            self._lost.clear()
            self._exited = False
            try:
                self._open()
                redial = await self._serve_session()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a bad frame or sink must not end the dialling
                log.exception("worker %s at %s: session failed", self.worker_id, self.endpoint)
                self.problem = f"{type(exc).__name__}: {exc}"
                self._set_down()
                redial = _REFUSED_REDIAL_S
            finally:
                self._close()
            await asyncio.sleep(redial)

    def _open(self) -> None:
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)  # never drop a worker's output: its request would wait forever
        self._socket = sock
        sock.connect(self.endpoint)
        self._send(Hello(PROTOCOL_VERSION, self.session, self.secret))

    def _close(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None

    async def _serve_session(self) -> float:
        """Read the worker until it is lost; returns how long to wait
        before dialling again."""
        last_heard = self.clock()
        poll_ms = int(min(self.heartbeat_timeout_s / 4, 0.25) * 1000)
        while not self._lost.is_set():
            if await self._socket.poll(timeout=poll_ms):
                while self._socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # drain what is queued
                    frame = await self._socket.recv()
                    last_heard = self.clock()
                    if not self._handle(frame):
                        return _REFUSED_REDIAL_S
            elif not self._lost.is_set() and self.clock() - last_heard > self.heartbeat_timeout_s:
                self.problem = f"no heartbeat for {self.heartbeat_timeout_s:g}s"
                break
        if self._exited:
            await self._read_what_was_sent()
        self._set_down()
        return _REDIAL_S

    async def _read_what_was_sent(self) -> None:
        deadline = time.monotonic() + EXIT_DRAIN_S  # real time, whatever clock the heartbeats use
        while (left := deadline - time.monotonic()) > 0 and await self._socket.poll(timeout=max(1, int(left * 1000))):
            if not self._handle(await self._socket.recv()):
                return

    def _handle(self, frame: bytes) -> bool:
        """Apply one message; False if the worker refused the session."""
        try:
            message = self._codec.decode_to_gateway(frame)
        except ProtocolError as exc:
            return self._refused(str(exc))
        if isinstance(message, StepOutputs):
            self._on_step(message)
        elif isinstance(message, Status):
            if message.protocol_version != PROTOCOL_VERSION:
                return self._refused(version_mismatch(message.protocol_version))
            self._on_status(message)
        elif isinstance(message, Refused):
            return self._refused(message.reason)
        elif isinstance(message, Fatal):
            self.problem = f"the worker stopped: {message.error}"
            self._lose()
        return True

    def _on_status(self, status: Status) -> None:
        if self._lost.is_set():
            return  # a heartbeat sent before the worker was lost must not undo it
        if self.state in (WorkerState.CONNECTING, WorkerState.DOWN):
            self.sessions += 1
            log.info("worker %s at %s: session open", self.worker_id, self.endpoint)
        # After the first, snapshots come with their step's usage
        # (StepOutputs): a heartbeat's may be a step ahead of the usage the
        # meter has, and billing settles by the snapshot's step count.
        self.info = status.worker
        if self.snapshot is None:
            self.snapshot = status.snapshot
        if status.worker is not None:
            self.state, self.problem = WorkerState.READY, None
            self.ever_ready = True
        elif status.load_error is not None:
            self.state, self.problem = WorkerState.FAILED, status.load_error
        else:
            self.state = WorkerState.LOADING

    def _on_step(self, step: StepOutputs) -> None:
        if step.usage is not None:
            self._on_usage(step.usage)
        if step.snapshot is not None:
            self.snapshot = step.snapshot
        for rejection in step.rejected:
            mailbox = self.in_flight.pop(rejection.request_id, None)
            if mailbox is not None:
                mailbox.put(ValidationError(rejection.param or "request", rejection.message))
        for out in step.outputs:
            mailbox = self.in_flight.get(out.request_id)
            if mailbox is None:
                continue  # its reader left and the worker confirms the abort
            if out.finished:
                del self.in_flight[out.request_id]
            mailbox.put(out)

    def _refused(self, reason: str) -> bool:
        log.error("worker %s at %s refused the session: %s", self.worker_id, self.endpoint, reason)
        self.state, self.problem = WorkerState.REFUSED, reason
        self._fail_in_flight(reason)
        self.snapshot = None
        return False

    def _lose(self) -> None:
        """Down from now: /health says so and nothing new is sent to it,
        while the session loop still reads what the worker sent last."""
        self._lost.set()
        if self.state is not WorkerState.REFUSED:
            self.state = WorkerState.DOWN

    def _set_down(self) -> None:
        if self.state is not WorkerState.REFUSED:
            log.warning("worker %s at %s lost: %s", self.worker_id, self.endpoint, self.problem)
            self.state = WorkerState.DOWN
        self.snapshot = None
        self._fail_in_flight(f"worker {self.worker_id} was lost: {self.problem}")

    def _fail_in_flight(self, reason: str) -> None:
        in_flight, self.in_flight = self.in_flight, {}
        for mailbox in in_flight.values():
            mailbox.put(WorkerLost(reason))

    def _send(self, message) -> None:
        # A DEALER queues up to its high-water mark while the peer is away,
        # so this never blocks the event loop; the Future completes at once.
        self._socket.send(self._codec.encode(message))
