"""Runs code in a fresh interpreter where `import triton` fails, as on a
CPU install without it: the modules that only a GPU needs Triton for must
import, and serve the CPU, all the same."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def assert_runs_without_triton(code: str) -> None:
    # None in sys.modules makes any later 'import triton' raise ImportError.
    prelude = "import sys\nsys.modules['triton'] = None\n"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", prelude + code], cwd=ROOT, env=env,
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
