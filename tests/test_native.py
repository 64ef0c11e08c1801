"""How the C++ CPU kernels are kept and built (native/__init__.py): sources in
`csrc/` folders that ship with the package, never in Python strings, and a
cache name that follows their content."""

import concurrent.futures
import fnmatch
import importlib
import re
import sys
import threading
import time
import tomllib
from pathlib import Path

import pytest
import torch

import native
from adapters.ops import cpu_ops
from engine.attention import cpu_decode, cpu_prefill
from engine.model import cpu_elementwise, cpu_linear, quant_linear

ROOT = Path(__file__).parents[1]
KERNEL_PACKAGES = ("engine", "adapters", "native")
# An include directive, a namespace, torch's C++ API or a build from a
# string: C++ that is not in a C++ file.
EMBEDDED_CPP = re.compile(
    r"^\s*#\s*include\s*[<\"]|\bnamespace\s*\{|\btorch::|TORCH_CHECK\(|PYBIND11_MODULE\(|load_inline\(|cpp_sources\s*=",
    re.MULTILINE,
)


def test_no_python_module_embeds_cpp():
    offenders = [
        str(path.relative_to(ROOT))
        for package in KERNEL_PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if EMBEDDED_CPP.search(path.read_text())
    ]
    assert offenders == [], "C++ belongs in a csrc/ folder: " + ", ".join(offenders)


@pytest.mark.parametrize("module", [cpu_linear, cpu_decode, cpu_prefill, cpu_ops], ids=lambda m: m.__name__)
def test_every_kernel_builds_from_a_csrc_file(module):
    source = module._KERNEL.source
    assert source.is_file()
    assert source.parent.name == "csrc" and source.suffix == ".cpp"
    assert "PYBIND11_MODULE(TORCH_EXTENSION_NAME" in source.read_text()


def test_the_engine_builder_loads_every_kernel_at_once():
    """engine.builder.load_cpu_kernels imports the modules that make the
    kernels so that native.load_all builds them side by side; a kernel left
    off its list would still build, alone, on its first use."""
    from engine.builder import CPU_KERNEL_MODULES

    for name in CPU_KERNEL_MODULES:
        importlib.import_module(name)
    made = {kernel.source.resolve() for kernel in native._KERNELS}
    sources = {path.resolve() for package in KERNEL_PACKAGES for path in (ROOT / package).rglob("csrc/*.cpp")}
    assert sources and made == sources


def test_load_all_builds_the_kernels_side_by_side(monkeypatch):
    """Two builds at a time: each build of the six waits until another is
    under way beside it."""
    running, both = [], threading.Barrier(2, timeout=30)
    monkeypatch.setattr(native, "_KERNELS", [])  # the kernels made below join this list, not the real one
    kernels = [native.Kernel(f"loragw_test_{i}", ROOT / "absent.cpp", "test kernel", "LORAGW_TEST_SWITCH")
               for i in range(6)]
    assert native._KERNELS == kernels

    def build(prefix, source, what):
        running.append(prefix)
        both.wait()  # breaks (and raises here) unless a second build runs meanwhile
        return prefix

    monkeypatch.setattr(native, "build", build)
    native.load_all(2)
    assert sorted(running) == sorted(k.prefix for k in kernels)
    assert [k.load() for k in kernels] == [k.prefix for k in kernels]  # kept: not built again
    assert len(running) == 6


def test_every_csrc_file_ships_with_the_package():
    """Each file of a csrc/ folder matches a package-data glob of the package
    that holds it, so a non-editable install can build the kernels."""
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    files = [path for package in KERNEL_PACKAGES for path in (ROOT / package).rglob("csrc/*") if path.is_file()]
    assert len(files) >= 4  # three kernels and their shared header
    unshipped = []
    for path in files:
        rel = path.relative_to(ROOT)
        shipped = any(
            fnmatch.fnmatch(str(rel.relative_to(*package.split("."))), glob)
            for package, globs in package_data.items()
            if rel.is_relative_to(Path(*package.split(".")))
            for glob in globs
        )
        if not shipped:
            unshipped.append(str(rel))
    assert unshipped == []


