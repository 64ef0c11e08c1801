"""The worker's engine thread: it loads the model, applies the gateways'
commands between steps, and publishes after each step one StepOutputs per
gateway session concerned (its outputs, rejections and share of the step's
usage, with the snapshot) to the I/O thread (engine/worker.py), which owns
the socket.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from typing import NamedTuple

import zmq

from engine.config import EngineConfig
from engine.errors import ValidationError
from engine.heap import freeze_startup_heap
from engine.request import Tier
from engine.snapshot import StepCounter, take_snapshot
from engine.usage_split import split_usage
from engine.wire import Abort, AddRequest, Codec, Fatal, Rejection, StepOutputs, WorkerInfo

log = logging.getLogger(__name__)

# Test-only (tests/gateway/workers/test_faults.py): a step that raises after
# this many steps, as a broken kernel would.
FAULT_AFTER_STEPS_ENV = "LORAGW_WORKER_FAULT_AFTER_STEPS"
OUTBOX = "inproc://loragw-worker-outbox"
BROADCAST = b""  # the outbox's peer for a message to every session
# Commands from the I/O thread to the engine thread, besides wire messages.
SESSION_OPEN = object()
SESSION_CLOSED = object()  # its requests are aborted


class Moved(NamedTuple):
    """A command: a gateway reconnected from a new socket (`to`); its old
    socket's requests are aborted, and the aborts reported on the new one."""

    to: bytes


class Refusal(NamedTuple):
    peer: bytes
    rejection: Rejection


