"""Where the Triton kernel tests run, and a check that what only a GPU
needs Triton for imports without it.

KERNEL_DEVICE is CUDA on a machine with a GPU, else the CPU, where
tests/conftest.py has set TRITON_INTERPRET=1 before anything imports
triton, so the kernels run in the interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

KERNEL_DEVICE = torch.device(
    "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
)
ROOT = Path(__file__).resolve().parent.parent


def assert_runs_without_triton(code: str) -> None:
    """Runs `code` in a fresh interpreter where `import triton` fails, as on
    a CPU install without it."""
    # None in sys.modules makes any later 'import triton' raise ImportError.
    prelude = "import sys\nsys.modules['triton'] = None\n"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", prelude + code], cwd=ROOT, env=env,
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