@pytest.fixture
def shared_header(tmp_path, monkeypatch):
    """native/csrc/ made of one header, helpers.h, defining one()."""
    headers = tmp_path / "headers"
    headers.mkdir()
    header = headers / "helpers.h"
    header.write_text("inline int one() { return 1; }\n")
    monkeypatch.setattr(native, "HEADERS", headers)
    return header


def test_the_cache_key_follows_the_source_and_the_shared_headers(tmp_path, shared_header):
    source = tmp_path / "kernel.cpp"
    source.write_text('#include "helpers.h"\nint two() { return one() + 1; }\n')

    key = native.cache_key(source)
    assert native.cache_key(source) == key  # unchanged: the cached build is found

    source.write_text('#include "helpers.h"\nint two() { return one() * 2; }\n')
    assert native.cache_key(source) != key
    source.write_text('#include "helpers.h"\nint two() { return one() + 1; }\n')
    assert native.cache_key(source) == key

    shared_header.write_text("inline int one() { return 2 - 1; }\n")
    assert native.cache_key(source) != key


def test_a_kernels_own_headers_are_its_inputs(tmp_path, shared_header):
    """A header named after a kernel keys its build and is staged with it; a
    header beside it named otherwise is not its."""
    kernels = tmp_path / "csrc"
    kernels.mkdir()
    source = kernels / "kernel.cpp"
    source.write_text('#include "kernel_part.h"\nint three() { return two() + 1; }\n')
    part = kernels / "kernel_part.h"
    part.write_text('#include "helpers.h"\ninline int two() { return one() + 1; }\n')
    other = kernels / "other_part.h"
    other.write_text("inline int four() { return 4; }\n")

    assert native.inputs(source) == [source, part, shared_header]
    key = native.cache_key(source)
    other.write_text("inline int four() { return 2 + 2; }\n")
    assert native.cache_key(source) == key
    part.write_text('#include "helpers.h"\ninline int two() { return one() * 2; }\n')
    assert native.cache_key(source) != key

    build_dir = tmp_path / "build" / "src"
    native.stage(source, build_dir)
    assert sorted(path.name for path in build_dir.iterdir()) == ["helpers.h", "kernel.cpp", "kernel_part.h"]


def test_each_kernel_header_is_one_kernels_and_every_include_is_staged():
    """A kernel compiles from its staged inputs alone: each `#include "..."`
    in them names one of them (a misnamed header, or another kernel's, would
    fail the build, and the engine would fall back to torch with a warning),
    and each header beside the kernels is exactly one kernel's own."""
    sources = [path for package in KERNEL_PACKAGES for path in (ROOT / package).rglob("csrc/*.cpp")]
    claims: dict[Path, list[str]] = {}
    for source in sources:
        inputs = native.inputs(source)
        names = {path.name for path in inputs}
        for path in inputs:
            for included in re.findall(r'^\s*#\s*include\s*"([^"]+)"', path.read_text(), re.MULTILINE):
                assert included in names, f"{path.name} includes {included}, which {source.name} does not stage"
            if path.parent == source.parent and path.suffix == ".h":
                claims.setdefault(path, []).append(source.name)
    beside_kernels = {path for source in sources for path in source.parent.glob("*.h")}
    not_one = {path.name: claims.get(path, []) for path in beside_kernels if len(claims.get(path, [])) != 1}
    assert not_one == {}, "each header beside the kernels is one kernel's: " + str(not_one)
    assert len(beside_kernels) >= 9  # quant_linear's five, cpu_prefill's three, cpu_decode's one


def test_a_missing_source_leaves_torch(tmp_path, caplog):
    assert native.build("loragw_test_missing", tmp_path / "absent.cpp", "test kernel") is None
    assert "test kernel unavailable" in caplog.text


