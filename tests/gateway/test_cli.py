"""`loragw serve`: its flags, their LORAGW_* variables, and early failures.
(The running server is tested in test_shutdown.py.)"""

from __future__ import annotations

import argparse

import pytest

from gateway.cli import _add_serve_parser, _serve_config, main
from gateway.config import ConfigError, GatewayConfig

TOKEN = "t" * 32


def _serve_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    _add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_serve_flags_default_to_their_env_variables(monkeypatch):
    monkeypatch.setenv("LORAGW_PORT", "9123")
    monkeypatch.setenv("LORAGW_ADMIN_TOKEN", "from-env-" + TOKEN)
    monkeypatch.setenv("LORAGW_PREMIUM_RESERVED_FRACTION", "0.3")
    monkeypatch.setenv("LORAGW_DRAIN_TIMEOUT", "5")
    config = _serve_config(_serve_args(["--port", "9000", "--standard-max-waiting", "7"]))
    assert config.port == 9000  # a flag beats its variable
    assert config.host == "127.0.0.1"
    assert config.admin_token == "from-env-" + TOKEN
    assert config.engine.premium_reserved_fraction == 0.3
    assert config.standard.max_waiting == 7 and config.drain_timeout_s == 5.0
    assert config.enable_tiers and config.engine.enable_tiers
    assert config.max_stream_seconds == GatewayConfig.max_stream_seconds == 600.0


def test_max_stream_seconds_flag_and_zero_for_no_limit(monkeypatch):
    monkeypatch.setenv("LORAGW_MAX_STREAM_SECONDS", "0")
    assert _serve_config(_serve_args([])).max_stream_seconds is None
    assert _serve_config(_serve_args(["--max-stream-seconds", "90"])).max_stream_seconds == 90.0


def test_edge_limit_flags_take_their_defaults_from_the_config(monkeypatch):
    from gateway.config import GatewayConfig

    defaults = GatewayConfig()
    config = _serve_config(_serve_args([]))
    assert (config.max_request_bytes, config.max_upload_bytes, config.max_header_bytes, config.prepare_threads) == (
        defaults.max_request_bytes, defaults.max_upload_bytes, defaults.max_header_bytes, defaults.prepare_threads)
    monkeypatch.setenv("LORAGW_MAX_HEADER_BYTES", "8192")
    config = _serve_config(_serve_args(["--max-request-bytes", "1000", "--prepare-threads", "2"]))
    assert (config.max_request_bytes, config.max_header_bytes, config.prepare_threads) == (1000, 8192, 2)


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


def test_admin_token_under_32_characters_is_refused_at_start(tmp_path, capsys, monkeypatch):
    """Finding 10d: any admin token was accepted, a one-letter one included."""
    monkeypatch.setenv("LORAGW_DATA_DIR", str(tmp_path / "data"))
    # A missing model too: were the token let through, serve would stop there, not serve forever.
    assert main(["serve", "--admin-token", TOKEN[:-1], "--model", str(tmp_path / "missing")]) == 1
    assert "at least 32" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="at least 32"):
        GatewayConfig(admin_token=TOKEN[:-1])
    assert GatewayConfig(admin_token=TOKEN).admin_token == TOKEN


def test_admin_token_file_keeps_the_token_out_of_argv(tmp_path, monkeypatch):
    monkeypatch.delenv("LORAGW_ADMIN_TOKEN", raising=False)
    path = tmp_path / "admin-token"
    path.write_text(TOKEN + "\n")
    assert _serve_config(_serve_args(["--admin-token-file", str(path)])).admin_token == TOKEN
    monkeypatch.setenv("LORAGW_ADMIN_TOKEN_FILE", str(path))
    assert _serve_config(_serve_args([])).admin_token == TOKEN


@pytest.mark.parametrize("content", ["", "\n", "short\n"])
def test_admin_token_file_empty_or_short_is_refused(tmp_path, capsys, monkeypatch, content):
    monkeypatch.setenv("LORAGW_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.delenv("LORAGW_ADMIN_TOKEN", raising=False)
    path = tmp_path / "admin-token"
    path.write_text(content)
    assert main(["serve", "--admin-token-file", str(path), "--model", str(tmp_path / "missing")]) == 1
    assert "admin token" in capsys.readouterr().err


def test_admin_token_given_twice_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("LORAGW_DATA_DIR", str(tmp_path / "data"))
    path = tmp_path / "admin-token"
    path.write_text(TOKEN)
    monkeypatch.setenv("LORAGW_ADMIN_TOKEN", TOKEN)
    assert main(["serve", "--admin-token-file", str(path), "--model", str(tmp_path / "missing")]) == 1
    assert "once" in capsys.readouterr().err
    monkeypatch.delenv("LORAGW_ADMIN_TOKEN")
    assert main(["serve", "--admin-token-file", str(tmp_path / "no-token-file"),
                 "--model", str(tmp_path / "missing")]) == 1
    assert "no-token-file" in capsys.readouterr().err


def test_metrics_port_and_demo_tenant_flags(monkeypatch):
    config = _serve_config(_serve_args([]))
    assert config.metrics_port is None and config.metrics_host == "127.0.0.1" and not config.demo_tenant
    monkeypatch.setenv("LORAGW_METRICS_PORT", "9464")
    monkeypatch.setenv("LORAGW_DEMO_TENANT", "1")
    config = _serve_config(_serve_args(["--metrics-host", "0.0.0.0"]))
    assert config.metrics_port == 9464 and config.metrics_host == "0.0.0.0" and config.demo_tenant


def test_auth_cache_flags_default_to_the_config_and_their_env_variables(monkeypatch):
    from gateway.config import GatewayConfig

    default = _serve_config(_serve_args([]))
    d = GatewayConfig()
    assert (default.auth_cache_ttl_s, default.auth_cache_stale_s, default.auth_cache_max_entries) == (
        d.auth_cache_ttl_s, d.auth_cache_stale_s, d.auth_cache_max_entries)
    monkeypatch.setenv("LORAGW_AUTH_CACHE_TTL", "2.5")
    config = _serve_config(_serve_args(["--auth-cache-stale", "0", "--auth-cache-size", "100"]))
    assert (config.auth_cache_ttl_s, config.auth_cache_stale_s, config.auth_cache_max_entries) == (2.5, 0.0, 100)
