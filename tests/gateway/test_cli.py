"""`loragw serve`: its flags, their LORAGW_* variables, and early failures.
(The running server is tested in test_shutdown.py.)"""

from __future__ import annotations

import argparse

from gateway.cli import _add_serve_parser, _serve_config, main
from gateway.config import GatewayConfig


def _serve_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    _add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_serve_flags_default_to_their_env_variables(monkeypatch):
    monkeypatch.setenv("LORAGW_PORT", "9123")
    monkeypatch.setenv("LORAGW_ADMIN_TOKEN", "from-env")
    monkeypatch.setenv("LORAGW_PREMIUM_RESERVED_FRACTION", "0.3")
    monkeypatch.setenv("LORAGW_DRAIN_TIMEOUT", "5")
    config = _serve_config(_serve_args(["--port", "9000", "--standard-max-waiting", "7"]))
    assert config.port == 9000  # a flag beats its variable
    assert config.host == "127.0.0.1"
    assert config.admin_token == "from-env"
    assert config.engine.premium_reserved_fraction == 0.3
    assert config.standard.max_waiting == 7 and config.drain_timeout_s == 5.0
    assert config.enable_tiers and config.engine.enable_tiers
    assert config.max_stream_seconds == GatewayConfig.max_stream_seconds == 600.0


def test_max_stream_seconds_flag_and_zero_for_no_limit(monkeypatch):
    monkeypatch.setenv("LORAGW_MAX_STREAM_SECONDS", "0")
    assert _serve_config(_serve_args([])).max_stream_seconds is None
    assert _serve_config(_serve_args(["--max-stream-seconds", "90"])).max_stream_seconds == 90.0


def test_no_tiers_turns_off_the_premium_reserve(monkeypatch):
    monkeypatch.setenv("LORAGW_NO_TIERS", "1")
    config = _serve_config(_serve_args([]))
    assert not config.enable_tiers and not config.engine.enable_tiers
    assert config.engine.premium_reserved_fraction == 0.0


def test_serve_reports_a_bad_model_path(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("LORAGW_DATA_DIR", str(tmp_path / "data"))
    assert main(["serve", "--model", str(tmp_path / "missing")]) == 1
    assert "error:" in capsys.readouterr().err


def test_serve_reports_a_bad_flag_value(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("LORAGW_DATA_DIR", str(tmp_path / "data"))
    assert main(["serve", "--premium-reserved-fraction", "1.5"]) == 1
    assert "premium_reserved_fraction" in capsys.readouterr().err