def test_a_second_checkout_stages_onto_the_first_ones_build(tmp_path, shared_header):
    """The same source from another path leaves the staged copies as they
    were (ninja then finds nothing to rebuild); a changed one replaces them."""
    first, second = tmp_path / "a" / "kernel.cpp", tmp_path / "b" / "kernel.cpp"
    for source in (first, second):
        source.parent.mkdir()
        source.write_text('#include "helpers.h"\nint two() { return one() + 1; }\n')
    build_dir = tmp_path / "build" / "src"

    staged = native.stage(first, build_dir)
    assert staged.read_text() == first.read_text()
    assert (build_dir / "helpers.h").read_text() == "inline int one() { return 1; }\n"
    written = {path.name: path.stat().st_mtime_ns for path in build_dir.iterdir()}

    assert native.stage(second, build_dir) == staged
    assert {path.name: path.stat().st_mtime_ns for path in build_dir.iterdir()} == written

    second.write_text('#include "helpers.h"\nint two() { return one() * 2; }\n')
    native.stage(second, build_dir)
    assert staged.read_text() == second.read_text()
    assert sorted(path.name for path in build_dir.iterdir()) == ["helpers.h", "kernel.cpp"]


def test_a_lock_left_by_a_killed_build_does_not_stall_the_next_one(tmp_path, monkeypatch):
    """torch's build lock is a file; a build killed midway leaves it, and
    torch would wait on it forever. Ours is an flock, gone with its process."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    source = tmp_path / "tiny.cpp"
    # pybind11 alone: the build gets the same flags and lock either way, and
    # torch/extension.h alone took about 17 s of the build's 22.
    source.write_text('#include <pybind11/pybind11.h>\n#include <cstdint>\n'
                      'int64_t one() { return 1; }\n'
                      'PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("one", &one); }\n')
    from torch.utils import cpp_extension

    name = f"loragw_test_stale_{native.cache_key(source)}"
    folder = Path(cpp_extension._get_build_directory(name, verbose=False))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "lock").touch()  # what a SIGKILL during a build leaves
    # On a thread, so that the old behaviour (waiting on the file forever)
    # fails the test instead of hanging the suite.
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    module = pool.submit(native.build, "loragw_test_stale", source, "test kernel").result(timeout=300)
    pool.shutdown(wait=False)
    assert module is not None and module.one() == 1
    assert not (folder / "lock").exists()

    # The build file torch wrote names no path of this environment that the
    # cache key leaves out: another environment's build of the same kernel
    # goes to another folder, instead of rewriting this one's command.
    named = re.findall(r"(?:-isystem |-I ?|-L)(/\S+)", (folder / "build.ninja").read_text())
    assert named and all(path in native.toolchain_paths().split() for path in named)


def test_the_cache_key_follows_the_toolchain(tmp_path, monkeypatch):
    source = tmp_path / "kernel.cpp"
    source.write_text("int two() { return 2; }\n")
    key = native.cache_key(source)
    monkeypatch.setattr(native, "toolchain_paths", lambda: "/elsewhere/.venv/lib/python3.11/site-packages/torch/include")
    assert native.cache_key(source) != key


def _other_threads_ran_during(call, tries: int = 20) -> bool:
    """Whether another Python thread ran while `call` did. The switch
    interval is set far past the test, so the calling thread gives the GIL
    up only where something releases it; the other thread counts, then
    hands the GIL straight back (time.sleep(0) releases it)."""
    count, stop = [0], threading.Event()

    def counter():
        while not stop.is_set():
            count[0] += 1
            time.sleep(0)

    interval = sys.getswitchinterval()
    thread = threading.Thread(target=counter, daemon=True)
    try:
        sys.setswitchinterval(100.0)
        thread.start()
        for _ in range(tries):
            before = count[0]
            call()
            if count[0] != before:
                return True
        return False
    finally:
        stop.set()
        if thread.is_alive():
            thread.join()
        sys.setswitchinterval(interval)


def _kernel_calls(name: str):
    """The kernel and one call of it, a millisecond or more of work, every
    tensor made beforehand (torch's own ops release the GIL, so a tensor made
    inside the call would let the other thread run whatever the kernel
    does). The call returns what the kernel returned."""
    gen = torch.Generator().manual_seed(0)
    if name in ("q4_1_linear", "skinny_linear"):
        x, weight = torch.randn(8, 2048, generator=gen), torch.randn(4096, 2048, generator=gen)
        out = torch.empty(8, 4096)
        if name == "skinny_linear":
            return cpu_linear.load_kernel(), lambda k: k.skinny_linear(x, weight, None, out)
        q41 = quant_linear.quantize_q4_1(weight)
        return quant_linear.load_kernel(), lambda k: k.q4_1_linear(x, q41.q, q41.dm, None, out, False, 0, 0, 0, 0, [])
    wide = torch.randn(2048, 4096, generator=gen)
    if name == "rms_norm":
        weight, out = torch.ones(4096), torch.empty(2048, 4096)
        return cpu_elementwise.load_kernel(), lambda k: k.rms_norm(wide, None, weight, 1e-6, out, 0)
    out = torch.empty(2048, 2048)
    return cpu_elementwise.load_kernel(), lambda k: k.silu_mul(wide, out, None, 0)


def test_the_gil_check_tells_a_held_gil_from_a_released_one():
    """Pure Python holds the GIL throughout (no switch is due); time.sleep
    releases it."""
    assert not _other_threads_ran_during(lambda: sum(range(200_000)), tries=3)
    assert _other_threads_ran_during(lambda: time.sleep(0.002))


@pytest.mark.parametrize("name", ["q4_1_linear", "skinny_linear", "rms_norm", "silu_mul"])
def test_a_kernel_call_lets_other_python_threads_run(name):
    """The kernels run without the GIL, as torch's own ops do: a worker's
    I/O thread (heartbeats, outputs) and an embedded engine's event loop
    keep running beside a step's kernels."""
    kernel, call = _kernel_calls(name)
    if kernel is None:
        pytest.skip("the kernel cannot be built here")
    assert call(kernel) is not False  # it did the work (the linears say so)
    assert _other_threads_ran_during(lambda: call(kernel))


