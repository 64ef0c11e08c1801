"""A discrete-event simulation of a fleet behind one gateway: Poisson
arrivals in two tiers, the real admission controller (gateway/admission.py),
the real router (gateway/router/) reading the snapshots the simulated
workers publish, and simulated workers (benchmarks/sim_worker.py) that run
the real scheduler. Nothing here sleeps: time is the simulation's clock.

The workload: `num_adapters` LoRA adapters drawn with Zipf popularity, each
owned by one of `num_tenants` tenants and each with its own system prompt
(the shared prefix that prefix caching and prefix-aware routing are for),
followed by a user message of random tokens; output lengths are geometric
and forced (no EOS), as in benchmarks/throughput.py.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from sim_worker import SimWorker

from engine.request import Request, Tier
from engine.sampling_params import SamplingParams
from gateway.admission import AdmissionController, Ticket
from gateway.config import TierLimits
from gateway.engine_client import KVCapacity
from gateway.errors import RateLimited
from gateway.router import Ranking, RouteRequest, RoutingPolicy, WorkerView
from gateway.router.affinity import queue_depth
from gateway.router.base import candidates
from gateway.tenancy import Principal, Tenant

VOCAB = (1000, 48000)  # token ids drawn, clear of special ids and the sampled token


@dataclass(frozen=True)
class WorkloadShape:
    num_adapters: int = 1000
    zipf_s: float = 1.1
    num_tenants: int = 100
    system_prompt: tuple[int, int] = (64, 512)  # tokens, per adapter, uniform
    user_prompt: tuple[int, int] = (16, 256)  # tokens, per request, uniform
    mean_output: int = 64
    max_output: int = 256

    def mean_request_tokens(self) -> tuple[float, float]:
        """(prompt, output) tokens of the average request."""
        p = 1.0 / self.mean_output
        mean_out = (1 - (1 - p) ** self.max_output) / p  # geometric, capped
        return sum(self.system_prompt) / 2 + sum(self.user_prompt) / 2, mean_out


@dataclass(frozen=True)
class Arrival:
    t: float
    tier: Tier
    adapter: int
    user_prompt: tuple[int, ...]
    output_len: int


class Workload:
    def __init__(self, shape: WorkloadShape, seed: int):
        self.shape = shape
        self.seed = seed
        self._cum = list(itertools.accumulate(1.0 / (k + 1) ** shape.zipf_s for k in range(shape.num_adapters)))
        self._system: dict[int, list[int]] = {}

    def arrivals(self, rates: dict[Tier, float], duration_s: float) -> list[Arrival]:
        """Independent Poisson streams per tier, merged in time order."""
        rng = random.Random(self.seed)
        out: list[Arrival] = []
        for tier, rate in sorted(rates.items(), key=lambda kv: kv[0].rank):
            t = 0.0
            while rate > 0:
                t += rng.expovariate(rate)
                if t >= duration_s:
                    break
                out.append(self._arrival(rng, t, tier))
        return sorted(out, key=lambda a: a.t)

    def _arrival(self, rng: random.Random, t: float, tier: Tier) -> Arrival:
        s = self.shape
        adapter = rng.choices(range(s.num_adapters), cum_weights=self._cum)[0]
        user = tuple(rng.randrange(*VOCAB) for _ in range(rng.randint(*s.user_prompt)))
        length = 1
        while rng.random() >= 1.0 / s.mean_output and length < s.max_output:
            length += 1
        return Arrival(t, tier, adapter, user, length)

    def system_prompt(self, adapter: int) -> list[int]:
        if adapter not in self._system:
            rng = random.Random(f"{self.seed}-system-{adapter}")
            self._system[adapter] = [rng.randrange(*VOCAB) for _ in range(rng.randint(*self.shape.system_prompt))]
        return self._system[adapter]

    def owner(self, adapter: int) -> int:
        return adapter % self.shape.num_tenants


@dataclass
class RequestRecord:
    arrival: Arrival
    status: str = "queued"  # queued, refused (429), finished, aborted
    worker: int = -1
    first_token_t: float | None = None
    finish_t: float | None = None
    request: Request | None = None
    ticket: Ticket | None = None

    @property
    def ttft(self) -> float:
        """inf if it never produced a token (aborted at the end of the run)."""
        return math.inf if self.first_token_t is None else self.first_token_t - self.arrival.t


@dataclass
class FleetRun:
    """Everything a run leaves behind, for the report and the tests."""

    records: list[RequestRecord]
    workers: list[SimWorker]
    sim_end_s: float
    steps: int
    extra: dict = field(default_factory=dict)


class SimClock:
    """The simulation's time, read by the router, the admission controller
    and the workers as the gateway's monotonic clock."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class LeastLoadedRouter(RoutingPolicy):
    """A baseline for the simulation only (no gateway policy): the worker
    with the shortest queue, then the fewest requests in flight."""

    name = "least-loaded"

    def rank(self, request: RouteRequest, workers, *, exclude=()) -> Ranking:
        alive = candidates(workers, exclude)
        return Ranking(tuple(w.worker_id for w in sorted(alive, key=lambda w: (queue_depth(w), w.in_flight))))

    def record(self, request: RouteRequest, worker: WorkerView) -> None:
        """Remembers nothing: it reads the views alone."""

    def forget_worker(self, worker_id: str) -> None:
        """Remembers nothing."""


