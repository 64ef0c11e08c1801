"""`--dtype auto` follows what the CPU computes in natively; the engine's
threads and priority; how busy the CPUs are."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine.builder import resolve_dtype
from engine.host_cpu import (ENV_SWITCH, GPU_HOST_THREADS, busy_ticks, cpu_fields, cpu_flags,
                             default_thread_wait_policy, engine_threads, has_native_bfloat16, own_ticks)

CPU = torch.device("cpu")


def test_cpu_flags_read_x86_and_arm_cpuinfo(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\n"
                   "flags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile\n"
                   "\nprocessor\t: 1\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nflags\t\t: fpu\n"
                   "bugs\t\t: spectre_v1\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n")
    assert cpu_flags(x86) == {"fpu", "avx2", "avx512f", "avx512_bf16", "amx_tile"}
    assert "bf16" in cpu_flags(arm)
    assert cpu_flags(tmp_path / "missing") == frozenset()
    assert cpu_fields(x86)["vendor_id"] == "GenuineIntel" and cpu_fields(x86)["cpu family"] == "6"
    assert "bugs" not in cpu_fields(x86)  # only the first processor's block is read
    assert cpu_fields(tmp_path / "missing") == {}


def test_native_bfloat16_needs_the_instructions_not_just_avx512():
    assert has_native_bfloat16(frozenset({"avx512f", "avx512_bf16"}), environ={})
    assert has_native_bfloat16(frozenset({"amx_bf16"}), environ={})
    assert has_native_bfloat16(frozenset({"asimd", "bf16"}), environ={})
    assert not has_native_bfloat16(frozenset({"avx2", "avx512f", "avx512bw"}), environ={})
    assert not has_native_bfloat16(frozenset(), environ={})


def test_the_switch_turns_native_bfloat16_off():
    assert not has_native_bfloat16(frozenset({"avx512_bf16"}), environ={ENV_SWITCH: "0"})


def test_auto_dtype_by_device_and_host():
    assert resolve_dtype("auto", CPU, native_bfloat16=True) == torch.bfloat16
    assert resolve_dtype("auto", CPU, native_bfloat16=False) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda"), native_bfloat16=False) == torch.bfloat16
    assert resolve_dtype("float32", CPU, native_bfloat16=True) == torch.float32
    assert resolve_dtype("bfloat16", CPU, native_bfloat16=False) == torch.bfloat16


def test_the_suite_pins_auto_to_float32():
    """tests/conftest.py: exactness against HF is float32 on every host."""
    assert resolve_dtype("auto", CPU) == torch.float32


def test_an_engine_beside_a_gpu_keeps_one_host_thread_unless_told():
    """On the CPU torch's default pool (one thread per core) stays; beside a
    GPU its spinning threads would only burn the host's cores."""
    assert engine_threads(None, "cpu") is None
    assert engine_threads(3, "cpu") == 3
    assert engine_threads(None, "cuda") == GPU_HOST_THREADS == 1
    assert engine_threads(8, "cuda") == 8


def test_thread_wait_policy_is_a_default_the_operator_can_override():
    environ = {}
    default_thread_wait_policy(environ)
    assert environ == {"OMP_WAIT_POLICY": "ACTIVE"}
    environ = {"OMP_WAIT_POLICY": "PASSIVE"}
    default_thread_wait_policy(environ)
    assert environ == {"OMP_WAIT_POLICY": "PASSIVE"}


def test_the_entry_points_set_the_policy_before_torch_loads(tmp_path):
    """A worker reads OMP_WAIT_POLICY when torch loads: `loragw` and the
    worker's own entry must not import torch before they set it."""
    import subprocess
    import sys

    code = ("import os, sys; os.environ.pop('OMP_WAIT_POLICY', None); import gateway.cli, engine.worker; "
            "assert 'torch' not in sys.modules; gateway.cli.default_thread_wait_policy(); "
            "import torch; print(os.environ['OMP_WAIT_POLICY'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ACTIVE"


LOWER_PRIORITY_PROBE = """
import os, sys, threading
from engine.host_cpu import lower_priority
from tests.niceness import niceness_of_threads

hold = threading.Event()
before = threading.Thread(target=hold.wait)
before.start()
start = os.getpriority(os.PRIO_PROCESS, 0)
lower_priority(int(sys.argv[1]))
after = threading.Thread(target=hold.wait)
after.start()
now = niceness_of_threads()
print(start, sorted(set(now.values())), len(now))
hold.set()
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux's /proc")
@pytest.mark.parametrize("niceness", [0, 3, 40])
def test_lower_priority_reaches_every_thread_before_and_after(niceness):
    """A worker's threads that exist when it lowers its priority, and those
    it starts later (torch's pool, the engine's), all run at the niceness
    added to the one it started with, up to Linux's 19."""
    out = subprocess.run([sys.executable, "-c", LOWER_PRIORITY_PROBE, str(niceness)], capture_output=True,
                         text=True, timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    start, now, threads = out.stdout.split()
    assert int(start) < 19 or niceness == 0, "the test runs too nice to see a change"
    assert now == f"[{min(19, int(start) + niceness)}]" and threads == "3"


@pytest.mark.parametrize("device, lowered", [("cpu", [5]), ("cuda:0", [])])
def test_a_supervised_worker_lowers_its_priority_on_the_cpu_only(monkeypatch, device, lowered):
    """Beside a GPU the worker's one host thread competes with no one, and
    it keeps the supervisor's niceness."""
    import msgspec

    from engine import worker
    from engine.config import EngineConfig

    calls = []
    monkeypatch.setattr(worker, "lower_priority", calls.append)
    monkeypatch.setattr(worker, "run_worker", lambda config, **kwargs: 0)
    config = msgspec.json.encode(EngineConfig.from_flat(device=device)).decode()
    assert worker.main(["--listen", "ipc:///tmp/unused.sock", "--config-json", config, "--niceness", "5"]) == 0
    assert calls == lowered


def test_the_cpu_time_readers_sum_the_busy_fields(tmp_path):
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text("cpu  100 2 30 5000 70 4 5 6 0 0\ncpu0 50 1 15 2500 35 2 2 3 0 0\n")
    assert busy_ticks(stat) == 100 + 2 + 30 + 4 + 5 + 6  # not idle, not iowait
    own = tmp_path / "self-stat"
    # The command name may hold spaces and parentheses; utime and stime are the 14th and 15th fields.
    own.write_text("4242 (a (b) c) S 1 4242 4242 0 -1 4194304 10 0 0 0 17 3 0 0 20 0 9 0 55 0 0\n")
    assert own_ticks(own) == 17 + 3
    for reader, damaged in ((busy_ticks, "cpu  1 2\n"), (own_ticks, "4242 (x) S 1\n")):
        stat.write_text(damaged)
        assert reader(stat) is None
    assert busy_ticks(tmp_path / "absent") is None and own_ticks(tmp_path / "absent") is None


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="the host has no /proc")
def test_the_cpu_time_readers_count_this_process_work():
    """0.3 s of this process's CPU shows in its own ticks, and in the host's
    busy ticks, which hold everyone's (to within the two counters' own
    rounding: they are sampled at the tick, each on its own)."""
    tick = os.sysconf("SC_CLK_TCK")
    busy0, own0 = busy_ticks(), own_ticks()
    assert busy0 is not None and own0 is not None
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
    own, busy = own_ticks() - own0, busy_ticks() - busy0
    assert own >= 0.2 * tick  # not more: the process's other threads count too
    assert busy >= own - 3
