"""Kernel calibrations kept per host (engine/model/calibration_cache.py): a
later process reads the first one's measurement, unless an input of it
changed; a damaged entry or an unwritable folder never stops a load."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import native
from engine import host_cpu
from engine.model import calibration_cache, cpu_linear, quant_limits, quant_linear

REPO = Path(__file__).parents[3]


@pytest.fixture
def kept(monkeypatch, tmp_path):
    """The cache switched on, in a folder of this test's own; the per-process
    caches of the limits cleared on the way in and out."""
    monkeypatch.setenv(calibration_cache.ENV_SWITCH, "1")
    monkeypatch.setenv("LORAGW_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(cpu_linear.ROWS_ENV, raising=False)
    monkeypatch.setenv(cpu_linear.PACK_ENV, "0")
    # Kept however busy the host is: the tests of that rule set it themselves.
    monkeypatch.setattr(calibration_cache, "QUIET_OTHERS_CORES", float("inf"))
    monkeypatch.setattr(calibration_cache, "MIN_WINDOW_S", 0.0)

    def clear():
        cpu_linear.row_limit.cache_clear()
        cpu_linear.packing_pays.cache_clear()
        quant_limits.row_limit.cache_clear()

    clear()
    yield tmp_path / "cache" / "calibration"
    clear()


def counting(*values):
    """A measurement that returns `values` one call at a time and fails
    past them: a test that expects no measurement gives none."""
    calls = []

    def measure():
        calls.append(1)
        assert len(calls) <= len(values), "measured again"
        return values[len(calls) - 1]

    return measure, calls


FACTS = {"limit": "a kernel", "dtype": "torch.float32", "threads": 2, "rows": [1, 4, 8]}


def test_the_first_measurement_is_kept_and_later_ones_read_it(kept):
    measure, calls = counting(8)
    first = calibration_cache.remembered(lambda: FACTS, int, measure)
    assert first == (8, None) and len(calls) == 1
    [entry] = kept.glob("*.json")
    saved = json.loads(entry.read_text())
    assert saved["value"] == 8 and saved["facts"] == FACTS and saved["format"] == calibration_cache.FORMAT
    assert not list(kept.glob(".*")), "no partial file is left behind"
    again = calibration_cache.remembered(lambda: FACTS, int, measure)
    assert again == (8, entry) and len(calls) == 1
    assert "kept in" in again.origin(0.0) and "calibrated in" in first.origin(0.0)


def test_other_facts_are_measured_apart(kept):
    measure, calls = counting(8, 32, True)
    assert calibration_cache.remembered(lambda: FACTS, int, measure).value == 8
    assert calibration_cache.remembered(lambda: {**FACTS, "threads": 1}, int, measure).value == 32
    assert calibration_cache.remembered(lambda: {"packing": "torch.float32"}, bool, measure).value is True
    assert len(calls) == 3 and len(list(kept.glob("*.json"))) == 3


@pytest.mark.parametrize("change", ["kernel build", "deciding code", "torch", "torch's instructions", "cpu",
                                    "cores", "wait policy", "no wait policy"])
def test_a_changed_input_measures_again(kept, monkeypatch, tmp_path, change):
    """What the key covers besides the caller's facts: the compiled kernels,
    the Python that decides, torch and its instructions, the CPU and the
    cores, the OpenMP wait policy."""
    builds, code = [tmp_path / "a.so", tmp_path / "b.so"], [tmp_path / "cpu_linear.py"]
    for path in (*builds, *code):
        path.write_bytes(b"built")
    monkeypatch.setattr(calibration_cache, "kernel_files", lambda: [str(builds[0]), str(builds[1]), None])
    monkeypatch.setattr(calibration_cache, "DECIDING_CODE", tuple(code))
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    measure, calls = counting(8, 16, 16)
    assert calibration_cache.remembered(lambda: FACTS, int, measure).value == 8
    if change == "kernel build":
        builds[1].write_bytes(b"built again")
    elif change == "deciding code":
        code[0].write_bytes(b"edited")
    elif change == "torch":
        monkeypatch.setattr(calibration_cache.torch, "__version__", torch.__version__ + "+other")
    elif change == "torch's instructions":
        monkeypatch.setattr(calibration_cache.torch.backends.cpu, "get_cpu_capability", lambda: "OTHER")
    elif change == "cpu":
        monkeypatch.setattr(calibration_cache.native, "cpu_fingerprint", lambda: "another model")
    elif change == "cores":
        monkeypatch.setattr(calibration_cache.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7, 8})
    elif change == "wait policy":
        monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    else:  # libgomp's default, which spins a while and then sleeps: neither of the two
        monkeypatch.delenv("OMP_WAIT_POLICY")
    assert calibration_cache.remembered(lambda: FACTS, int, measure) == (16, None)
    assert calibration_cache.remembered(lambda: FACTS, int, measure).kept_in is not None and len(calls) == 2


def test_the_deciding_code_is_the_modules_that_time_and_decide():
    """A file renamed or moved away would make every key fail to build, and
    then nothing would be kept on any host (logged, never raised)."""
    assert all(path.is_file() for path in calibration_cache.DECIDING_CODE)
    assert {path.name for path in calibration_cache.DECIDING_CODE} == {
        "cpu_linear.py", "quant_linear.py", "quant_limits.py", "calibration_cache.py", "__init__.py"}
    assert Path(native.__file__) in calibration_cache.DECIDING_CODE


def test_the_key_stands_for_the_compiled_kernels(kept):
    files = calibration_cache.kernel_files()
    assert len(files) == 2
    for path, kernel in zip(files, (cpu_linear.load_kernel(), quant_linear.load_kernel()), strict=True):
        assert (path is None) == (kernel is None)
        assert path is None or (Path(path).is_file() and Path(path).suffix == ".so")


@pytest.mark.parametrize(("kind", "damage"), [  # "KEY": the entry's right key
    (int, "not json {"), (int, "[]"), (int, {"value": 8}), (int, {"key": "another", "value": 8}),
    (int, {"key": "KEY", "value": "8"}), (int, {"key": "KEY", "value": True}), (int, {"key": "KEY", "value": -1}),
    (int, {"key": "KEY", "value": 8.0}), (bool, {"key": "KEY", "value": 1}), (bool, {"key": "KEY", "value": 0}),
])
def test_an_entry_that_cannot_be_trusted_is_measured_again_and_replaced(kept, caplog, kind, damage):
    key = calibration_cache.digest(FACTS)
    path = kept / f"{key[:32]}.json"
    path.parent.mkdir(parents=True)
    if isinstance(damage, dict) and damage.get("key") == "KEY":
        damage = {**damage, "key": key}
    path.write_text(damage if isinstance(damage, str) else json.dumps(damage))
    measured = {int: 16, bool: False}[kind]
    measure, calls = counting(measured)
    with caplog.at_level(logging.WARNING, logger=calibration_cache.__name__):
        assert calibration_cache.remembered(lambda: FACTS, kind, measure) == (measured, None)
    assert "ignoring the calibration entry" in caplog.text
    assert json.loads(path.read_text())["value"] is measured
    assert calibration_cache.remembered(lambda: FACTS, kind, measure) == (measured, path) and len(calls) == 1


def test_a_folder_that_cannot_be_written_leaves_the_measured_value(kept, monkeypatch, tmp_path, caplog):
    blocker = tmp_path / "a file"
    blocker.write_text("")
    monkeypatch.setenv("LORAGW_CACHE_DIR", str(blocker))
    measure, calls = counting(8, 8)
    with caplog.at_level(logging.WARNING, logger=calibration_cache.__name__):
        assert calibration_cache.remembered(lambda: FACTS, int, measure) == (8, None)
        assert calibration_cache.remembered(lambda: FACTS, int, measure) == (8, None)
    assert "cannot be kept" in caplog.text and "ignoring" not in caplog.text and len(calls) == 2


def test_what_others_used_is_the_host_busy_time_less_this_process(kept):
    start = calibration_cache.Sample(10.0, host_busy_ticks=1_000, own_ticks=300)
    # 0.5 s: the host's CPUs were busy 80 ticks (0.8 s), 30 of them ours.
    end = calibration_cache.Sample(10.5, host_busy_ticks=1_080, own_ticks=330)
    assert calibration_cache.others_cores(start, end, 100) == pytest.approx(1.0)
    assert calibration_cache.others_cores(start, end._replace(host_busy_ticks=1_020), 100) == 0.0  # tick rounding
    assert calibration_cache.others_cores(start, end._replace(host_busy_ticks=None), 100) is None
    own = host_cpu.own_ticks()
    assert own is None or (isinstance(own, int) and own >= 0)


def test_a_measurement_beside_a_busy_process_is_used_and_not_kept(kept, monkeypatch, caplog):
    monkeypatch.setattr(calibration_cache, "QUIET_OTHERS_CORES", 0.5)
    monkeypatch.setattr(calibration_cache, "MIN_WINDOW_S", 0.25)
    if host_cpu.busy_ticks() is None or host_cpu.own_ticks() is None:
        pytest.skip("the host does not report CPU time (/proc)")

    def measure_beside_a_spinning_process():
        subprocess.run([sys.executable, "-c", "import time\nend = time.time() + 0.6\nwhile time.time() < end: pass"],
                       check=True, timeout=60)
        return 8

    with caplog.at_level(logging.INFO, logger=calibration_cache.__name__):
        assert calibration_cache.remembered(lambda: FACTS, int, measure_beside_a_spinning_process) == (8, None)
    assert "not keeping the calibration" in caplog.text and not list(kept.glob("*.json"))
    monkeypatch.setattr(calibration_cache, "QUIET_OTHERS_CORES", float("inf"))
    monkeypatch.setattr(host_cpu, "busy_ticks", lambda: None)  # a host without /proc: kept
    measure, _ = counting(16)
    assert calibration_cache.remembered(lambda: FACTS, int, measure) == (16, None)
    assert json.loads(next(kept.glob("*.json")).read_text())["others_cores"] is None


def test_a_lock_held_too_long_is_not_waited_for(kept, monkeypatch, caplog):
    import fcntl

    monkeypatch.setattr(calibration_cache, "LOCK_WAIT_S", 0.0)
    path = kept / f"{calibration_cache.digest(FACTS)[:32]}.json"
    path.parent.mkdir(parents=True)
    measure, calls = counting(8)
    with open(path.with_suffix(".lock"), "a") as stuck:  # another open file: flock excludes it
        fcntl.flock(stuck, fcntl.LOCK_EX)
        with caplog.at_level(logging.WARNING, logger=calibration_cache.__name__):
            assert calibration_cache.remembered(lambda: FACTS, int, measure) == (8, None)
    assert "measuring without the lock" in caplog.text and len(calls) == 1
    assert calibration_cache.remembered(lambda: FACTS, int, measure) == (8, path)


def test_without_a_kernel_build_to_key_by_every_call_measures(kept, monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(calibration_cache, "kernel_files", lambda: [str(tmp_path / "gone.so")])
    measure, calls = counting(8, 16)
    with caplog.at_level(logging.WARNING, logger=calibration_cache.__name__):
        assert calibration_cache.remembered(lambda: FACTS, int, measure) == (8, None)
        assert calibration_cache.remembered(lambda: FACTS, int, measure) == (16, None)
    assert "kernel calibrations are not kept" in caplog.text and not kept.exists()


def test_switched_off_every_call_measures_and_nothing_is_kept(kept, monkeypatch):
    monkeypatch.setenv(calibration_cache.ENV_SWITCH, "0")
    measure, calls = counting(8, 16)

    def facts():
        raise AssertionError("the facts are not needed")

    assert calibration_cache.remembered(facts, int, measure) == (8, None)
    assert calibration_cache.remembered(facts, int, measure) == (16, None)
    assert not kept.exists()


def test_the_row_limit_and_packing_are_kept_and_the_environment_still_wins(kept, monkeypatch, caplog):
    if cpu_linear.load_kernel() is None or not cpu_linear.can_pack(torch.float32):
        pytest.skip("needs the C++ linear kernel and oneDNN packing")
    threads = torch.get_num_threads()
    timings = {1: (1.0, 2.0), 4: (1.0, 2.0), 8: (3.0, 2.0)}
    measured = []
    monkeypatch.setattr(cpu_linear, "measure", lambda *args: measured.append(args) or timings)
    assert cpu_linear.row_limit(torch.float32, threads) == 4 and len(measured) == 1
    cpu_linear.row_limit.cache_clear()  # as a new process would start
    with caplog.at_level(logging.INFO, logger=cpu_linear.__name__):
        assert cpu_linear.row_limit(torch.float32, threads) == 4 and len(measured) == 1
    assert "up to 4 rows in float32" in caplog.text and "kept in" in caplog.text
    cpu_linear.row_limit.cache_clear()
    monkeypatch.setenv(cpu_linear.ROWS_ENV, "9")
    assert cpu_linear.row_limit(torch.float32, threads) == 9

    # Whether packing pays: kept too; it is part of the limits' facts, since
    # their torch path multiplies by the packed copies where it pays.
    monkeypatch.delenv(cpu_linear.PACK_ENV)
    monkeypatch.delenv(cpu_linear.ROWS_ENV)
    pays, calls = counting(True)
    monkeypatch.setattr(cpu_linear, "packing_measured_to_pay", lambda dtype, threads: pays())
    cpu_linear.packing_pays.cache_clear()
    assert cpu_linear.packing_pays(torch.float32, threads) is True
    cpu_linear.packing_pays.cache_clear()
    assert cpu_linear.packing_pays(torch.float32, threads) is True and len(calls) == 1
    cpu_linear.row_limit.cache_clear()
    assert cpu_linear.row_limit(torch.float32, threads) == 4 and len(measured) == 2


def test_the_limits_of_other_kernels_and_options_are_kept_apart(kept, monkeypatch):
    """Each caller's facts name its kernel and the paths it is timed
    against: the formats, int8 activations, the head and the layers each
    get an entry of their own, and each is read back."""
    if quant_linear.load_kernel() is None:
        pytest.skip("needs the C++ quantized kernel")
    monkeypatch.setattr(cpu_linear, "measure", lambda *args, **kwargs: {1: (1.0, 2.0)})
    # Nothing is timed: small weights spare quantizing and packing 32 big ones.
    monkeypatch.setattr(cpu_linear, "calibration_weights", lambda dtype: [torch.randn(64, 64).to(dtype)] * 2)
    threads = torch.get_num_threads()
    head = quant_linear.quantize(torch.randn(300, 64), "q8_0")
    float_head = head.dequantize(torch.float32)

    def limits():
        cpu_linear.row_limit.cache_clear()
        quant_limits.row_limit.cache_clear()
        monkeypatch.setattr(quant_limits, "_head_limits", {})
        for fmt in ("int4", "q8_0"):
            for int8 in (False, True):
                quant_limits.row_limit(torch.float32, threads, beside_float=fmt, int8_activations=int8)
        for int8 in (False, True):
            head.int8_activations = int8
            quant_limits.head_row_limit(quant_linear.load_kernel(), head, float_head, cpu_linear.load_kernel())

    limits()
    entries = {path.name: json.loads(path.read_text())["facts"] for path in kept.glob("*.json")}
    assert len(entries) == 1 + 4 + 2  # the float kernel's limit, four layer limits, two head limits
    heads = [facts for facts in entries.values() if facts["shape"] == [300, 64]]
    assert sorted(facts["paths"]["int8_activations"] for facts in heads) == [False, True]
    assert all(facts["paths"]["float_limit"] == 1 for facts in heads)
    monkeypatch.setattr(cpu_linear, "measure", lambda *args, **kwargs: pytest.fail("measured again"))
    limits()
    assert len(list(kept.glob("*.json"))) == len(entries)


def test_a_second_process_reads_what_the_first_measured(tmp_path):
    """Two processes, the real measurement: the key is the same from one
    process to the next, and the second times nothing."""
    if cpu_linear.load_kernel() is None:
        pytest.skip("without the kernel nothing is measured (limit 0), so nothing is kept")
    script = ("import logging, sys, torch; logging.basicConfig(level=logging.INFO, stream=sys.stdout); "
              "from engine.model import calibration_cache, cpu_linear; "
              "calibration_cache.QUIET_OTHERS_CORES = float('inf'); "  # kept on a busy host too
              "print('LIMIT', cpu_linear.row_limit(torch.float32, torch.get_num_threads()))")
    env = {**os.environ, calibration_cache.ENV_SWITCH: "1", "LORAGW_CACHE_DIR": str(tmp_path),
           cpu_linear.PACK_ENV: "1"}
    env.pop(cpu_linear.ROWS_ENV, None)
    runs = [subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=300, check=True).stdout for _ in range(2)]
    limits = [line for run in runs for line in run.splitlines() if line.startswith("LIMIT")]
    assert len(limits) == 2 and limits[0] == limits[1]
    assert "calibrated in" in runs[0] and "kept in" not in runs[0]
    assert "kept in" in runs[1] and "calibrated in" not in runs[1]
    assert len(list((tmp_path / "calibration").glob("*.json"))) == 1


# Measures for a second, holding the entry's lock, and reports its own pid
# as the value: the processes that wait must report the one that measured.
MEASURE_WHILE_OTHERS_START = """
import os, sys, time
from engine.model import calibration_cache
calibration_cache.kernel_files()  # built or found now, not between "go" and the lock
calibration_cache.QUIET_OTHERS_CORES = float("inf")  # the sibling waiting on the lock is no load, but others may be
print("READY", flush=True)
sys.stdin.readline()
def measure():
    time.sleep(1.0)
    return os.getpid()
found = calibration_cache.remembered(lambda: {"limit": "a race"}, int, measure)
print("VALUE", found.value, "MEASURED", found.kept_in is None, "PID", os.getpid())
"""


def test_processes_that_start_together_measure_once_and_agree(tmp_path):
    env = {**os.environ, calibration_cache.ENV_SWITCH: "1", "LORAGW_CACHE_DIR": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", MEASURE_WHILE_OTHERS_START], cwd=REPO, env=env, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for _ in range(3)]
    try:
        for proc in procs:  # all imported, then all released at once
            assert proc.stdout.readline() == "READY\n"
        for proc in procs:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        outputs = [proc.communicate(timeout=120) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    for proc, (_, stderr) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, stderr
    reports = [stdout.split() for stdout, _ in outputs]
    values = {report[1] for report in reports}
    measured = [report[5] for report in reports if report[3] == "True"]
    assert len(values) == 1 and len(measured) == 1 and values == set(measured)
