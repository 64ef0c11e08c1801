"""`loragw worker`: its flags (the engine's, generated like `loragw serve`'s),
its own options and the shared secret. Only the parsing: the worker itself
runs in engine/worker.py."""

from __future__ import annotations

import argparse

import pytest

from engine.config import EngineConfig
from gateway.cli import _add_serve_parser
from gateway.cli_worker import WorkerConfig, add_parser, parse_worker_args
from gateway.config import ConfigError, GatewayConfig


def test_no_flags_give_the_serving_engine_on_loopback():
    config = parse_worker_args([], environ={})
    assert (config.listen, config.metrics_port, config.metrics_host) == ("tcp://127.0.0.1:7100", None, "127.0.0.1")
    assert config.secret is None and config.log_level == "info"
    engine = config.engine
    # The tier policy `loragw serve` runs with, not the offline engine's ...
    assert engine.cache.premium_reserved_fraction == 0.2 and engine.scheduler.max_standard_prefill_tokens == 128
    # ... but a worker has no event loop beside it: torch's own thread count.
    assert engine.num_threads is None
    assert engine.scheduler == GatewayConfig().engine.scheduler and engine.lora == EngineConfig().lora


def test_engine_flags_are_the_same_as_serves():
    worker = add_parser(argparse.ArgumentParser().add_subparsers(dest="command"), environ={})
    serve = _add_serve_parser(argparse.ArgumentParser().add_subparsers(dest="command"), environ={})
    engine_options = {o for a in worker._actions if a.dest.startswith("engine.") for o in a.option_strings}
    serve_options = {o for a in serve._actions for o in a.option_strings}
    assert "--max-num-seqs" in engine_options and "--no-tiers" in engine_options
    assert engine_options <= serve_options


def test_flags_and_variables_set_the_worker():
    env = {"LORAGW_MAX_LORAS": "2", "LORAGW_WORKER_METRICS_PORT": "9500", "LORAGW_LOG_LEVEL": "debug"}
    config = parse_worker_args(["--listen", "tcp://0.0.0.0:7200", "--device", "cuda:1", "--num-threads", "4",
                                "--num-kv-blocks", "128", "--metrics-host", "0.0.0.0"], environ=env)
    assert (config.listen, config.metrics_port, config.metrics_host, config.log_level) == (
        "tcp://0.0.0.0:7200", 9500, "0.0.0.0", "debug")
    assert (config.engine.device, config.engine.num_threads) == ("cuda:1", 4)
    assert (config.engine.cache.num_kv_blocks, config.engine.lora.max_loras) == (128, 2)


def test_the_gateways_metrics_port_variable_is_not_the_workers():
    """A local worker inherits `loragw serve`'s environment; it must not
    try to take the gateway's metrics port."""
    assert parse_worker_args([], environ={"LORAGW_METRICS_PORT": "9464"}).metrics_port is None


def test_the_secret_comes_from_its_variable_or_a_file(tmp_path):
    assert parse_worker_args([], environ={"LORAGW_WORKER_SECRET": "from-env"}).secret == "from-env"
    path = tmp_path / "secret"
    path.write_text("from-file\nignored\n")
    assert parse_worker_args(["--secret-file", str(path)], environ={}).secret == "from-file"
    assert parse_worker_args([], environ={"LORAGW_WORKER_SECRET_FILE": str(path)}).secret == "from-file"
    assert "from-file" not in repr(parse_worker_args(["--secret-file", str(path)], environ={}))
    with pytest.raises(ConfigError, match="once"):
        parse_worker_args(["--secret-file", str(path)], environ={"LORAGW_WORKER_SECRET": "from-env"})
    path.write_text("\n")
    with pytest.raises(ConfigError, match="empty"):
        parse_worker_args(["--secret-file", str(path)], environ={})


def test_bad_engine_values_are_refused():
    from engine.errors import ValidationError

    with pytest.raises(ValidationError, match="premium_reserved_fraction"):
        parse_worker_args(["--premium-reserved-fraction", "1.5"], environ={})
    assert WorkerConfig().engine == parse_worker_args([], environ={}).engine


def test_the_command_reports_a_bad_value_before_starting(capsys):
    from gateway.cli import main

    assert main(["worker", "--premium-reserved-fraction", "1.5"]) == 1
    assert "premium_reserved_fraction" in capsys.readouterr().err
