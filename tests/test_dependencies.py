"""The dependency rules of docs/architecture.md, as tests.

The import-linter contracts in pyproject.toml are the rules: the parts
point one way (nothing imports gateway; adapters import nothing of the
engine's) and the engine's pure-Python core imports no torch. An import
graph cannot see that an import sits inside a function, so the core is also
imported for real, in a fresh interpreter where torch cannot be found.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = ROOT / "pyproject.toml"

# What STYLE.md and docs/architecture.md promise runs without torch: the
# scheduler and what it is driven by, and what the engine publishes.
CORE = {
    "engine.scheduler", "engine.premium_room", "engine.step_update", "engine.kv_cache_manager", "engine.block_pool",
    "engine.request", "engine.step_io", "engine.sampling_params", "engine.outputs", "engine.snapshot",
}

# Runs in a fresh interpreter: a finder first on sys.meta_path refuses
# torch, as on a host without it, then the named modules are imported.
IMPORT_WITHOUT_TORCH = """
import importlib, json, sys

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "torch":
            raise ModuleNotFoundError(f"No module named {name!r} (refused by the test)", name=name)
        return None

sys.meta_path.insert(0, NoTorch())
for name in sys.argv[1:]:
    importlib.import_module(name)
try:
    from engine import LLM  # the offline API needs torch: the refusal must bite here
    refused = None
except ModuleNotFoundError as exc:
    refused = exc.name
print(json.dumps({"torch_loaded": "torch" in sys.modules, "llm_refused": refused}))
"""


def _contracts() -> dict[str, dict]:
    config = tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]
    return {contract["id"]: contract for contract in config["contracts"]}


def _run(*args: str) -> subprocess.CompletedProcess:
    """`python args` on this checkout's packages, whatever is installed."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def test_the_contracts_state_the_rules():
    """Weakening a rule means editing this test too, not only the config."""
    contracts = _contracts()
    one_way = contracts["one-way"]
    assert one_way["type"] == "layers"
    # Top to bottom: each may import those below it, never those above.
    # `billing | engine` are independent: neither imports the other...
    assert one_way["layers"] == ["gateway", "migrations", "billing | engine", "adapters", "native"]
    # ...except that the meter reads the engine's published usage record.
    assert one_way["ignore_imports"] == ["billing.meter -> engine.step_io"]
    limits = contracts["kernels-under-their-limits"]
    assert limits["type"] == "layers" and limits["layers"] == ["engine.model.quant_limits", "engine.model.quant_linear"]
    no_torch = contracts["core-without-torch"]
    assert no_torch["type"] == "forbidden" and no_torch["forbidden_modules"] == ["torch"]
    assert CORE <= set(no_torch["source_modules"])


def test_import_contracts_are_kept():
    lint = _run("-c", "import sys; from importlinter.cli import lint_imports_command; "
                      "sys.exit(lint_imports_command())",
                "--config", str(PYPROJECT), "--no-cache", "--no-logo")
    assert lint.returncode == 0, lint.stdout + lint.stderr
    assert f"{len(_contracts())} kept, 0 broken" in lint.stdout


def test_core_imports_without_torch():
    """The `engine` package too: importing engine.scheduler imports it
    first, so its __init__ must resolve LLM lazily."""
    modules = sorted(_contracts()["core-without-torch"]["source_modules"])
    result = _run("-c", IMPORT_WITHOUT_TORCH, "engine", *modules)
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout)
    assert outcome == {"torch_loaded": False, "llm_refused": "torch"}

