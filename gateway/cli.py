"""The `loragw` command.

`loragw serve` runs the HTTP gateway (OpenAI-compatible /v1, admin /admin)
on an in-process engine; every flag has a LORAGW_* environment variable.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

from gateway import cli_admin, cli_usage


def _env_flag(p: argparse.ArgumentParser, flag: str, *, default=None, help: str = "", **kwargs) -> None:
    """`--some-flag`, defaulting to $LORAGW_SOME_FLAG, else `default`
    (argparse applies `type` to a string default, so the env value is parsed too)."""
    env = "LORAGW_" + flag.lstrip("-").replace("-", "_").upper()
    if kwargs.get("action") == "store_true":
        default = os.environ.get(env, "").lower() in ("1", "true", "yes", "on")
    else:
        default = os.environ.get(env, default)
    p.add_argument(flag, default=default, help=f"{help} [env {env}]".strip(), **kwargs)


def engine_threads_beside_the_server() -> int:
    """Intra-op threads for an engine that shares the machine with the HTTP
    server. The event loop needs a core of its own: when it preempts one of
    torch's threads, every parallel op waits at its barrier for that thread
    (measured on 2 cores: a step ran ~8x slower with 2 threads than with 1
    while another process was busy)."""
    return max(1, (os.cpu_count() or 1) - 1)


def _add_serve_parser(sub) -> None:
    serve = sub.add_parser("serve", help="run the HTTP gateway (OpenAI-compatible API and admin API)")
    f = functools.partial(_env_flag, serve)
    f("--host", default="127.0.0.1", help="interface to listen on")
    f("--port", type=int, default=8000)
    f("--model", help="local HF-format Llama checkpoint; default: bundled SmolLM2-135M-Instruct")
    f("--served-model-name", help="the base model's id in the API; default: the checkpoint's name")
    f("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    f("--db", help="SQLAlchemy URL (sqlite+aiosqlite:///... or postgresql+asyncpg://...); "
                   "default: loragw.db in the data directory ($LORAGW_DATA_DIR)")
    f("--admin-token", help="bearer token of the /admin API and /metrics, 32+ characters (visible in ps: "
                            "prefer --admin-token-file or the env variable); unset: /admin refuses everyone")
    f("--max-num-seqs", type=int, default=128, help="sequences running at once")
    f("--max-num-batched-tokens", type=int, default=1024, help="tokens per engine step")
    f("--max-model-len", type=int, help="context length; default: the model's")
    f("--num-threads", type=int, help="torch threads of the engine on the CPU; default: one per core but "
                                      "one, which is left to the event loop")
    f("--kv-cache-memory", type=int, help="KV cache budget in bytes")
    f("--max-loras", type=int, default=4, help="adapters resident on the device at once (0: LoRA off)")
    f("--max-lora-rank", type=int, default=16)
    f("--premium-reserved-fraction", type=float, default=0.2,
      help="share of the KV cache only premium requests may use")
    f("--premium-max-waiting", type=int, default=64, help="premium requests queued before 429")
    f("--standard-max-waiting", type=int, default=64, help="standard requests queued before 429")
    f("--standard-prefill-tokens", type=int, default=256,
      help="most standard prompt tokens prefilled per step with tiers on, which bounds how long a premium "
           "arrival waits for the step in flight (0: no cap; raise it on a GPU)")
    f("--standard-max-queue-wait", type=float, default=10.0,
      help="seconds a standard request may expect to queue before its first token, else 429 (0: no bound)")
    f("--no-tiers", action="store_true", help="plain FCFS: no premium reserve, no tier limits")
    f("--drain-timeout", type=float, default=30.0, help="seconds in-flight requests get after SIGTERM")
    _add_auth_cache_flags(f)
    f("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    _add_observability_flags(f)
    _add_exposure_flags(f)
    _add_limit_flags(f)
    cli_usage.add_price_flag(serve)


def _add_limit_flags(f) -> None:
    from gateway.config import GatewayConfig as C

    f("--max-request-bytes", type=int, default=C.max_request_bytes,
      help="largest request body; more is refused with 413 while it is read (adapter uploads: "
           "--max-upload-bytes)")
    f("--max-upload-bytes", type=int, default=C.max_upload_bytes, help="largest adapter upload (POST /admin/adapters)")
    f("--max-header-bytes", type=int, default=C.max_header_bytes,
      help="largest request line plus headers; more is refused with 431")
    f("--prepare-threads", type=int, default=C.prepare_threads,
      help="worker threads that parse, template and tokenize requests off the event loop")
    f("--max-stream-seconds", type=float, default=C.max_stream_seconds,
      help="a streamed response's longest life; past it the request is aborted and the stream ends with an "
           "error event (0: no limit)")


def _add_exposure_flags(f) -> None:
    """What the server shows to whom: the admin token, the metrics
    listener, the demo tenant (docs/security.md)."""
    from gateway.config import GatewayConfig

    f("--admin-token-file", help="read the admin token from this file (its first line), not from argv")
    f("--metrics-port", type=int, help="serve /metrics without auth on this port (on --metrics-host), for "
                                       "Prometheus; unset: /metrics only on --port, behind the admin token")
    f("--metrics-host", default=GatewayConfig.metrics_host, help="interface of the --metrics-port listener")
    f("--demo-tenant", action="store_true",
      help="create the 'demo' tenant on an empty --db too (always done for the default SQLite database)")


def _add_auth_cache_flags(f) -> None:
    from gateway.config import GatewayConfig

    d = GatewayConfig()
    f("--auth-cache-ttl", type=float, default=d.auth_cache_ttl_s,
      help="seconds an API key's tenant and the adapter grants are reused before the database is asked again: "
           "the bound on how late a revocation or limit change takes effect (0: ask every time)")
    f("--auth-cache-stale", type=float, default=d.auth_cache_stale_s,
      help="while the database is unavailable, seconds past the TTL that recently used keys keep working")
    f("--auth-cache-size", type=int, default=d.auth_cache_max_entries,
      help="most keys (and, apart, adapter grants) held in the auth cache; least recently used go first")


def _add_observability_flags(f) -> None:
    f("--metrics-adapter-labels", type=int, default=16, help="adapters with their own metrics series; more: 'other'")
    f("--metrics-tenant-labels", type=int, default=32, help="tenants with their own metrics series; more: 'other'")
    f("--slo-ttft", type=float, default=0.5, help="TTFT SLO in seconds (p99 of premium)")
    f("--slo-ttft-alert", type=float, default=0.4, help="page when premium's TTFT p99 passes this (seconds)")
    f("--slo-fast-window", type=float, default=300.0, help="SLO burn-rate fast window, seconds")
    f("--slo-slow-window", type=float, default=3600.0, help="SLO burn-rate slow window, seconds")
    f("--slo-burn-rate", type=float, default=1.0, help="page when both windows burn the budget this fast")
    f("--slo-min-samples", type=int, default=20, help="requests in the fast window before it can page")
    f("--slo-min-hold", type=float, default=60.0, help="seconds an alert stays firing/resolved at least")
    f("--alert-webhook-url", default="", help="Alertmanager-style webhook receivers, comma-separated")


def _slo_config(args: argparse.Namespace):
    from gateway.slo import SloConfig

    urls = tuple(u.strip() for u in args.alert_webhook_url.split(",") if u.strip())
    return SloConfig(ttft_slo_s=args.slo_ttft, ttft_alert_s=args.slo_ttft_alert,
                     fast_window_s=args.slo_fast_window, slow_window_s=args.slo_slow_window,
                     burn_rate=args.slo_burn_rate, min_samples=args.slo_min_samples,
                     min_hold_s=args.slo_min_hold, webhook_urls=urls,
                     external_url=f"http://{args.host}:{args.port}")


def _admin_token(args: argparse.Namespace) -> str | None:
    from gateway.config import ConfigError

    if not args.admin_token_file:
        return args.admin_token or None
    if args.admin_token:
        raise ConfigError("give the admin token once: --admin-token (LORAGW_ADMIN_TOKEN) or --admin-token-file")
    with open(args.admin_token_file, encoding="utf-8") as file:
        token = file.readline().strip()
    if not token:
        raise ConfigError(f"the admin token file {args.admin_token_file} is empty")
    return token


def _serve_config(args: argparse.Namespace):
    from engine.config import EngineConfig
    from gateway.config import GatewayConfig, TierLimits

    tiers = not args.no_tiers
    engine = EngineConfig(
        model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        num_threads=args.num_threads or engine_threads_beside_the_server(),
        max_standard_prefill_tokens=args.standard_prefill_tokens or None,
        kv_cache_memory=args.kv_cache_memory, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
        premium_reserved_fraction=args.premium_reserved_fraction if tiers else 0.0, enable_tiers=tiers)
    return GatewayConfig(
        host=args.host, port=args.port, db_url=args.db, admin_token=_admin_token(args), engine=engine,
        served_model_name=args.served_model_name, enable_tiers=tiers,
        premium=TierLimits(max_waiting=args.premium_max_waiting),
        standard=TierLimits(max_waiting=args.standard_max_waiting,
                            max_queue_wait_s=args.standard_max_queue_wait or None), drain_timeout_s=args.drain_timeout,
        max_stream_seconds=args.max_stream_seconds or None,
        metrics_adapter_labels=args.metrics_adapter_labels, metrics_tenant_labels=args.metrics_tenant_labels,
        slo=_slo_config(args), prices=cli_usage.price_book(args), metrics_port=args.metrics_port,
        metrics_host=args.metrics_host, demo_tenant=args.demo_tenant, max_request_bytes=args.max_request_bytes,
        max_upload_bytes=args.max_upload_bytes, max_header_bytes=args.max_header_bytes,
        prepare_threads=args.prepare_threads,
        auth_cache_ttl_s=args.auth_cache_ttl, auth_cache_stale_s=args.auth_cache_stale,
        auth_cache_max_entries=args.auth_cache_size)


def _serve(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from sqlalchemy.exc import SQLAlchemyError

    from engine.errors import EngineError
    from engine.model.loader import resolve_model_dir
    from gateway import server
    from gateway.config import ConfigError
    from gateway.store import schema

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        config = _serve_config(args)
        config.engine.cache_config()  # validates the cache flags
        resolve_model_dir(config.engine.model)  # fail now, not after the server is up
        db_url = config.resolved_db_url()
        schema.upgrade(db_url)
    except (EngineError, SQLAlchemyError, OSError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if config.admin_token is None:
        print("note: no --admin-token: the /admin API refuses every request", file=sys.stderr)
    try:
        asyncio.run(server.serve(config, log_level=args.log_level))
    except ConfigError as exc:  # the metrics port is taken
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="loragw", description="multi-tenant LoRA inference gateway")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve_parser(sub)
    cli_admin.add_parsers(sub)
    cli_usage.add_parsers(sub)
    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command in cli_admin.COMMANDS:
        return cli_admin.run(args)
    if args.command == "usage":
        return cli_usage.run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
