"""Local engine workers: `loragw serve --workers N` starts them, restarts the
ones that exit, and stops them with the gateway.

Each worker is `python -m engine.worker` listening on a Unix socket in a
private directory (0700), so no other user can reach it and no port is
taken. A worker that exits is reported to the fleet at once (its requests
end or move without waiting for the heartbeat to lapse) and started again
after a backoff that doubles up to `backoff_max_s`, reset once a worker has
stayed up for `_STABLE_S`. Workers stop with the gateway, however it
ended: each watches for its parent process to go away (`--parent-pid`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import msgspec

from engine.worker import EXIT_LOAD_FAILED

log = logging.getLogger(__name__)

_STABLE_S = 60.0
_STOP_GRACE_S = 10.0


@dataclass(frozen=True)
class LocalWorker:
    worker_id: str
    endpoint: str
    device: str | None  # "cuda:1", "cpu", or None for the engine's default


class LocalWorkers:
    def __init__(self, engine_config, count: int, *, devices: list[str] | None = None, backoff_s: float = 1.0,
                 backoff_max_s: float = 30.0, secret: str | None = None, log_level: str = "info",
                 niceness: int = 0, clock: Callable[[], float] = time.monotonic):
        if devices is not None and len(devices) != count:
            raise ValueError(f"{len(devices)} worker devices for {count} workers")
        self.engine_config = engine_config
        self._dir = Path(tempfile.mkdtemp(prefix="loragw-workers-"))
        os.chmod(self._dir, 0o700)
        self.workers = [LocalWorker(str(i), f"ipc://{self._dir}/worker-{i}.sock", devices[i] if devices else None)
                        for i in range(count)]
        self.backoff_s, self.backoff_max_s = backoff_s, backoff_max_s
        self.secret = secret
        self.log_level = log_level
        self.niceness = niceness  # how far below this process a CPU worker runs (engine/host_cpu.py)
        self.clock = clock
        self.on_exit: Callable[[str, int], None] = lambda worker_id, code: None
        self.restarts: dict[str, int] = {w.worker_id: 0 for w in self.workers}
        self._procs: dict[str, asyncio.subprocess.Process] = {}
        self._tasks: list[asyncio.Task] = []
        self._stopping = False

    @property
    def endpoints(self) -> dict[str, str]:
        return {w.worker_id: w.endpoint for w in self.workers}

    def pid(self, worker_id: str) -> int | None:
        proc = self._procs.get(worker_id)
        return proc.pid if proc is not None and proc.returncode is None else None

    async def start(self) -> None:
        for worker in self.workers:
            self._tasks.append(asyncio.create_task(self._supervise(worker), name=f"supervise-{worker.worker_id}"))

    async def stop(self) -> None:
        """SIGTERM every worker and wait for them together; SIGKILL those
        still running after the grace period."""
        self._stopping = True
        for task in self._tasks:  # no restart, no spawn from here on
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        procs = [p for p in self._procs.values() if p.returncode is None]
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.gather(*(p.wait() for p in procs)), _STOP_GRACE_S)
        except asyncio.TimeoutError:
            for proc in procs:
                if proc.returncode is None:
                    proc.kill()
            await asyncio.gather(*(p.wait() for p in procs))
        shutil.rmtree(self._dir, ignore_errors=True)  # the workers' socket files

    async def _supervise(self, worker: LocalWorker) -> None:
        delay = self.backoff_s
        while not self._stopping:
            started = self.clock()
            try:
                proc = await self._spawn(worker)
            except OSError as exc:
                log.error("worker %s could not be started (%s); retrying in %.1fs", worker.worker_id, exc, delay)
            else:
                self._procs[worker.worker_id] = proc
                code = await proc.wait()
                if self._stopping:
                    return
                log.error("worker %s exited with code %s; restarting in %.1fs", worker.worker_id, code, delay)
                self.on_exit(worker.worker_id, code)
                self.restarts[worker.worker_id] += 1
                if code == EXIT_LOAD_FAILED:
                    return  # its model cannot load: restarting would fail the same way
            if self.clock() - started >= _STABLE_S:
                delay = self.backoff_s
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.backoff_max_s)

    async def _spawn(self, worker: LocalWorker) -> asyncio.subprocess.Process:
        config, env = self.engine_config, dict(os.environ)
        if worker.device is not None:
            config, env = _pin_device(config, env, worker.device)
        if self.secret:
            env["LORAGW_WORKER_SECRET"] = self.secret
        argv = [sys.executable, "-m", "engine.worker", "--listen", worker.endpoint,
                "--config-json", msgspec.json.encode(config).decode(), "--log-level", self.log_level,
                "--parent-pid", str(os.getpid()), "--niceness", str(self.niceness)]
        return await asyncio.create_subprocess_exec(*argv, env=env, stdin=asyncio.subprocess.DEVNULL,
                                                    stdout=asyncio.subprocess.DEVNULL)


def _pin_device(config, env: dict, device: str):
    """One GPU per worker: the process sees only its own, as `cuda:0`."""
    if device.startswith("cuda"):
        _, _, index = device.partition(":")
        env["CUDA_VISIBLE_DEVICES"] = index or "0"
        return replace(config, device="cuda"), env
    return replace(config, device=device), env
