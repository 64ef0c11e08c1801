"""The engine behind an asyncio server.

The step loop runs in its own thread, so the event loop stays responsive
while the engine is saturated. The thread owns the LLMEngine outright: the
event loop only sends it commands through a queue and receives outputs
through per-request mailboxes, so no lock is ever held across a step. Each
step's output is a delta; a mailbox merges the deltas its reader has not
taken yet, so a slow reader costs O(its request's output), never a queue of
one entry per step.
If a step raises, every in-flight request ends with an EngineDeadError and
later requests are refused; nothing waits forever.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from dataclasses import dataclass
from typing import AsyncIterator, Hashable

from engine.errors import EngineDeadError
from engine.llm_engine import LLMEngine
from engine.output_mailbox import OutputMailbox
from engine.outputs import RequestOutput
from engine.request import Tier
from engine.sampling_params import SamplingParams
from engine.snapshot import EngineSnapshot, StepCounter, take_snapshot

log = logging.getLogger(__name__)


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    tier: Tier | str
    adapter: str | None
    adapter_key: Hashable | None
    cache_salt: str | None
    sink: OutputMailbox
    loop: asyncio.AbstractEventLoop


@dataclass
class _Abort:
    request_id: str


_STOP = object()


class AsyncEngine:
    def __init__(self, engine: LLMEngine, *, idle_wait_s: float = 0.05):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # Set when a premium request is queued, cleared before commands are
        # applied: a step in flight may be dropped for it (EngineCore.step).
        self._premium_waiting = threading.Event()
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, OutputMailbox]] = {}
        self._idle_wait_s = idle_wait_s
        self._ids = itertools.count()
        self._dead: BaseException | None = None
        # Taken by the engine thread after every step that ran; readers get
        # this reference, never the live scheduler (engine/snapshot.py).
        self._counter = StepCounter()
        engine.usage_sinks.append(lambda usage: self._counter.count(usage.busy_time_us))
        self.snapshot: EngineSnapshot = take_snapshot(engine, self._counter)
        self._thread = threading.Thread(target=self._loop, name="loragw-engine", daemon=True)
        self._thread.start()

    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        tier: Tier | str = Tier.STANDARD,
        adapter: str | None = None,
        adapter_key: Hashable | None = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's output as it advances, each a delta: what is
        new since the previous one (several engine steps' worth, merged, when
        the caller is slower than the engine). The last has `finished=True`.
        Leaving the iterator early aborts the request."""
        if self._dead is not None:
            raise EngineDeadError(f"engine is dead: {self._dead!r}")
        request_id = request_id or f"async-{next(self._ids)}"
        loop = asyncio.get_running_loop()
        sink = OutputMailbox()
        self._commands.put(_Add(request_id, prompt, params, tier, adapter, adapter_key, cache_salt, sink, loop))
        if tier == Tier.PREMIUM:
            self._premium_waiting.set()
        finished = False
        try:
            while True:
                item = await self._next(sink)
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    async def _next(self, sink: OutputMailbox):
        # Polling the thread's health closes the race where the loop dies just
        # after this request's command was queued: it then never answers.
        while True:
            try:
                return await asyncio.wait_for(sink.get(), timeout=1.0)
            except asyncio.TimeoutError:
                if sink.empty() and not self._thread.is_alive():
                    return EngineDeadError(f"engine is not running: {self._dead!r}")

    def shutdown(self, timeout: float | None = 5.0) -> None:
        self._commands.put(_STOP)
        self._thread.join(timeout)

    # ---- the engine thread ---------------------------------------------------

    def _loop(self) -> None:
        try:
            while True:
                busy = self.engine.has_unfinished()
                self._premium_waiting.clear()  # what it announced is applied below
                if not self._drain_commands(block=not busy):
                    return
                if self.engine.has_unfinished():
                    outputs = self.engine.step(interrupt=self._premium_waiting.is_set)
                    self.snapshot = take_snapshot(self.engine, self._counter)
                    for out in outputs:
                        self._deliver(out)
        except BaseException as exc:  # noqa: BLE001 - every in-flight request must hear of it
            log.exception("engine step loop failed")
            self._dead = exc
            self._fail_everything(exc)

    def _drain_commands(self, block: bool) -> bool:
        """Apply queued commands; False once shutdown was asked for."""
        try:
            cmd = self._commands.get(timeout=self._idle_wait_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if cmd is _STOP:
                self._fail_everything(EngineDeadError("engine shut down"))
                return False
            self._apply(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                # An abort frees blocks and an add queues work without a step.
                self.snapshot = take_snapshot(self.engine, self._counter)
                return True

    def _apply(self, cmd) -> None:
        if isinstance(cmd, _Add):
            try:
                self.engine.add_request(cmd.prompt, cmd.params, request_id=cmd.request_id, tier=cmd.tier,
                                        adapter=cmd.adapter, adapter_key=cmd.adapter_key,
                                        cache_salt=cmd.cache_salt)
            except Exception as exc:  # validation errors go back to the caller
                cmd.loop.call_soon_threadsafe(cmd.sink.put, exc)
                return
            self._sinks[cmd.request_id] = (cmd.loop, cmd.sink)
        elif isinstance(cmd, _Abort) and cmd.request_id in self._sinks:
            out = self.engine.abort(cmd.request_id)
            if out is not None:
                self._deliver(out)

    def _deliver(self, out: RequestOutput) -> None:
        target = self._sinks.get(out.request_id)
        if target is None:
            return
        if out.finished:
            del self._sinks[out.request_id]
        loop, sink = target
        loop.call_soon_threadsafe(sink.put, out)

    def _fail_everything(self, exc: BaseException) -> None:
        error = exc if isinstance(exc, EngineDeadError) else EngineDeadError(f"engine step failed: {exc!r}")
        try:
            self.engine.fail_all(str(error))
        except Exception:  # noqa: BLE001 - the sinks below must still be told
            log.exception("could not clean up after engine failure")
        for loop, sink in self._sinks.values():
            loop.call_soon_threadsafe(sink.put, error)
        self._sinks.clear()
        # Commands that arrived after the failure must not wait forever either.
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Add):
                cmd.loop.call_soon_threadsafe(cmd.sink.put, error)
