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

from engine.model import calibration_cache, cpu_linear, quant_linear

REPO = Path(__file__).parents[3]


@pytest.fixture
def kept(monkeypatch, tmp_path):
    """The cache switched on, in a folder of this test's own; the per-process
    caches of the limits cleared on the way in and out."""
    monkeypatch.setenv(calibration_cache.ENV_SWITCH, "1")
    monkeypatch.setenv("LORAGW_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(cpu_linear.ROWS_ENV, raising=False)
    monkeypatch.setenv(cpu_linear.PACK_ENV, "0")

    def clear():
        cpu_linear.row_limit.cache_clear()
        cpu_linear.packing_pays.cache_clear()
        quant_linear.row_limit.cache_clear()

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


@pytest.mark.parametrize("change", ["kernel source", "torch", "threads sleep"])
def test_a_changed_input_measures_again(kept, monkeypatch, tmp_path, change):
    """What the key covers besides the caller's facts: the kernels' sources
    (and so their build keys), torch's version, the OpenMP wait policy."""
    sources = []
    for source in calibration_cache.KERNEL_SOURCES:
        sources.append(tmp_path / source.name)
        shutil.copy(source, sources[-1])
    monkeypatch.setattr(calibration_cache, "KERNEL_SOURCES", tuple(sources))
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    measure, calls = counting(8, 16, 16)
    assert calibration_cache.remembered(lambda: FACTS, int, measure).value == 8
    if change == "kernel source":
        sources[1].write_text(sources[1].read_text() + "\n// changed\n")
    elif change == "torch":
        monkeypatch.setattr(calibration_cache.torch, "__version__", torch.__version__ + "+other")
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert calibration_cache.remembered(lambda: FACTS, int, measure) == (16, None)
    assert calibration_cache.remembered(lambda: FACTS, int, measure).kept_in is not None and len(calls) == 2


def test_a_process_that_kept_its_value_first_wins(kept):
    """Two processes measuring at once: the one that publishes second takes
    the first one's value, so both run the same paths."""
    other, _ = counting(64)

    def measure_while_another_publishes():
        calibration_cache.remembered(lambda: FACTS, int, other)
        return 32

    found = calibration_cache.remembered(lambda: FACTS, int, measure_while_another_publishes)
    assert found.value == 64 and found.kept_in is not None
    assert json.loads(found.kept_in.read_text())["value"] == 64


@pytest.mark.parametrize("damage", [  # "KEY": the entry's right key
    "not json {", "[]", {"value": 8}, {"key": "another", "value": 8}, {"key": "KEY", "value": "8"},
    {"key": "KEY", "value": True}, {"key": "KEY", "value": -1}, {"key": "KEY", "value": 8.0},
])
def test_an_entry_that_cannot_be_trusted_is_measured_again_and_replaced(kept, caplog, damage):
    key = calibration_cache.digest(FACTS)
    path = kept / f"{key[:32]}.json"
    path.parent.mkdir(parents=True)
    if isinstance(damage, dict) and damage.get("key") == "KEY":
        damage = {**damage, "key": key}
    path.write_text(damage if isinstance(damage, str) else json.dumps(damage))
    measure, calls = counting(16)
    with caplog.at_level(logging.WARNING, logger=calibration_cache.__name__):
        assert calibration_cache.remembered(lambda: FACTS, int, measure) == (16, None)
    assert "ignoring the calibration entry" in caplog.text
    assert json.loads(path.read_text())["value"] == 16
    assert calibration_cache.remembered(lambda: FACTS, int, measure) == (16, path) and len(calls) == 1


def test_a_folder_that_cannot_be_written_leaves_the_measured_value(kept, monkeypatch, tmp_path, caplog):
    blocker = tmp_path / "a file"
    blocker.write_text("")
    monkeypatch.setenv("LORAGW_CACHE_DIR", str(blocker))
    measure, calls = counting(8, 8)
    with caplog.at_level(logging.WARNING, logger=calibration_cache.__name__):
        assert calibration_cache.remembered(lambda: FACTS, int, measure) == (8, None)
        assert calibration_cache.remembered(lambda: FACTS, int, measure) == (8, None)
    assert "could not keep a calibration" in caplog.text and len(calls) == 2


def test_without_the_kernel_sources_to_key_by_every_call_measures(kept, monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(calibration_cache, "KERNEL_SOURCES", (tmp_path / "gone.cpp",))
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


def test_a_second_process_reads_what_the_first_measured(tmp_path):
    """Two processes, the real measurement: the key is the same from one
    process to the next, and the second times nothing."""
    script = ("import logging, sys, torch; logging.basicConfig(level=logging.INFO, stream=sys.stdout); "
              "from engine.model import cpu_linear; "
              "print('LIMIT', cpu_linear.row_limit(torch.float32, torch.get_num_threads()))")
    env = {**os.environ, calibration_cache.ENV_SWITCH: "1", "LORAGW_CACHE_DIR": str(tmp_path),
           cpu_linear.PACK_ENV: "1"}
    env.pop(cpu_linear.ROWS_ENV, None)
    runs = [subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=300, check=True).stdout for _ in range(2)]
    limits = [line for run in runs for line in run.splitlines() if line.startswith("LIMIT")]
    assert len(limits) == 2 and limits[0] == limits[1]
    if cpu_linear.load_kernel() is None:
        return  # no kernel: nothing is measured (limit 0), so nothing is kept
    assert "calibrated in" in runs[0] and "kept in" not in runs[0]
    assert "kept in" in runs[1] and "calibrated in" not in runs[1]
    assert len(list((tmp_path / "calibration").glob("*.json"))) == 1
