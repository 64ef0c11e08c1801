"""One step's usage split between the gateways whose requests it served.

A worker may serve several gateway replicas at once. Each gateway's meter
must see only its own requests, and the step's busy time must still be
charged exactly once across all of them (invariant 4). So each gateway gets
a StepUsage with its requests and its share of the busy time:
- an adapter load goes to a gateway with a request on that adapter in the
  step (the first such), else to the default gateway;
- the rest of the busy time is split by computed tokens, by largest
  remainder (billing.meter's rule), so the shares sum to it exactly;
- requests with no known gateway, and a step with no requests at all, go
  to the default gateway, whose meter books them as overhead.
Every gateway gets every preemption: its meter keeps a payer only for its
own victims, and a recompute caused by another gateway's request is
platform overhead.

Pure Python, no torch: the worker's engine thread runs it after each step.
"""

from __future__ import annotations

from typing import Callable, Hashable, TypeVar

from engine.step_io import StepUsage, split_exact

Peer = TypeVar("Peer", bound=Hashable)


def split_usage(step: StepUsage, owner_of: Callable[[str], Peer | None], default: Peer) -> dict[Peer, StepUsage]:
    """`owner_of(group_id)`: the gateway that sent the request, or None."""
    owners = [owner_of(r.group_id or r.request_id) or default for r in step.requests]
    peers = list(dict.fromkeys([default, *owners]))
    loads = {peer: [] for peer in peers}
    for load in step.adapter_loads:
        payer = next((o for o, r in zip(owners, step.requests) if r.adapter_key == load.adapter_key), default)
        loads[payer].append(load)
    load_us = min(step.busy_time_us, sum(x.load_us for x in step.adapter_loads))
    rest = step.busy_time_us - load_us
    tokens = [sum(r.computed_tokens for o, r in zip(owners, step.requests) if o == peer) for peer in peers]
    shares = split_exact(rest, tokens) if sum(tokens) else [rest] + [0] * (len(peers) - 1)
    load_shares = split_exact(load_us, [sum(x.load_us for x in loads[peer]) for peer in peers])
    out = {}
    for peer, share, load_share in zip(peers, shares, load_shares):
        mine = tuple(r for o, r in zip(owners, step.requests) if o == peer)
        if peer != default and not mine and not loads[peer]:
            continue
        out[peer] = StepUsage(step_id=step.step_id, busy_time_us=share + load_share, requests=mine,
                              preemptions=step.preemptions, adapter_loads=tuple(loads[peer]))
    return out

