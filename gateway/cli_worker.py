"""`loragw worker`: one engine (one accelerator, or the CPU) in its own
process, serving a gateway over the worker protocol.

Its engine flags are generated from EngineConfig's sections by the same
code as `loragw serve`'s, with the serving defaults
(gateway.config.serving_engine_config), so a worker started by hand
schedules like the engine `loragw serve` starts.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Mapping

from engine.config import EngineConfig
from engine.config_flags import add_flags, config_from_args, env_flag, section, setting

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
# One secret for both ends: the gateway presents it, the worker checks it.
WORKER_SECRET_ENV = "LORAGW_WORKER_SECRET"
WORKER_SECRET_FILE_ENV = "LORAGW_WORKER_SECRET_FILE"


def _worker_engine() -> EngineConfig:
    from gateway.config import serving_engine_config

    return serving_engine_config()


@dataclass(frozen=True)
class WorkerConfig:
    """What `loragw worker` runs. Its own variables are LORAGW_WORKER_*, so
    a worker started with `loragw serve`'s environment does not take the
    gateway's --metrics-port."""

    listen: str = setting("tcp://127.0.0.1:7100", env="LORAGW_WORKER_LISTEN",
                          help="address the gateway connects to; a non-loopback one needs the shared secret")
    metrics_port: int | None = setting(None, env="LORAGW_WORKER_METRICS_PORT",
                                       help="serve this worker's /metrics on this port (0: any free port); "
                                            "unset: no /metrics listener")
    metrics_host: str = setting("127.0.0.1", env="LORAGW_WORKER_METRICS_HOST",
                                help="interface of the --metrics-port listener")
    log_level: str = setting("info", choices=LOG_LEVELS, help="log level")
    # Never on argv: from --secret-file or $LORAGW_WORKER_SECRET.
    secret: str | None = setting(None, flag=None, repr=False, help="the secret a gateway must present")
    engine: EngineConfig = section(_worker_engine, title="engine")


def add_parser(sub, environ: Mapping[str, str] = os.environ) -> argparse.ArgumentParser:
    worker = sub.add_parser("worker", help="run one engine for a gateway (`loragw serve --worker ENDPOINT`)")
    add_flags(worker, WorkerConfig(), environ=environ)
    env_flag(worker, "--secret-file", environ=environ, env=WORKER_SECRET_FILE_ENV,
             help=f"read the shared secret from this file (its first line); or set ${WORKER_SECRET_ENV} "
                  f"to the secret itself")
    return worker


def worker_config(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> WorkerConfig:
    values = vars(args) | {"secret": worker_secret(args.secret_file, environ)}
    return config_from_args(WorkerConfig(), values)


def parse_worker_args(argv: list[str], environ: Mapping[str, str] = os.environ) -> WorkerConfig:
    """`loragw worker ARGV...` as the command parses it."""
    parser = argparse.ArgumentParser(prog="loragw")
    add_parser(parser.add_subparsers(dest="command"), environ)
    return worker_config(parser.parse_args(["worker", *argv]), environ)


def worker_secret(path: str | None, environ: Mapping[str, str]) -> str | None:
    """The secret shared between a gateway and its workers:
    $LORAGW_WORKER_SECRET, or the first line of the file at `path`."""
    from gateway.config import secret_from

    return secret_from(environ.get(WORKER_SECRET_ENV), path, what="worker secret",
                       sources=f"${WORKER_SECRET_ENV} or a secret file")


def run(args: argparse.Namespace) -> int:
    import logging

    from engine.errors import EngineError

    try:
        config = worker_config(args)
    except (EngineError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    logging.basicConfig(level=config.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    import zmq

    from engine.worker import run_worker

    try:
        return run_worker(config.engine, listen=config.listen, secret=config.secret,
                          metrics_port=config.metrics_port, metrics_host=config.metrics_host)
    except (EngineError, zmq.ZMQError, OSError) as exc:  # no secret off loopback; the address is taken
        print(f"error: {exc}", file=sys.stderr)
        return 1
