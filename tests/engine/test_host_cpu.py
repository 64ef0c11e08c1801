"""`--dtype auto` follows what the CPU computes in natively."""

from __future__ import annotations

import torch

from engine.builder import resolve_dtype
from engine.host_cpu import (ENV_SWITCH, GPU_HOST_THREADS, cpu_flags, default_thread_wait_policy, engine_threads,
                             has_native_bfloat16)

CPU = torch.device("cpu")


def test_cpu_flags_read_x86_and_arm_cpuinfo(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile\n"
                   "\nprocessor\t: 1\nflags\t\t: fpu\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n")
    assert cpu_flags(x86) == {"fpu", "avx2", "avx512f", "avx512_bf16", "amx_tile"}
    assert "bf16" in cpu_flags(arm)
    assert cpu_flags(tmp_path / "missing") == frozenset()


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
