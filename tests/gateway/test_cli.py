"""`loragw serve`: its flags, their LORAGW_* variables, and early failures.
(The running server is tested in test_shutdown.py.)"""

from __future__ import annotations

import argparse
import os

import pytest

from engine.host_cpu import WORKER_NICENESS
from gateway.cli import _add_serve_parser, _serve_config, main
from gateway.config import ConfigError, GatewayConfig, TierLimits

TOKEN = "t" * 32


def _serve_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    _add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def _field(config, dotted: str):
    for name in dotted.split("."):
        config = getattr(config, name)
    return config


def test_every_flag_defaults_to_its_field_and_no_flag_is_declared_twice():
    """A parser default is the dataclass's value, never a copy of its own."""
    serve = _add_serve_parser(argparse.ArgumentParser().add_subparsers(dest="command"), environ={})
    defaults = GatewayConfig()
    generated = [a for a in serve._actions if "." in a.dest or hasattr(defaults, a.dest)]
    assert len(generated) > 60
    for action in generated:
        assert action.default == _field(defaults, action.dest), action.option_strings
    options = [o for a in serve._actions for o in a.option_strings]
    assert len(options) == len(set(options))


def test_serve_with_no_flags_behaves_as_before(monkeypatch):
    """The values `loragw serve` ran with before its flags were generated,
    written out: the serving tier policy differs from the offline engine's."""
    for name in [k for k in os.environ if k.startswith("LORAGW_")]:
        monkeypatch.delenv(name)
    config = _serve_config(_serve_args([]))
    engine = config.engine
    assert engine.cache.premium_reserved_fraction == 0.2
    assert engine.scheduler.max_standard_prefill_tokens == 128 and engine.scheduler.standard_prefill_cap_steps == 4096
    assert engine.num_threads is None  # the worker process gets every core
    assert engine.scheduler.enable_tiers and config.enable_tiers and engine.scheduler.premium_prefill_alone
    assert (engine.model, engine.dtype, engine.scheduler.max_model_len) == (None, "auto", None)
    assert (engine.scheduler.max_num_seqs, engine.scheduler.max_num_batched_tokens) == (128, 1024)
    assert (engine.cache.kv_cache_memory, engine.cache.num_kv_blocks, engine.cache.block_size) == (None, None, 16)
    assert (engine.lora.max_loras, engine.lora.max_lora_rank) == (4, 16)
    assert config.premium == TierLimits(max_waiting=64, max_queued_tokens=None, kv_overcommit=2.0,
                                        max_queue_wait_s=None)
    assert config.standard == TierLimits(max_waiting=64, max_queued_tokens=None, kv_overcommit=2.0,
                                         max_queue_wait_s=10.0)
    assert (config.host, config.port, config.db_url, config.admin_token) == ("127.0.0.1", 8000, None, None)
    assert (config.drain_timeout_s, config.max_stream_seconds) == (30.0, 600.0)
    assert (config.slo.ttft_slo_s, config.slo.ttft_alert_s, config.slo.webhook_urls) == (0.5, 0.4, ())
    assert config.slo.external_url == "http://127.0.0.1:8000"
    assert config.worker_pool.workers == 1 and config.worker_pool.worker_endpoints == ()


def test_engine_flags_reach_their_sections(monkeypatch):
    monkeypatch.setenv("LORAGW_NO_PREFIX_CACHING", "1")
    monkeypatch.setenv("LORAGW_STANDARD_PREFILL_TOKENS", "0")
    config = _serve_config(_serve_args(["--max-num-seqs", "8", "--num-kv-blocks", "64", "--max-loras", "2",
                                        "--num-threads", "3", "--max-model-len", "512"]))
    engine = config.engine
    assert (engine.scheduler.max_num_seqs, engine.scheduler.max_model_len, engine.num_threads) == (8, 512, 3)
    assert (engine.cache.num_kv_blocks, engine.cache.enable_prefix_caching) == (64, False)
    assert engine.lora.max_loras == 2
    assert engine.scheduler.max_standard_prefill_tokens is None  # 0: no cap


def test_serve_flags_default_to_their_env_variables(monkeypatch):
    monkeypatch.setenv("LORAGW_PORT", "9123")
    monkeypatch.setenv("LORAGW_ADMIN_TOKEN", "from-env-" + TOKEN)
    monkeypatch.setenv("LORAGW_PREMIUM_RESERVED_FRACTION", "0.3")
    monkeypatch.setenv("LORAGW_DRAIN_TIMEOUT", "5")
    config = _serve_config(_serve_args(["--port", "9000", "--standard-max-waiting", "7"]))
    assert config.port == 9000  # a flag beats its variable
    assert config.host == "127.0.0.1"
    assert config.admin_token == "from-env-" + TOKEN
    assert config.engine.cache.premium_reserved_fraction == 0.3
    assert config.standard.max_waiting == 7 and config.drain_timeout_s == 5.0
    assert config.enable_tiers and config.engine.scheduler.enable_tiers
    assert config.max_stream_seconds == GatewayConfig.max_stream_seconds == 600.0


def test_max_stream_seconds_flag_and_zero_for_no_limit(monkeypatch):
    monkeypatch.setenv("LORAGW_MAX_STREAM_SECONDS", "0")
    assert _serve_config(_serve_args([])).max_stream_seconds is None
    assert _serve_config(_serve_args(["--max-stream-seconds", "90"])).max_stream_seconds == 90.0


