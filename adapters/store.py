"""File primitives of the registry: atomic writes and a cross-process lock
(blocking, or polled for coroutines).

Readers never lock: every file they read appears whole (temp file, fsync,
rename) or not at all. Writers take an exclusive `fcntl.flock` on one lock
file per registry, so two processes uploading under the same name cannot
both claim version N. flock needs a local filesystem (not NFS).
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path


def write_atomic(path: Path, data: bytes) -> None:
    """Publish `data` at `path` in one step: a crash leaves the old state
    (no file, or the previous content), never a partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def rename_atomic(src: Path, dst: Path) -> None:
    os.replace(src, dst)
    _fsync_dir(dst.parent)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive flock on `path` (created if missing) for the block.

    Each call opens its own file description, so the lock also excludes
    other threads of this process."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


@asynccontextmanager
async def exclusive_lock_async(path: Path, *, poll_s: float = 0.05) -> AsyncIterator[None]:
    """`exclusive_lock` for coroutines: the flock is polled, never waited
    for in flock() on a worker thread, since waiters parked there would take
    the default executor's few threads, which the holder itself needs."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:  # closing the file releases the lock
        while True:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                await asyncio.sleep(poll_s)
        yield