# Every m.def of a kernel module: the Python name and what it binds.
BINDING = re.compile(r'm\.def\("(\w+)",\s*([^;]*?)\);', re.DOTALL)
# The bound C++ function: inside torch's wrapper, or by address.
BOUND = re.compile(r"(?:wrap_pybind_function(?:_no_gil)?\(|&)(\w+)")
# What answers a question about the build and takes no tensors.
MAY_HOLD_THE_GIL = {"uses_amx", "int8_activations_built", "q4_1_interleaves", "q4_1_panel_min_rows", "has_bfloat16",
                    "bf16_tiles_on_one_thread", "interleaved_on_one_thread"}
KNOWN_KERNELS = {"decode_attention", "prefill_attention", "q4_1_linear", "q8_0_linear", "int8_linear",
                 "skinny_linear", "rms_norm", "rotary", "silu_mul", "lora_apply"}


def test_every_kernel_binding_releases_the_gil():
    """The same rule for every kernel, including those the test above does
    not call: each binding releases the GIL (torch's no-GIL wrapper, or
    pybind11's release guard), but for the few that only describe the build."""
    found, held = set(), []
    for path in sorted(p for package in KERNEL_PACKAGES for p in (ROOT / package).rglob("csrc/*.cpp")):
        text = path.read_text()
        guard = re.search(r"(\w+)\s*=\s*py::call_guard<py::gil_scoped_release>\(\)", text)
        for name, rest in BINDING.findall(text):
            bound = BOUND.search(rest)
            found.add(name)
            released = "wrap_pybind_function_no_gil(" in rest or (
                guard is not None and re.search(rf",\s*{guard.group(1)}\s*$", rest) is not None)
            if not released and name not in MAY_HOLD_THE_GIL:
                held.append(f"{path.name}: {name} ({bound.group(1) if bound else rest})")
    assert KNOWN_KERNELS <= found, KNOWN_KERNELS - found
    assert held == []
