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
from engine.wire import PROTOCOL_VERSION, Codec, Hello
from gateway.engine_client import EngineRequest
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
