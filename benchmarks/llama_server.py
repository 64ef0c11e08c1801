"""llama.cpp's own `llama-server`: built once from the sources that the
llama-cpp-python sdist vendors, and run as a subprocess.

The binary is cached outside the repository, under
`~/.cache/loragw/llama-server/<version>/llama-server` (`$XDG_CACHE_HOME`
honoured), so a fresh checkout or a `git clean` does not rebuild it. The
build takes about five minutes on two cores:

    pip download --no-binary :all: --no-deps llama-cpp-python==VERSION -d SRC
    cmake -S SRC/vendor/llama.cpp -B build -DLLAMA_BUILD_SERVER=ON -DGGML_NATIVE=ON
          -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
          -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
    cmake --build build --target llama-server -j2

The server links its ggml and llama libraries statically (BUILD_SHARED_LIBS
off), so the one file is all that is kept.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from loadgen import _free_port, wait_until_ok

LLAMA_CPP_PYTHON_VERSION = "0.3.36"

CMAKE_FLAGS = ["-DLLAMA_BUILD_SERVER=ON", "-DGGML_NATIVE=ON", "-DCMAKE_BUILD_TYPE=Release",
               "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DBUILD_SHARED_LIBS=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"]


def cached_binary(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "loragw" / "llama-server" / version / "llama-server"


def ensure_llama_server(version: str = LLAMA_CPP_PYTHON_VERSION, *, jobs: int = 2) -> Path:
    """The cached llama-server of `version`, built first if it is missing."""
    target = cached_binary(version)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="llama-server-build-", dir=target.parent) as tmp:
        src = _download_sources(version, Path(tmp))
        build = Path(tmp) / "build"
        print(f"building llama-server {version} in {build} (about 5 minutes on 2 cores)", flush=True)
        t0 = time.monotonic()
        subprocess.run(["cmake", "-S", str(src), "-B", str(build), *CMAKE_FLAGS], check=True,
                       stdout=subprocess.DEVNULL)
        subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", f"-j{jobs}"], check=True,
                       stdout=subprocess.DEVNULL)
        print(f"built llama-server in {time.monotonic() - t0:.0f} s", flush=True)
        # Copied under a temporary name and renamed: a build killed half-way
        # never leaves a binary that looks finished.
        partial = target.with_suffix(".partial")
        shutil.copy2(build / "bin" / "llama-server", partial)
        os.replace(partial, target)
    return target


def _download_sources(version: str, into: Path) -> Path:
    """The unpacked sdist's vendored llama.cpp directory."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                    f"llama-cpp-python=={version}", "-d", str(into)], check=True, stdout=subprocess.DEVNULL)
    (sdist,) = into.glob("llama_cpp_python-*.tar.gz")
    with tarfile.open(sdist) as tar:
        tar.extractall(into, filter="data")
    return into / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"


class LlamaServerCrashed(RuntimeError):
    """llama-server was killed by a signal (a segfault) before it served."""


class LlamaServerProcess:
    """`llama-server` with `parallel` slots of `ctx_per_slot` tokens each.

    Without --kv-unified, llama-server splits --ctx-size evenly over the
    slots, so ctx_size = parallel * ctx_per_slot gives every slot the same
    window whatever the concurrency. Continuous batching is its default; it
    is named anyway so that the command line says what ran."""

    def __init__(self, binary: Path, gguf: Path, *, parallel: int, ctx_per_slot: int, threads: int,
                 extra_args: tuple[str, ...] = ()):
        self.port = _free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port),
                    "--parallel", str(parallel), "--ctx-size", str(parallel * ctx_per_slot),
                    "--cont-batching", "-t", str(threads), "--no-webui", *extra_args]
        self._log = tempfile.NamedTemporaryFile("w+", prefix="llama-server-", suffix=".log")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT)

    def log_tail(self, chars: int = 2000) -> str:
        self._log.flush()
        return Path(self._log.name).read_text(errors="replace")[-chars:]

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Returns once /health answers 200 (it answers 503 while the model
        loads); raises LlamaServerCrashed if a signal killed the server first."""
        try:
            wait_until_ok(self.proc, f"{self.base_url}/health", timeout, poll_s=0.25, what="llama-server",
                          log_tail=self.log_tail)
        except RuntimeError as exc:
            if self.proc.returncode is not None and self.proc.returncode < 0:
                raise LlamaServerCrashed(f"signal {-self.proc.returncode}: {exc}") from None
            raise

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()
