"""Building the engine's small C++ CPU kernels.

Each kernel is one C++ source file, in a `csrc/` folder beside the module
that calls it (engine/csrc/, adapters/ops/csrc/), with its Python bindings
at its end, and the headers beside it named after it, where it has parts too
large for one file (`quant_linear_*.h`, `cpu_prefill_*.h`,
`cpu_decode_tile.h`), which no other kernel reads. It is compiled on first
use by torch.utils.cpp_extension (which needs a C++ compiler and ninja) in
torch's extensions folder (TORCH_EXTENSIONS_DIR, by default
~/.cache/torch_extensions), from a copy of its inputs made there, and found
there by later processes. The cache name is keyed by the source, its own
headers, the shared headers of native/csrc/, the flags, the host CPU and the
torch and Python it compiles against: a changed source builds anew, the
kernels are built with -march=native, where a library is only valid on the
CPU it was built for, and each Python environment keeps its own builds.
Building takes ~30 s once per kernel, on one core: `load_all` builds the
kernels side by side (the engine builder calls it on the CPU).

Every kernel has a torch twin that serves when the build fails or its
environment switch is "0"; callers get None here and fall back.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

log = logging.getLogger(__name__)

CFLAGS = ["-O3", "-march=native", "-fopenmp"]
# The folder of vector_helpers.h, which every kernel includes: copied beside
# every kernel's source for its build, and part of every cache key.
HEADERS = Path(__file__).parent / "csrc"


def cpu_fingerprint() -> str:
    """The host CPU's model and flags."""
    text = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            text += "".join(line for line in f if line.startswith(("model name", "flags")))
    except OSError:
        pass
    return text


def threads_sleep() -> bool:
    """Whether idle OpenMP threads sleep between parallel regions
    (OMP_WAIT_POLICY=PASSIVE, which our benchmarks set so that a loaded host
    does not stall them; see benchmarks/throughput.py). Then every parallel
    region pays ~50 us to wake them, which is more than a small kernel call
    takes on one core; with spinning threads (libgomp's default between
    back-to-back regions) it is a few us. Kernels read this to run small
    calls on the calling thread."""
    return os.environ.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE"


def serial_below(size_when_threads_sleep: int) -> int:
    """The work size under which a kernel call stays on the calling thread:
    the given size where idle threads sleep, else 0 (always parallel). Read
    once when a kernel's user is made, not per call."""
    return size_when_threads_sleep if threads_sleep() else 0


def switched_off(env_switch: str) -> bool:
    return os.environ.get(env_switch, "1") == "0"


def toolchain_paths() -> str:
    """The paths of torch and Python that a build's command names: its
    include and library folders. They are the part of torch's build file
    that differs between two Python environments (two checkouts, each with
    its own venv), and ninja rebuilds when its command changes: with one
    build folder between them, each environment rebuilt every kernel the
    other had built last."""
    from torch.utils import cpp_extension

    return " ".join([*cpp_extension.include_paths(), *cpp_extension.library_paths(),
                     str(sysconfig.get_path("include", scheme="posix_prefix"))])


def inputs(source: Path) -> list[Path]:
    """The files a kernel is compiled from: its source, its own headers
    (`<stem>_*.h` beside it) and the shared headers."""
    return [source, *sorted(source.parent.glob(f"{source.stem}_*.h")), *sorted(HEADERS.glob("*.h"))]


def cache_key(source: Path) -> str:
    """What a kernel's cache name ends in: a digest of its inputs, the flags,
    the host CPU and the toolchain's paths."""
    digest = hashlib.sha256()
    for path in inputs(source):
        digest.update(path.read_bytes())
    digest.update((" ".join(CFLAGS) + cpu_fingerprint() + toolchain_paths()).encode())
    return digest.hexdigest()[:12]


def stage(source: Path, folder: Path) -> Path:
    """Copies the kernel's inputs into `folder` (only those that differ, each
    replaced whole) and returns the copied source. Compiled from there, the
    same source in two checkouts that share a Python environment makes the
    same build file, so neither rebuilds what the other built, as when
    torch's load_inline wrote the source into the build folder itself."""
    folder.mkdir(parents=True, exist_ok=True)
    for path in inputs(source):
        target, data = folder / path.name, path.read_bytes()
        if not target.is_file() or target.read_bytes() != data:
            partial = target.with_name(f".{target.name}.{os.getpid()}")
            partial.write_bytes(data)
            os.replace(partial, target)
    return folder / source.name


def build(prefix: str, source: Path, what: str):
    """The compiled extension module, or None (logged) when it cannot be built."""
    try:
        from torch.utils import cpp_extension

        name = f"{prefix}_{cache_key(source)}"
        # The folder that load() builds `name` in (TORCH_EXTENSIONS_DIR or
        # torch's default); the sources go beside the build.
        folder = Path(cpp_extension._get_build_directory(name, verbose=False))
        staged = stage(source, folder / "src")
        with _exclusive(folder):
            return cpp_extension.load(
                name=name, sources=[str(staged)], extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"], verbose=False,
            )
    except Exception as exc:  # noqa: BLE001 - any build failure means: use the torch twin
        log.warning("%s unavailable (%s); using the torch path", what, exc)
        return None


@contextlib.contextmanager
def _exclusive(folder: Path):
    """Hold the build folder against other processes of ours. torch's own
    lock is a file that a build killed midway (a worker stopped while it
    loads) leaves behind, and every later build of that kernel then waits
    on it forever. An flock dies with its process: whoever holds ours knows
    that no build is running, so a torch lock file still there is stale."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "loragw.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        stale = folder / "lock"
        if stale.exists():
            log.warning("removing %s, left by a build that did not finish", stale)
            stale.unlink(missing_ok=True)
        yield


# Every Kernel made so far, for load_all.
_KERNELS: list[Kernel] = []


class Kernel:
    """One C++ kernel: built (or found in torch's cache) on the first `load`,
    then kept for the life of the process."""

    def __init__(self, prefix: str, source: Path, what: str, env_switch: str):
        self.prefix, self.source, self.what, self.env_switch = prefix, source, what, env_switch
        _KERNELS.append(self)

    def load(self):
        """The extension module, or None where it cannot be had (switched
        off, no compiler, a build error): callers fall back to the torch twin."""
        if switched_off(self.env_switch):
            return None
        return self._cached_build()

    def build(self):
        """Builds now, bypassing the per-process cache."""
        return build(self.prefix, self.source, self.what)

    @functools.cache  # noqa: B019 - one Kernel per module, alive as long as the process
    def _cached_build(self):
        return self.build()


def load_all(workers: int) -> None:
    """Loads every kernel made so far, `workers` builds at a time. Each
    build compiles one source on one core: the six of a fresh checkout took
    164 s one after another on a 2-core host, and 85 s two at a time. Later
    `load` calls return what this loaded."""
    with ThreadPoolExecutor(max_workers=max(1, min(len(_KERNELS), workers))) as pool:
        list(pool.map(Kernel.load, _KERNELS))
