"""What the kernel calibrations come out at from one engine start to the
next, with the per-host cache (engine/model/calibration_cache.py) off and on.

Each start is a fresh process that builds the default engine (`LLM()`, the
bundled model, `--dtype auto`, idle threads spinning as `loragw serve` has
them) and reports the limits and the packing decision it logged. "off" times
them in every process, as every start did before the cache; "on" starts from
an empty cache folder, so its first start measures and keeps, and the later
ones read. Reported per mode: each calibration's value at every start (the
printout counts the distinct ones), how many entries each start read from
the cache, and the seconds from importing the engine (torch included) to a
ready one.

    python benchmarks/calibration_starts.py [--starts 5] [--out PATH]

A start takes 7 to 8 s on 2 cores once the model is converted and the
kernels built (the first `make serve` does both).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from machine import load_average, machine_facts, write_json

REPO = Path(__file__).resolve().parents[1]

# One engine start: the calibrations' log lines, as JSON on the last line.
START = r"""
import json, logging, re, time
lines = []
class Keep(logging.Handler):
    def emit(self, record):
        lines.append(record.getMessage())
logging.getLogger("engine.model.cpu_linear").addHandler(Keep())
logging.getLogger("engine.model.cpu_linear").setLevel(logging.INFO)
t0 = time.perf_counter()
from engine import LLM
LLM()
seconds = time.perf_counter() - t0
found = {}
for line in lines:
    limit = re.match(r"(.+?): up to (\d+) rows in (\w+) on (\d+) threads \((.*)\)$", line)
    packing = re.match(r"packed (\w+) weights on (\d+) threads: (on|off) \(.*?(kept in|calibrated in)", line)
    if limit:
        found[f"{limit[1]}, {limit[3]}"] = {"value": int(limit[2]), "kept": "kept in" in limit[5]}
    elif packing:
        found[f"packing, {packing[1]}"] = {"value": packing[3], "kept": packing[4] == "kept in"}
print(json.dumps({"seconds": seconds, "calibrations": found}))
"""


def start(cache_on: bool, cache_dir: Path) -> dict:
    env = {**os.environ, "OMP_WAIT_POLICY": "ACTIVE", "LORAGW_CPU_CALIBRATION_CACHE": "1" if cache_on else "0",
           "LORAGW_CACHE_DIR": str(cache_dir)}
    done = subprocess.run([sys.executable, "-c", START], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--starts", type=int, default=5)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "calibration_starts.json"))
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from engine.cache_dir import cache_root

    result = {"machine": machine_facts(), "load_before": load_average(), "starts": args.starts, "modes": {}}
    with tempfile.TemporaryDirectory() as folder:
        cache_dir = Path(folder)
        # The converted model is shared with the user's cache; the calibrations start empty.
        (cache_dir / "models").symlink_to(cache_root() / "models", target_is_directory=True)
        for mode in ("off", "on"):
            runs = [start(mode == "on", cache_dir) for _ in range(args.starts)]
            names = sorted({name for run in runs for name in run["calibrations"]})
            summary = {name: [run["calibrations"].get(name, {}).get("value") for run in runs] for name in names}
            kept = [sum(c["kept"] for c in run["calibrations"].values()) for run in runs]
            result["modes"][mode] = {"values": summary, "kept_per_start": kept,
                                     "seconds": [round(run["seconds"], 2) for run in runs]}
            print(f"cache {mode}:")
            for name, values in summary.items():
                print(f"  {name}: {values} ({len(set(map(str, values)))} distinct)")
            print(f"  read from the cache per start: {kept}; seconds to a ready engine: "
                  f"{result['modes'][mode]['seconds']}")
    result["load_after"] = load_average()
    print(f"load average {result['load_before']} -> {result['load_after']}")
    write_json(result, args.out)


if __name__ == "__main__":
    main()