def test_redis_flags_and_their_variables(monkeypatch, capsys):
    config = _serve_config(_serve_args([]))
    assert config.redis.url is None and config.redis.failure_mode == "local"  # in memory, as before
    monkeypatch.setenv("LORAGW_REDIS_URL", "redis://10.0.0.9:6379/2")
    config = _serve_config(_serve_args(["--redis-failure-mode", "refuse"]))
    assert config.redis.url == "redis://10.0.0.9:6379/2" and config.redis.failure_mode == "refuse"
    assert "10.0.0.9" not in repr(config)  # a URL may hold a password
    with pytest.raises(SystemExit):
        _serve_args(["--redis-failure-mode", "ignore"])
    assert "invalid choice" in capsys.readouterr().err


def test_edge_limit_flags_take_their_defaults_from_the_config(monkeypatch):
    from gateway.config import GatewayConfig

    defaults = GatewayConfig()
    config = _serve_config(_serve_args([]))
    assert (config.max_request_bytes, config.max_upload_bytes, config.max_header_bytes, config.prepare_threads) == (
        defaults.max_request_bytes, defaults.max_upload_bytes, defaults.max_header_bytes, defaults.prepare_threads)
    monkeypatch.setenv("LORAGW_MAX_HEADER_BYTES", "8192")
    config = _serve_config(_serve_args(["--max-request-bytes", "1000", "--prepare-threads", "2"]))
    assert (config.max_request_bytes, config.max_header_bytes, config.prepare_threads) == (1000, 8192, 2)
    assert _serve_config(_serve_args([])).request_read_timeout_s == defaults.request_read_timeout_s == 30.0
    assert _serve_config(_serve_args(["--request-read-timeout", "0"])).request_read_timeout_s is None


def test_no_tiers_turns_off_the_premium_reserve(monkeypatch):
    assert _serve_config(_serve_args([])).engine.premium_reserved_blocks(100) == 20
    monkeypatch.setenv("LORAGW_NO_TIERS", "1")
    config = _serve_config(_serve_args([]))
    assert not config.enable_tiers and not config.engine.scheduler.enable_tiers
    assert config.engine.premium_reserved_blocks(100) == 0


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


def test_worker_pool_flags(monkeypatch, tmp_path):
    monkeypatch.delenv("LORAGW_WORKER_SECRET", raising=False)
    monkeypatch.setenv("LORAGW_WORKERS", "2")
    config = _serve_config(_serve_args(["--worker-devices", "cuda:0,cuda:1", "--worker", "tcp://10.0.0.5:7100",
                                        "--worker", "tcp://10.0.0.6:7100", "--routing", "round-robin",
                                        "--worker-heartbeat-timeout", "3", "--worker-restart-backoff", "0.5",
                                        "--worker-restart-backoff-max", "4", "--worker-nice", "0"]))
    pool = config.worker_pool
    assert (pool.workers, pool.worker_devices, pool.routing) == (2, "cuda:0,cuda:1", "round-robin")
    assert pool.worker_niceness == 0
    assert _serve_config(_serve_args([])).worker_pool.worker_niceness == WORKER_NICENESS > 0
    assert pool.worker_endpoints == ("tcp://10.0.0.5:7100", "tcp://10.0.0.6:7100")
    assert (pool.heartbeat_timeout_s, pool.restart_backoff_s, pool.restart_backoff_max_s) == (3.0, 0.5, 4.0)
    assert pool.worker_secret is None and "secret" not in repr(pool)
    secret = tmp_path / "worker-secret"
    secret.write_text("s3cret\n")
    assert _serve_config(_serve_args(["--worker-secret-file", str(secret)])).worker_pool.worker_secret == "s3cret"
    monkeypatch.setenv("LORAGW_WORKER_SECRET", "from-env")
    assert _serve_config(_serve_args([])).worker_pool.worker_secret == "from-env"


@pytest.mark.parametrize("argv, niceness", [(["--worker-nice", "7"], 7), ([], WORKER_NICENESS)])
def test_serve_starts_its_local_workers_at_the_worker_nice(argv, niceness):
    import shutil

    from gateway.workers.fleet import build_fleet

    fleet = build_fleet(_serve_config(_serve_args(argv)))
    try:
        assert fleet.supervisor.niceness == niceness
    finally:
        shutil.rmtree(fleet.supervisor._dir, ignore_errors=True)


@pytest.mark.parametrize("argv, message", [
    (["--workers", "2", "--worker-devices", "cuda:0"], "1 devices for 2 local workers"),
    (["--workers", "0"], "at least one worker"),
    (["--worker-restart-backoff", "60"], "backoff"),
    (["--worker-nice", "20"], "0-19"),
    (["--worker-nice", "-1"], "0-19"),
])
def test_worker_pool_flags_that_cannot_work_are_refused(argv, message):
    with pytest.raises(ConfigError, match=message):
        _serve_config(_serve_args(argv))


def test_serve_refuses_a_price_it_could_not_bill_with(monkeypatch):
    """A NaN price used to start the server and then make /admin/usage a 500."""
    monkeypatch.setenv("LORAGW_PRICE", "premium:NaN,0,0 standard:1,0,0")
    with pytest.raises(ValueError, match="'NaN' is not a price"):
        _serve_config(_serve_args([]))
    monkeypatch.setenv("LORAGW_PRICE", "premium:0.004,0.0002,0.0006")
    assert str(_serve_config(_serve_args([])).prices.for_tier("premium").per_gpu_second) == "0.004"
