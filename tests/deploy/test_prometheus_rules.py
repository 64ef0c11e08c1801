"""deploy/prometheus: the rules load (`promtool check rules`) and their unit
tests on synthetic series pass (`promtool test rules`); the dashboard is
valid JSON that only queries series the gateway exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from gateway.metrics import TTFT_BUCKETS

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed (Debian: apt-get install prometheus; .ci/run does)")


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], cwd=DEPLOY / "prometheus", capture_output=True, text=True, timeout=60)


@needs_promtool
def test_promtool_checks_the_rules():
    result = promtool("check", "rules", "recording_rules.yml", "alert_rules.yml")
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_promtool_rule_unit_tests_pass():
    result = promtool("test", "rules", "rules_test.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_alert_threshold_is_a_ttft_bucket_boundary():
    rules = (DEPLOY / "prometheus" / "recording_rules.yml").read_text()
    thresholds = {float(le) for le in re.findall(r'le="([0-9.]+)"', rules)}
    assert thresholds and thresholds <= set(TTFT_BUCKETS)


def test_the_dashboard_queries_only_exported_series():
    dashboard = json.loads((DEPLOY / "grafana" / "loragw.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert exprs
    names = {n for e in exprs for n in re.findall(r"\b(?:loragw:|tier:|tenant:)[a-z0-9_:]+", e)}
    root = Path(__file__).resolve().parents[2]
    # The gateway's own series, and the engine series it exports per worker.
    metrics = "".join((root / path).read_text() for path in ("gateway/metrics.py", "engine/snapshot_metrics.py"))
    recorded = (DEPLOY / "prometheus" / "recording_rules.yml").read_text()
    for name in names:
        base = re.sub(r"_(bucket|count|sum|total)$", "", name)
        assert base.removeprefix("loragw:") in metrics or name in recorded, name
