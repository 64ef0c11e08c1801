"""One request's undelivered output, between the engine thread and its reader.

The engine produces a delta per step whether or not anyone reads it. A
queue of deltas would grow with every step a slow reader falls behind; the
mailbox instead folds each new delta into the one still waiting
(`RequestOutput.add`), so it holds at most what the request produced since
its reader last looked: O(the request's output), however slow the reader.
The reader takes the whole merged delta at once. (vLLM's
`RequestOutputCollector` does the same for its streaming frontend.)

Every method runs on the event loop. The engine thread posts with
`loop.call_soon_threadsafe(mailbox.put, item)`, so the mailbox's state is
only ever touched by one thread and needs no lock.
"""

from __future__ import annotations

import asyncio

from engine.outputs import RequestOutput


class OutputMailbox:
    def __init__(self) -> None:
        self._pending: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        """Post the request's next delta, or the error that ends it."""
        if isinstance(item, BaseException):
            if self._error is None:
                self._error = item
        elif self._pending is None:
            self._pending = item
        else:
            self._pending.add(item)
        self._ready.set()

    def empty(self) -> bool:
        return not self._ready.is_set()

    async def get(self) -> RequestOutput | BaseException:
        """Everything posted since the last get, merged; once the outputs are
        taken, the error (again on every later call: nothing more will come)."""
        await self._ready.wait()
        if self._pending is not None:
            out, self._pending = self._pending, None
            if self._error is None:
                self._ready.clear()
            return out
        assert self._error is not None
        return self._error
