"""`loragw worker`: one engine in its own process, served over engine/wire.py.

Three threads, each owning what it touches:
- the I/O thread (the main one) owns the ROUTER socket: it answers Hello,
  hands AddRequest/Abort to the engine thread, forwards the engine thread's
  messages to the gateway, and sends a Status heartbeat every `heartbeat_s`
  whatever the engine is doing, so a long step never looks like a dead worker;
- the engine thread loads the model, then steps it, publishing one
  StepOutputs (outputs, usage, snapshot) per step through an inproc socket;
- torch's own threads, inside the step.

Several gateways at once (the replicas behind a load balancer): each
valid Hello opens a session, and each session sees only its own requests'
outputs and its share of each step's usage (engine/usage_split.py), with
every snapshot. A Hello that repeats a live session's id from a new socket
is that gateway reconnecting: the new socket takes over and the old one's
requests are aborted (they must not be billed twice, and nobody else may
read their outputs). A gateway whose socket is gone (a heartbeat cannot be
delivered) has its session closed and its requests aborted. If a step
raises, the worker sends Fatal to every session and exits non-zero: its
supervisor restarts it with a fresh engine, as vLLM's engine core does.
"""

from __future__ import annotations

import hmac
import logging
import os
import signal
import threading
import time

import zmq

from engine.config import EngineConfig
from engine.errors import EngineError
from engine.host_cpu import default_thread_wait_policy, lower_priority
from engine.wire import PROTOCOL_VERSION, Codec, Hello, ProtocolError, Refused, Status, is_local_endpoint, version_mismatch
from engine.worker_loop import BROADCAST, OUTBOX, SESSION_CLOSED, SESSION_OPEN, EngineLoop, Moved

log = logging.getLogger(__name__)

EXIT_ENGINE_FAILED = 3
EXIT_LOAD_FAILED = 4
MAX_FRAME_BYTES = 64 * 1024 * 1024
class WorkerConfigError(EngineError):
    """A worker setting that cannot work (listening beyond loopback without a secret)."""


def check_listen(listen: str, secret: str | None) -> None:
    if not is_local_endpoint(listen) and not secret:
        raise WorkerConfigError(f"--listen {listen} is reachable beyond this machine: give the worker a shared "
                                "secret (--secret-file or LORAGW_WORKER_SECRET) that the gateway presents")


