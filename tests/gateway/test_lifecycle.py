"""RequestLifecycle: one record per request, with the right finish reason,
handed to every observer exactly once."""

from __future__ import annotations

import datetime as dt

from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from gateway.lifecycle import RequestLifecycle, RequestObserver
from gateway.tenancy import Principal, Tenant, Tier


class Recorder(RequestObserver):
    def __init__(self):
        self.records = []

    def on_request_end(self, record):
        self.records.append(record)


class Broken(RequestObserver):
    def on_request_end(self, record):
        raise RuntimeError("observer bug")


class Ticket:
    def __init__(self):
        self.started_calls, self.released, self.steps = 0, [], []

    def started(self, step=None):
        self.started_calls += 1
        self.steps.append(step)

    def release(self, *, completion_tokens=None):
        self.released.append(completion_tokens)


class Gw:
    def __init__(self, observers):
        self.observers, self.in_flight, self.now = observers, 0, 100.0

    def clock(self):
        return self.now

    def wall_clock(self):
        return dt.datetime(2026, 11, 21, tzinfo=dt.UTC) + dt.timedelta(seconds=self.now)


PRINCIPAL = Principal(Tenant(id="t1", name="acme", tier=Tier.PREMIUM), key_id="k1")


def output(finished: bool, reasons=("stop",), tokens=3, error=None) -> RequestOutput:
    outs = [CompletionOutput(index=i, token_ids=list(range(tokens)), finish_reason=r if finished else None)
            for i, r in enumerate(reasons)]
    return RequestOutput("r1", None, [1, 2, 3, 4], outs, finished=finished, num_cached_tokens=2,
                         metrics=RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5,
                                                first_token_time=11.0), error=error,
                         num_output_tokens=tokens * len(reasons))


def lifecycle(gw, ticket):
    return RequestLifecycle(gw, ticket, PRINCIPAL, request_id="r1", model="tiny-lora@2",
                            adapter_key=("tiny-lora", 2, "abc"), adapter_owner="acme", prompt_tokens=4)


def test_a_finished_request_gives_one_record_to_every_observer():
    recorder, other = Recorder(), Recorder()
    gw, ticket = Gw([Broken(), recorder, other]), Ticket()
    life = lifecycle(gw, ticket)
    assert gw.in_flight == 1
    life.saw(output(False))
    gw.now += 2.5
    life.saw(output(True, reasons=("stop", "length")))
    life.close()
    life.close()
    assert gw.in_flight == 0 and ticket.released == [6]
    assert set(ticket.steps) == {11.0}  # the engine step of the first token, for admission's grouping
    assert len(recorder.records) == 1 and other.records == recorder.records
    r = recorder.records[0]
    assert (r.tenant, r.tier, r.key_id, r.adapter, r.adapter_version) == ("acme", Tier.PREMIUM, "k1", "tiny-lora", 2)
    assert (r.prompt_tokens, r.cached_prompt_tokens, r.completion_tokens) == (4, 2, 6)
    assert r.finish_reason == "length" and r.queue_time_s == 0.5 and r.ttft_s == 1.0 and r.e2e_s == 2.5


def test_finish_reasons_for_a_client_that_left_an_engine_error_and_no_output():
    cases = [(output(False), "client_disconnect"), (output(True, error="boom"), "error"),
             (output(True, reasons=("abort",)), "abort"), (None, "error")]
    for last, expected in cases:
        recorder = Recorder()
        life = lifecycle(Gw([recorder]), Ticket())
        if last is not None:
            life.saw(last)
        life.close()
        assert recorder.records[0].finish_reason == expected


def test_a_client_that_left_before_the_first_output_is_a_client_disconnect_not_an_error():
    recorder, ticket = Recorder(), Ticket()
    life = lifecycle(Gw([recorder]), ticket)
    life.client_left()
    life.close()
    [record] = recorder.records
    assert record.finish_reason == "client_disconnect" and record.completion_tokens == 0
    assert ticket.released == [None]


def test_the_record_goes_out_when_the_final_output_is_seen_before_the_response_ends():
    recorder = Recorder()
    gw = Gw([recorder])
    life = lifecycle(gw, Ticket())
    life.saw(output(True))
    # A process killed while the last bytes are on the wire has already reported.
    assert len(recorder.records) == 1 and gw.in_flight == 1
    life.close()
    assert len(recorder.records) == 1 and gw.in_flight == 0


def test_the_record_weighs_finish_reasons_from_every_delta():
    """Outputs are deltas: a choice that ended early ("length") is absent
    from the last one, which carries only the choice that ended there."""
    recorder = Recorder()
    life = lifecycle(Gw([recorder]), Ticket())
    early = output(False, reasons=("length", None), tokens=4)
    early.outputs[0].finish_reason = "length"
    last = output(True, reasons=("stop",), tokens=5)
    last.outputs[0].index, last.num_output_tokens = 1, 13
    life.saw(early)
    life.saw(last)
    life.close()
    (record,) = recorder.records
    assert record.finish_reason == "length" and record.completion_tokens == 13