class FleetSim:
    def __init__(self, clock: SimClock, workers: list[SimWorker], router: RoutingPolicy, workload: Workload,
                 tier_limits: dict[Tier, TierLimits]):
        self._clock = clock
        self.workers = workers
        self.router = router
        self.workload = workload
        self.admission = AdmissionController(tier_limits, self._capacity, clock=clock)
        self.in_flight = [0] * len(workers)
        self._events: list[tuple[float, int, str, object]] = []
        self._seq = itertools.count()
        self._ids = itertools.count()
        self._pending_steps: dict[int, tuple] = {}
        self._records: dict[str, RequestRecord] = {}
        self._principals: dict[tuple[Tier, int], Principal] = {}
        self._steps = 0
        # Called with a worker after each of its steps (the tests check invariants).
        self.after_step: Callable[[SimWorker], None] | None = None

    @property
    def now(self) -> float:
        return self._clock.now

    @now.setter
    def now(self, t: float) -> None:
        self._clock.now = t

    def run(self, arrivals: list[Arrival], end_s: float) -> FleetRun:
        """Serve `arrivals`, then stop at `end_s`: requests still open then
        are aborted (and count as never finished)."""
        records = [RequestRecord(a) for a in arrivals]
        for rec in records:
            self._push(rec.arrival.t, "arrival", rec)
        while self._events and self._events[0][0] <= end_s:
            self.now, _, kind, payload = heapq.heappop(self._events)
            if kind == "arrival":
                self._arrive(payload)
            elif kind == "step_end":
                self._end_step(payload)
            else:  # "wake": a worker waited for adapter weights
                self._kick(payload)
        if self._events:
            self.now = end_s
        self._abort_open()
        return FleetRun(records, self.workers, self.now, self._steps)

    # ---- arrivals --------------------------------------------------------------------

    def _arrive(self, rec: RequestRecord) -> None:
        a = rec.arrival
        prompt = self.workload.system_prompt(a.adapter) + list(a.user_prompt)
        try:
            rec.ticket = _without_suspending(
                self.admission.admit(self._principal(a), prompt_tokens=len(prompt), max_tokens=a.output_len))
        except RateLimited:
            rec.status = "refused"
            return
        tenant = self._principal(a).tenant
        adapter_key = (f"adapter-{a.adapter}", 1, f"digest-{a.adapter}")
        route = RouteRequest(tenant.id, self._principal(a).cache_salt, a.tier, adapter_key, prompt)
        views = [WorkerView(w.worker_id, True, w.snapshot, self.in_flight[i]) for i, w in enumerate(self.workers)]
        best = self.router.rank(route, views).best
        index = next(i for i, w in enumerate(self.workers) if w.worker_id == best)
        self.router.record(route, views[index])
        req = Request(request_id=f"req-{next(self._ids)}", prompt_token_ids=prompt,
                      sampling_params=SamplingParams(temperature=0.0, max_tokens=a.output_len,
                                                     min_tokens=a.output_len, ignore_eos=True),
                      arrival_seq=next(self._seq), tier=a.tier, adapter_key=adapter_key,
                      cache_salt=route.cache_salt, eos_token_ids=frozenset())
        self.workers[index].add_request(req)
        rec.request, rec.worker, rec.status = req, index, "running"
        self._records[req.request_id] = rec
        self.in_flight[index] += 1
        self._kick(index)

    def _principal(self, a: Arrival) -> Principal:
        key = (a.tier, self.workload.owner(a.adapter))
        if key not in self._principals:
            tenant_id = f"{a.tier.value}-tenant-{key[1]}"
            self._principals[key] = Principal(Tenant(tenant_id, tenant_id, a.tier), key_id=tenant_id)
        return self._principals[key]

    def _capacity(self) -> KVCapacity:
        snapshots = [w.snapshot for w in self.workers if w.snapshot is not None]
        if not snapshots:
            shape = self.workers[0].scheduler.kv
            total = shape.block_pool.num_blocks * shape.block_size * len(self.workers)
            return KVCapacity(total, shape.premium_reserved_blocks * shape.block_size * len(self.workers))
        return KVCapacity.of(snapshots)

    # ---- worker steps ----------------------------------------------------------------

    def _kick(self, index: int) -> None:
        """Start the worker's next step unless one is in flight."""
        worker = self.workers[index]
        if worker.busy or not worker.scheduler.has_unfinished():
            return
        started = worker.begin_step()
        if started is None:
            ready = worker.lora_slots.next_load_done()
            if ready is not None:
                self._push(max(ready, self.now), "wake", index)
            return
        self._steps += 1
        self._pending_steps[index] = (*started, float(self._steps))
        self._push(self.now + started[1], "step_end", index)

    def _end_step(self, index: int) -> None:
        out, busy_s, step = self._pending_steps.pop(index)
        for update in self.workers[index].end_step(out, busy_s):
            rec = self._records[update.request_id]
            if rec.first_token_t is None:
                rec.first_token_t = self.now
                # The step's number, not the time: two workers' steps may end at one simulated moment, and
                # admission counts a step's first tokens as one group.
                rec.ticket.started(step=step)
            if update.finish_reason is not None:
                self._close(rec, "finished")
        if self.after_step is not None:
            self.after_step(self.workers[index])
        self._kick(index)

    def _close(self, rec: RequestRecord, status: str) -> None:
        rec.status, rec.finish_t = status, self.now
        rec.ticket.release(completion_tokens=len(rec.request.output_token_ids))
        self.in_flight[rec.worker] -= 1
        del self._records[rec.request.request_id]

    def _abort_open(self) -> None:
        self._pending_steps.clear()
        for worker in self.workers:
            for request_id in worker.abort_all():
                self._close(self._records[request_id], "aborted")
            worker.busy = False

    def _push(self, t: float, kind: str, payload) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, payload))


def _without_suspending(coro):
    """The result of a coroutine that never waits. Admission is async for
    the Redis limiter; the in-memory one the simulation uses never suspends,
    so one send runs it to the end, on the simulation's clock."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise RuntimeError("admission suspended: the simulation needs the in-memory tenant limiter")