class Worker:
    """The I/O side: the ROUTER socket, sessions and heartbeats."""

    def __init__(self, config: EngineConfig, *, listen: str, secret: str | None, heartbeat_s: float = 0.5,
                 parent_pid: int | None = None):
        check_listen(listen, secret)
        self.secret = secret
        # A supervised worker stops when its gateway is gone, however the
        # gateway ended (SIGKILL included): it is then re-parented.
        self.parent_pid = parent_pid
        self.heartbeat_s = heartbeat_s
        self.context = zmq.Context()
        self.router = self.context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        # No high-water mark: a ROUTER drops what passes it without a word,
        # and a dropped final output would leave its request waiting forever.
        self.router.setsockopt(zmq.SNDHWM, 0)
        # A peer need not be authenticated to send a frame: bound its size
        # (a request is token ids and sampling settings, far below this).
        self.router.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        # A send to a peer whose socket is gone raises instead of vanishing:
        # that is how a gateway that went away is noticed.
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.bind(listen)
        self.endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.outbox = self.context.socket(zmq.PULL)
        self.outbox.setsockopt(zmq.RCVHWM, 0)
        self.outbox.bind(OUTBOX)
        self.engine = EngineLoop(config, self.context)
        # Open sessions: peer identity -> the gateway's session id (from its Hello).
        self.sessions: dict[bytes, str] = {}
        self.codec = Codec()
        self._stop = threading.Event()

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> int:
        thread = threading.Thread(target=self.engine.run, name="loragw-engine", daemon=True)
        thread.start()
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.outbox, zmq.POLLIN)
        next_beat = 0.0
        try:
            while not self._stop.is_set() and not self._engine_done():
                events = dict(poller.poll(timeout=int(self.heartbeat_s * 1000)))
                if self.outbox in events:
                    self._forward_outbox()
                if self.router in events:
                    self._receive()
                now = time.monotonic()
                if now >= next_beat:
                    if self.parent_pid is not None and os.getppid() != self.parent_pid:
                        log.warning("the supervising gateway (pid %d) is gone; stopping", self.parent_pid)
                        break
                    status = self._status()
                    for peer in list(self.sessions):
                        self._send(peer, status)
                    next_beat = now + self.heartbeat_s
            self._forward_outbox()  # the Fatal, if the engine failed
        finally:
            code = self._exit_code()
            self.engine.commands.put(None)
            thread.join(timeout=10)
            if thread.is_alive():
                # Still loading, or inside a step that will not end: nothing
                # may wait on it (term() would, on its socket), and the
                # process must not outlive its gateway holding a device.
                log.error("the engine thread did not stop; exiting anyway")
                logging.shutdown()
                os._exit(code)
            self._forward_outbox()
            self.router.close(linger=500)
            self.outbox.close(linger=0)
            self.context.term()
        return code

    def _engine_done(self) -> bool:
        """The engine stopped serving. One whose model failed to load is not
        done: the worker keeps answering with the error until it is stopped,
        so the gateway can report it (and no supervisor restarts it in a loop)."""
        return self.engine.stopped.is_set() and self.engine.load_error is None

    def _exit_code(self) -> int:
        if self.engine.failed.is_set():
            return EXIT_ENGINE_FAILED
        return EXIT_LOAD_FAILED if self.engine.load_error is not None else 0

    def _status(self) -> Status:
        e = self.engine
        return Status(PROTOCOL_VERSION, worker=e.info, load_error=e.load_error, snapshot=e.snapshot)

    def _send(self, peer: bytes, message) -> None:
        self._deliver(peer, self.codec.encode(message))

    def _deliver(self, peer: bytes, frame: bytes) -> None:
        try:
            self.router.send_multipart([peer, frame])
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            if peer in self.sessions:
                log.info("gateway session %s is gone; aborting its requests", self.sessions[peer])
                self._close_session(peer)

    def _close_session(self, peer: bytes, successor: bytes | None = None) -> None:
        del self.sessions[peer]
        self.engine.commands.put((peer, SESSION_CLOSED if successor is None else Moved(successor)))

    def _forward_outbox(self) -> None:
        while True:
            try:
                peer, frame = self.outbox.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            for target in (list(self.sessions) if peer == BROADCAST else [peer]):
                if target in self.sessions:
                    self._deliver(target, frame)

    def _receive(self) -> None:
        while True:
            try:
                peer, frame = self.router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except ValueError:  # not [identity, frame]: a stray client
                continue
            try:
                message = self.codec.decode_to_worker(frame)
            except ProtocolError as exc:
                self._send(peer, Refused(str(exc)))
                continue
            if isinstance(message, Hello):
                self._hello(peer, message)
            elif peer in self.sessions:
                self.engine.submit(peer, message)
            # else: a peer that never opened a session; its commands are ignored

    def _hello(self, peer: bytes, hello: Hello) -> None:
        if hello.protocol_version != PROTOCOL_VERSION:
            self._send(peer, Refused(version_mismatch(hello.protocol_version)))
            return
        if self.secret and not hmac.compare_digest((hello.secret or "").encode(), self.secret.encode()):
            log.warning("refused a gateway session: wrong or missing secret")
            self._send(peer, Refused("wrong or missing worker secret"))
            return
        for old, session in list(self.sessions.items()):
            if session == hello.session and old != peer:
                log.info("gateway session %s reconnected; aborting its previous socket's requests", session)
                self._close_session(old, successor=peer)
        if peer not in self.sessions:
            self.sessions[peer] = hello.session
            self.engine.commands.put((peer, SESSION_OPEN))
        self._send(peer, self._status())


def run_worker(config: EngineConfig, *, listen: str, secret: str | None = None, metrics_port: int | None = None,
               metrics_host: str = "127.0.0.1", heartbeat_s: float = 0.5, parent_pid: int | None = None) -> int:
    """Serve until SIGTERM/SIGINT (exit 0; 4 if the model never loaded) or
    an engine failure (exit 3)."""
    worker = Worker(config, listen=listen, secret=secret, heartbeat_s=heartbeat_s, parent_pid=parent_pid)
    if metrics_port is not None:
        from engine.snapshot_metrics import serve_worker_metrics

        serve_worker_metrics(lambda: worker.engine.snapshot, port=metrics_port, host=metrics_host)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: worker.stop())
    # The first line on stdout names the bound endpoint (tcp port 0 resolves
    # here), so a supervisor or a script can connect to it.
    print(f"loragw worker listening on {worker.endpoint}", flush=True)
    return worker.run()


def main(argv: list[str] | None = None) -> int:
    """The entry a supervising gateway spawns: the engine config comes as
    JSON (the gateway already parsed and validated it), the secret from
    $LORAGW_WORKER_SECRET."""
    default_thread_wait_policy()
    import argparse

    import msgspec

    parser = argparse.ArgumentParser(prog="python -m engine.worker")
    parser.add_argument("--listen", required=True)
    parser.add_argument("--config-json", required=True)
    parser.add_argument("--metrics-port", type=int)
    parser.add_argument("--parent-pid", type=int, help="stop when this process (the supervisor) is gone")
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--niceness", type=int, default=0,
                        help="run this much nicer than the supervisor, on the CPU (engine/host_cpu.py)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    config = msgspec.json.decode(args.config_json, type=EngineConfig)
    if args.niceness > 0:
        from engine.builder import resolve_device

        if resolve_device(config.device).type == "cpu":
            lower_priority(args.niceness)  # before the engine's threads start: they inherit it
    return run_worker(config, listen=args.listen, secret=os.environ.get("LORAGW_WORKER_SECRET") or None,
                      metrics_port=args.metrics_port, parent_pid=args.parent_pid)


if __name__ == "__main__":
    raise SystemExit(main())
