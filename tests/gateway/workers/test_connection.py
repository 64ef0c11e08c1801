"""The gateway's side of the version check: a worker that answers Hello in
another protocol version (a frame that still decodes, with fields we do not
know, or one that does not) leaves the connection refused, naming both
versions, and it serves no request. A fake worker (a bare ROUTER) answers."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import zmq
import zmq.asyncio

from engine.request import Tier
from engine.sampling_params import SamplingParams
from engine.wire import PROTOCOL_VERSION, AddRequest, Codec, Fatal, Hello, Status, WorkerInfo
from gateway.engine_client import EngineRequest
from gateway.workers import connection
from gateway.workers.connection import WorkerConnection, WorkerLost, WorkerState

REQUEST = EngineRequest("r1", "acme", Tier.STANDARD, [1, 2, 3], SamplingParams(max_tokens=2), None, "salt")
FRAMES = {
    # Our Status's fields and more: it decodes; the version is what differs.
    "decodable": {"type": "status", "protocol_version": 999, "worker": None, "shards": [1, 2]},
    # Its fields changed shape: only the version still reads.
    "undecodable": {"type": "status", "protocol_version": 999, "worker": "tiny@cpu"},
}


@pytest.mark.parametrize("shape", FRAMES)
def test_a_worker_of_another_protocol_version_is_refused(tmp_path, shape):
    async def run():
        context = zmq.asyncio.Context()
        worker = context.socket(zmq.ROUTER)
        worker.bind(f"ipc://{tmp_path}/w.sock")
        conn = WorkerConnection("0", f"ipc://{tmp_path}/w.sock", context=context, session="t", on_usage=print,
                                heartbeat_timeout_s=30.0)
        await conn.start()
        try:
            peer, frame = await asyncio.wait_for(worker.recv_multipart(), 30)
            hello = Codec().decode_to_worker(frame)
            assert isinstance(hello, Hello) and hello.protocol_version == PROTOCOL_VERSION
            await worker.send_multipart([peer, msgspec.msgpack.encode(FRAMES[shape])])
            for _ in range(3000):
                if conn.state is WorkerState.REFUSED:
                    break
                await asyncio.sleep(0.01)
            with pytest.raises(WorkerLost):
                conn.submit(REQUEST)
            return conn.state, conn.problem
        finally:
            await conn.stop()
            worker.close(linger=0)
            context.term()

    state, problem = asyncio.run(run())
    assert state is WorkerState.REFUSED
    assert "999" in problem and f"this side {PROTOCOL_VERSION}" in problem


READY = Status(PROTOCOL_VERSION, worker=WorkerInfo("tiny", 64, 32, "cpu", 1))


@pytest.mark.parametrize("last_words", ["fatal", "heartbeat"])
def test_a_worker_whose_exit_is_seen_first_still_has_what_it_sent_read(tmp_path, monkeypatch, last_words):
    """The supervisor may see a worker's process exit before the frames it
    sent last reach this side. Its Fatal still names the cause to the
    requests it failed, and a heartbeat read after the exit does not clear
    why it was lost (a stream once ended with "worker 0 was lost: None")."""
    monkeypatch.setattr(connection, "EXIT_DRAIN_S", 2.0)  # ample on a loaded machine

    async def run():
        context = zmq.asyncio.Context()
        worker = context.socket(zmq.ROUTER)
        worker.bind(f"ipc://{tmp_path}/w.sock")
        codec = Codec()
        # A short timeout polls often, so the loss is seen well before the
        # last frames are sent; the frozen clock never times the fake worker
        # out (the drain keeps real time).
        conn = WorkerConnection("0", f"ipc://{tmp_path}/w.sock", context=context, session="t", on_usage=print,
                                heartbeat_timeout_s=0.2, clock=lambda: 0.0)
        await conn.start()
        try:
            peer, _ = await asyncio.wait_for(worker.recv_multipart(), 30)
            await worker.send_multipart([peer, codec.encode(READY)])
            for _ in range(3000):
                if conn.ready:
                    break
                await asyncio.sleep(0.01)
            mailbox = conn.submit(REQUEST)
            _, frame = await asyncio.wait_for(worker.recv_multipart(), 30)
            assert isinstance(codec.decode_to_worker(frame), AddRequest)
            conn.mark_lost("the worker process exited with code 3")
            assert not conn.ready  # nothing new goes to it while what it sent is read
            await asyncio.sleep(0.2)  # the session loop has seen the loss and is reading what is left
            await worker.send_multipart([peer, codec.encode(READY)])
            if last_words == "fatal":
                await worker.send_multipart([peer, codec.encode(Fatal("engine step failed: boom"))])
            error = await asyncio.wait_for(mailbox.get(), 30)
            return error, conn.state, conn.problem
        finally:
            await conn.stop()
            worker.close(linger=0)
            context.term()

    error, state, problem = asyncio.run(run())
    assert isinstance(error, WorkerLost) and state is WorkerState.DOWN
    cause = "engine step failed: boom" if last_words == "fatal" else "the worker process exited with code 3"
    assert cause in problem and cause in str(error), (problem, error)
