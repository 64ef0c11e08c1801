"""The `loragw` command.

`loragw serve` runs the HTTP gateway (OpenAI-compatible /v1, admin /admin)
and the engine worker processes it supervises; `loragw worker` runs one
engine for a gateway elsewhere (docs/architecture.md, "Workers").
Their flags are generated from the config dataclasses
(engine/config_flags.py), and every flag has a LORAGW_* variable.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Mapping

from engine.config_flags import add_flags, config_from_args, env_flag
from engine.host_cpu import default_thread_wait_policy
from gateway import cli_admin, cli_usage, cli_worker
from gateway.cli_worker import LOG_LEVELS, WORKER_SECRET_ENV, WORKER_SECRET_FILE_ENV, worker_secret


def _add_serve_parser(sub, environ: Mapping[str, str] = os.environ) -> argparse.ArgumentParser:
    """The flags are GatewayConfig's fields, its engine's sections included;
    the ones below are the few that set no field directly."""
    from gateway.config import GatewayConfig

    serve = sub.add_parser("serve", help="run the HTTP gateway (OpenAI-compatible API and admin API)")
    add_flags(serve, GatewayConfig(), environ=environ)
    env_flag(serve, "--admin-token-file", environ=environ,
             help="read the admin token from this file (its first line), not from argv")
    env_flag(serve, "--worker-secret-file", environ=environ, env=WORKER_SECRET_FILE_ENV,
             help=f"read the secret presented to non-loopback workers from this file (its first line); "
                  f"or set ${WORKER_SECRET_ENV} to the secret itself")
    env_flag(serve, "--log-level", environ=environ, default="info", choices=LOG_LEVELS)
    cli_usage.add_price_flag(serve)
    return serve


def _serve_config(args: argparse.Namespace, environ: Mapping[str, str] = os.environ):
    from gateway.config import GatewayConfig, secret_from

    values = vars(args) | {
        "admin_token": secret_from(args.admin_token, args.admin_token_file, what="admin token",
                                   sources="--admin-token (LORAGW_ADMIN_TOKEN) or --admin-token-file"),
        "worker_pool.worker_secret": worker_secret(args.worker_secret_file, environ),
        "prices": cli_usage.price_book(args),
        "slo.external_url": f"http://{args.host}:{args.port}",
    }
    return config_from_args(GatewayConfig(), values)


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
        resolve_model_dir(config.engine.model)  # fail now, not after the server is up
        db_url = config.resolved_db_url()
        schema.upgrade(db_url)
    except (EngineError, SQLAlchemyError, OSError, ValueError) as exc:  # ConfigError is a ValueError
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
    default_thread_wait_policy()  # before anything loads torch; workers inherit it
    parser = argparse.ArgumentParser(prog="loragw", description="multi-tenant LoRA inference gateway")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve_parser(sub)
    cli_worker.add_parser(sub)
    cli_admin.add_parsers(sub)
    cli_usage.add_parsers(sub)
    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "worker":
        return cli_worker.run(args)
    if args.command in cli_admin.COMMANDS:
        return cli_admin.run(args)
    if args.command == "usage":
        return cli_usage.run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