class EngineLoop:
    """The engine thread: applies commands between steps, publishes a
    StepOutputs after each step that changed anything."""

    def __init__(self, config: EngineConfig, context: zmq.Context):
        self.config = config
        self.context = context
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.info: WorkerInfo | None = None
        self.load_error: str | None = None
        self.snapshot = None  # the latest EngineSnapshot; read by the I/O thread (one reference, swapped whole)
        self.failed = threading.Event()
        self.stopped = threading.Event()
        # Set by the I/O thread when a premium request comes in, cleared
        # before commands are applied: a step in flight may then be dropped
        # for it (EngineCore.step's `interrupt`).
        self.premium_waiting = threading.Event()
        self._counter = StepCounter()
        # Live request id -> the session (peer identity) that sent it.
        self._owner: dict[str, bytes] = {}
        # Open sessions, oldest first: the first gets what no session owns.
        self._peers: list[bytes] = []
        # Aborts change the engine's state outside a step. A gateway takes
        # snapshots from StepOutputs only (a heartbeat's is used once, when
        # its session opens), so after aborts every session is sent the new
        # one, or a session that opened before the abort of another
        # session's requests would count them as running for good.
        self._aborted = False

    def submit(self, peer: bytes, message) -> None:
        """From the I/O thread: a gateway's command, applied between steps."""
        self.commands.put((peer, message))
        if isinstance(message, AddRequest) and message.tier is Tier.PREMIUM:
            self.premium_waiting.set()

    def run(self) -> None:
        codec = Codec()
        outbox = self.context.socket(zmq.PUSH)
        outbox.setsockopt(zmq.SNDHWM, 0)
        outbox.connect(OUTBOX)
        try:
            engine = self._load()
            if engine is not None:
                self._serve(engine, outbox, codec)
        finally:
            outbox.close(linger=1000)
            self.stopped.set()

    def _load(self):
        from engine.builder import build_llm_engine

        try:
            engine = build_llm_engine(self.config)
        except Exception as exc:  # noqa: BLE001 - reported to every gateway that says Hello
            log.exception("model failed to load")
            self.load_error = f"{type(exc).__name__}: {exc}"
            return None
        self.snapshot = take_snapshot(engine, self._counter)
        self.info = WorkerInfo(model_dir=str(engine.model_dir), max_model_len=engine.max_model_len,
                               vocab_size=len(engine.tokenizer), device=str(engine.core.runner.device),
                               pid=os.getpid())
        frozen = freeze_startup_heap()  # a worker process's own heap: engine/heap.py
        log.info("worker ready: %s on %s (%d startup objects frozen)", engine.model_dir, self.info.device, frozen)
        return engine

    def _serve(self, engine, outbox, codec: Codec) -> None:
        usage = []
        engine.usage_sinks.append(usage.append)
        fault_after = int(os.environ.get(FAULT_AFTER_STEPS_ENV) or 0) or None
        while True:
            outputs, rejected = [], []
            self.premium_waiting.clear()  # what it announced is applied below
            if not self._apply_commands(engine, outputs, rejected, block=not engine.has_unfinished()):
                # The gateway hears of it at once, not after a heartbeat
                # timeout: what has delivered nothing yet moves to another worker.
                outbox.send_multipart([BROADCAST, codec.encode(Fatal("the worker is shutting down"))])
                engine.fail_all("the worker is shutting down")
                return
            if engine.has_unfinished():
                try:
                    if fault_after is not None and self._counter.steps >= fault_after:
                        raise RuntimeError(f"{FAULT_AFTER_STEPS_ENV}={fault_after}: an injected fault")
                    outputs += engine.step(interrupt=self.premium_waiting.is_set)
                except Exception as exc:  # noqa: BLE001 - the gateway must hear of it, then we exit
                    # Fatal alone: the gateway ends what has streamed and
                    # moves what has not to another worker.
                    log.exception("engine step failed")
                    outbox.send_multipart([BROADCAST, codec.encode(
                        Fatal(f"engine step failed: {type(exc).__name__}: {exc}"))])
                    self.failed.set()
                    return
            step_usage = usage.pop() if usage else None
            if step_usage is not None:
                self._counter.count(step_usage.busy_time_us)
            if outputs or rejected or step_usage is not None or self._aborted:
                self.snapshot = take_snapshot(engine, self._counter)
                self._publish(outbox, codec, outputs, rejected, step_usage, tell_all=self._aborted)
                self._aborted = False

    def _publish(self, outbox, codec: Codec, outputs: list, rejected: list, step_usage, *,
                 tell_all: bool = False) -> None:
        """One StepOutputs per session concerned: its outputs, rejections
        and share of the step's usage, with the snapshot; with `tell_all`,
        the snapshot alone to every other session too."""
        if self._peers:  # else no gateway is connected, and nobody is left to tell
            default = self._peers[0]
            usage = split_usage(step_usage, self._owner.get, default) if step_usage is not None else {}
            mine: dict[bytes, tuple[list, list]] = {}
            for out in outputs:
                mine.setdefault(self._owner.get(out.request_id, default), ([], []))[0].append(out)
            for refusal in rejected:
                mine.setdefault(refusal.peer, ([], []))[1].append(refusal.rejection)
            concerned = dict.fromkeys([*usage, *mine])
            for peer in concerned:
                outs, refused = mine.get(peer, ([], []))
                message = StepOutputs(outs, usage.get(peer), self.snapshot, refused)
                outbox.send_multipart([peer, codec.encode(message)])
            for peer in self._peers if tell_all else []:
                if peer not in concerned:
                    outbox.send_multipart([peer, codec.encode(StepOutputs([], None, self.snapshot, []))])
        for out in outputs:
            if out.finished:
                self._owner.pop(out.request_id, None)

    def _apply_commands(self, engine, outputs: list, rejected: list, *, block: bool) -> bool:
        """Apply queued commands; False once shutdown was asked for."""
        try:
            cmd = self.commands.get(timeout=0.05) if block else self.commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if cmd is None:
                return False
            peer, message = cmd
            if isinstance(message, AddRequest):
                self._add(engine, peer, message, rejected)
            elif isinstance(message, Abort):
                self._abort(engine, [r for r in message.request_ids if self._owner.get(r) == peer], outputs)
            elif message is SESSION_OPEN:
                self._peers.append(peer)
            elif message is SESSION_CLOSED or isinstance(message, Moved):
                orphans = [r for r, p in self._owner.items() if p == peer]
                if isinstance(message, Moved):
                    self._owner.update((r, message.to) for r in orphans)
                self._abort(engine, orphans, outputs)
                if peer in self._peers:
                    self._peers.remove(peer)
            try:
                cmd = self.commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, engine, peer: bytes, cmd: AddRequest, rejected: list) -> None:
        if cmd.request_id in self._owner:
            rejected.append(Refusal(peer, Rejection(cmd.request_id, "request_id",
                                                     f"duplicate request id {cmd.request_id!r}")))
            return
        try:
            engine.add_request(cmd.prompt_ids, cmd.params, request_id=cmd.request_id, tier=cmd.tier,
                               adapter_key=cmd.adapter_key, cache_salt=cmd.cache_salt)
        except ValidationError as exc:
            rejected.append(Refusal(peer, Rejection(cmd.request_id, exc.param, exc.message)))
            return
        except Exception as exc:  # noqa: BLE001 - one bad request must not take the worker down
            log.exception("add_request failed")
            rejected.append(Refusal(peer, Rejection(cmd.request_id, None, f"{type(exc).__name__}: {exc}")))
            return
        self._owner[cmd.request_id] = peer

    def _abort(self, engine, request_ids: list[str], outputs: list) -> None:
        self._aborted = self._aborted or bool(request_ids)
        for request_id in request_ids:
            out = engine.abort(request_id)
            if out is not None:
                outputs.append(out)  # its owner is forgotten once it is published
            else:
                self._owner.pop(request_id, None)
