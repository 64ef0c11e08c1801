"""An engine worker as a Ray actor: Ray places it (one per GPU), restarts it
when it dies, and names it so gateways can find it. The actor is a shell
around `engine.worker.Worker`, which speaks the same ZeroMQ protocol as a
supervised local worker; the gateway's router decides where requests go,
never Ray.

Ray is an optional extra (`loragw[ray]`): nothing else imports this module.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger(__name__)

# Named actors live in this namespace; their names start with the prefix.
NAMESPACE = "loragw"
ACTOR_PREFIX = "loragw-worker-"


class WorkerActor:
    """Serves one engine on a TCP port of its node. When the worker stops
    (the engine failed, or its model never loads) the actor's process exits,
    so Ray's restart policy brings up a fresh one."""

    def __init__(self, config_json: str, secret: str | None, log_level: str = "warning"):
        import msgspec

        from engine.config import EngineConfig
        from engine.worker import Worker

        logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
        config = msgspec.json.decode(config_json, type=EngineConfig)
        self._worker = Worker(config, listen="tcp://0.0.0.0:0", secret=secret)
        self._thread = threading.Thread(target=self._serve, name="loragw-worker", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        code = self._worker.run()
        log.warning("the worker stopped (exit %d); ending the actor so Ray restarts it", code)
        logging.shutdown()
        os._exit(code or 1)

    def endpoint(self) -> str:
        """Where gateways connect: this node's address and the bound port."""
        import ray

        port = self._worker.endpoint.rsplit(":", 1)[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def pid(self) -> int:
        return os.getpid()
