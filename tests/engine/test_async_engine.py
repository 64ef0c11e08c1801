"""The async engine: streaming, abort on early exit, failure propagation and
an event loop that stays free while a step runs."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine import SamplingParams
from engine.async_engine import AsyncEngine
from engine.builder import build_llm_engine
from engine.config import EngineConfig
from engine.errors import EngineDeadError, ValidationError


@pytest.fixture
def engine(tiny_llama_dir):
    eng = AsyncEngine(build_llm_engine(EngineConfig.from_flat(model=str(tiny_llama_dir))))
    yield eng
    eng.shutdown()


async def _collect(engine, prompt, params, **kw):
    return [out async for out in engine.generate(prompt, params, **kw)]


def _joined(outs) -> tuple[list[int], str]:
    return sum((o.outputs[0].token_ids for o in outs), []), "".join(o.outputs[0].text for o in outs)


def test_streams_deltas_that_add_up_to_the_offline_output(engine):
    params = SamplingParams(temperature=0.0, max_tokens=8)
    outs = asyncio.run(_collect(engine, "Hello there", params))
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert outs[-1].num_output_tokens == 8
    ids, text = _joined(outs)
    assert len(ids) == 8
    # The same engine, stepped offline (final outputs only) once its thread stopped, agrees.
    engine.shutdown()
    llm_engine = engine.engine
    llm_engine.add_request("Hello there", params, request_id="offline")
    final = []
    while llm_engine.has_unfinished():
        final += llm_engine.step(final_only=True)
    (whole,) = final
    assert (whole.outputs[0].token_ids, whole.outputs[0].text) == (ids, text)


def test_many_concurrent_requests_all_finish(engine):
    async def main():
        params = SamplingParams(temperature=0.0, max_tokens=6)
        return await asyncio.gather(*[_collect(engine, f"Prompt number {i}", params) for i in range(12)])

    results = asyncio.run(main())
    assert all(r[-1].finished and r[-1].num_output_tokens == len(_joined(r)[0]) == 6 for r in results)


def test_leaving_the_stream_early_aborts_and_frees(engine):
    async def main():
        stream = engine.generate("Count slowly", SamplingParams(temperature=0.0, max_tokens=500))
        async for _ in stream:
            break
        await stream.aclose()
        for _ in range(200):  # the engine thread applies the abort between steps
            if not engine.engine.has_unfinished():
                return True
            await asyncio.sleep(0.01)
        return False

    assert asyncio.run(main())
    kv = engine.engine.scheduler.kv
    assert kv.num_free_blocks() == kv.block_pool.num_blocks


def test_validation_errors_reach_the_caller(engine):
    with pytest.raises(ValidationError):
        asyncio.run(_collect(engine, [10**9], SamplingParams()))
    # The engine is still healthy afterwards.
    assert asyncio.run(_collect(engine, "ok", SamplingParams(max_tokens=2)))[-1].finished


def test_step_failure_fails_every_request_and_later_ones(engine):
    def broken(_sched, _interrupt=None):
        raise RuntimeError("device fell over")

    engine.engine.core.runner.execute = broken

    async def main():
        params = SamplingParams(max_tokens=5)
        return await asyncio.gather(*[_collect(engine, f"p{i}", params) for i in range(3)],
                                    return_exceptions=True)

    results = asyncio.run(main())
    assert len(results) == 3 and all(isinstance(r, EngineDeadError) for r in results)
    assert "device fell over" in str(results[0])
    assert engine.is_dead
    with pytest.raises(EngineDeadError):
        asyncio.run(_collect(engine, "after", SamplingParams(max_tokens=2)))


def test_event_loop_runs_while_a_step_is_in_progress(engine):
    """A step blocked inside the runner must not block the event loop."""
    entered, release = threading.Event(), threading.Event()
    execute = engine.engine.core.runner.execute

    def slow(sched, interrupt=None):
        entered.set()
        release.wait(timeout=30)
        return execute(sched, interrupt)

    engine.engine.core.runner.execute = slow

    async def main():
        task = asyncio.create_task(_collect(engine, "Hi", SamplingParams(max_tokens=3)))
        while not entered.is_set():
            await asyncio.sleep(0.005)
        # The step is stuck in the runner; other coroutines still run.
        ticks = 0
        for _ in range(5):
            await asyncio.sleep(0)
            ticks += 1
        assert not task.done()
        release.set()
        outs = await task
        return ticks, outs

    ticks, outs = asyncio.run(main())
    assert ticks == 5 and outs[-1].finished


def test_a_slow_reader_gets_the_steps_it_missed_merged_into_one_delta(engine):
    """While the reader is away the engine keeps stepping; the mailbox folds
    the deltas together, so the reader's next output has every step's text,
    ids and logprobs in order, exactly as a prompt reader saw them."""
    params = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=24, logprobs=3, n=2)

    async def prompt_reader():
        return [out async for out in engine.generate("Hello there", params)]

    async def slow_reader():
        outs = []
        async for out in engine.generate("Hello there", params):
            outs.append(out)
            while engine.engine.has_unfinished():  # let the engine finish while we do not read
                await asyncio.sleep(0.01)
        return outs

    prompt, slow = asyncio.run(prompt_reader()), asyncio.run(slow_reader())
    assert len(slow) <= 2 < len(prompt) and slow[-1].finished
    for index in (0, 1):
        def joined(outs):
            parts = [c for o in outs for c in o.outputs if c.index == index]
            return (sum((c.token_ids for c in parts), []), "".join(c.text for c in parts),
                    [lp for c in parts for lp in c.logprobs], [c.finish_reason for c in parts if c.finished])

        ids, text, logprobs, finish = joined(slow)
        assert (ids, text, logprobs, finish) == joined(prompt)
        assert len(ids) == 24 and [lp.token_id for lp in logprobs] == ids and finish == ["length"]
    assert slow[-1].num_output_tokens == prompt[-1].num_output_tokens == 48
