"""The SLO monitor with an injected clock and injected TTFT samples: it
fires once on a breach, does not flap, resolves, and delivers Alertmanager
webhook payloads to a real HTTP receiver."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gateway.slo import ALERT_NAME, SloConfig, SloMonitor, WebhookNotifier, p99, webhook_payload
from gateway.tenancy import Tier

pytestmark = pytest.mark.anyio


class Receiver:
    """An HTTP server on a free port that keeps every JSON body POSTed to it."""

    def __init__(self):
        received = self.payloads = []
        self.arrived = threading.Event()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["content-length"]))
                received.append(json.loads(body))
                self.send_response(200)
                self.end_headers()
                outer.arrived.set()

            def log_message(self, *args):
                pass

        outer = self
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/alerts"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def wall(self) -> dt.datetime:
        return dt.datetime(2026, 11, 21, tzinfo=dt.UTC) + dt.timedelta(seconds=self.now)


CONFIG = SloConfig(ttft_slo_s=0.5, ttft_alert_s=0.4, fast_window_s=60, slow_window_s=600, burn_rate=1.0,
                   min_samples=10, min_hold_s=30)


def monitor_with(clock: Clock, config: SloConfig = CONFIG) -> SloMonitor:
    return SloMonitor(config, clock=clock, wall_clock=clock.wall)


def feed(monitor: SloMonitor, clock: Clock, ttfts: list[float], tier: Tier = Tier.PREMIUM, step_s: float = 0.5):
    for ttft in ttfts:
        clock.now += step_s
        monitor.observe(tier, ttft)


async def settle(monitor: SloMonitor):
    await monitor.notifier.aclose()


def test_p99_is_the_nearest_rank():
    assert p99([]) is None
    assert p99([0.1] * 99 + [5.0]) == 0.1
    assert p99([0.1] * 98 + [5.0, 5.0]) == 5.0


async def test_fast_premium_traffic_does_not_page(receiver):
    clock = Clock()
    monitor = monitor_with(clock, SloConfig(**{**CONFIG.__dict__, "webhook_urls": (receiver.url,)}))
    feed(monitor, clock, [0.05] * 200)
    feed(monitor, clock, [2.0] * 50, tier=Tier.STANDARD)  # standard is slow, but not paged
    await settle(monitor)
    assert monitor.firing() == [] and receiver.payloads == []


async def test_fires_once_does_not_flap_and_resolves(receiver):
    clock = Clock()
    monitor = monitor_with(clock, SloConfig(**{**CONFIG.__dict__, "webhook_urls": (receiver.url,)}))
    feed(monitor, clock, [0.05] * 100)  # healthy traffic first
    feed(monitor, clock, [0.9])
    assert monitor.firing() == []  # 1 slow request in 101: the p99 is still under 400 ms
    feed(monitor, clock, [0.9])
    [alert] = monitor.firing()  # 2 in 102: the p99 is over it, in both windows
    assert alert.labels["tier"] == "premium" and alert.labels["alertname"] == ALERT_NAME
    fired_at, fired_wall = clock.now, clock.wall()

    # Oscillating around the threshold inside the hold time: no resolve, no second fire.
    for _ in range(10):
        feed(monitor, clock, [0.05] * 30, step_s=0.05)
        feed(monitor, clock, [0.9] * 3, step_s=0.05)
    assert clock.now - fired_at < CONFIG.min_hold_s and len(monitor.firing()) == 1

    # Healthy again: once the slow samples leave the fast window and the hold is over, it resolves.
    clock.now += CONFIG.fast_window_s
    feed(monitor, clock, [0.05] * 20)
    assert monitor.firing() == []
    resolved_at = clock.now
    # A new burst right after resolving waits out the hold before firing again.
    feed(monitor, clock, [0.9] * 40, step_s=0.1)
    assert monitor.firing() == [] and clock.now - resolved_at < CONFIG.min_hold_s
    clock.now = resolved_at + CONFIG.min_hold_s
    monitor.evaluate()
    assert len(monitor.firing()) == 1

    await settle(monitor)
    statuses = [p["status"] for p in receiver.payloads]
    assert statuses == ["firing", "resolved", "firing"]
    firing, resolved = receiver.payloads[0], receiver.payloads[1]
    assert firing["version"] == "4" and firing["receiver"] == "loragw"
    assert firing["groupKey"] == '{}:{alertname="%s",tier="premium"}' % ALERT_NAME
    assert firing["groupLabels"] == {"alertname": ALERT_NAME, "tier": "premium"}
    [a] = firing["alerts"]
    assert a["status"] == "firing" and a["endsAt"] == "0001-01-01T00:00:00Z"
    assert a["labels"]["severity"] == "page" and "above the 400 ms" in a["annotations"]["summary"]
    assert a["startsAt"] == fired_wall.isoformat().replace("+00:00", "Z")
    [r] = resolved["alerts"]
    assert r["status"] == "resolved" and r["startsAt"] == a["startsAt"] and r["endsAt"] > r["startsAt"]
    assert r["fingerprint"] == a["fingerprint"]


async def test_a_short_spike_without_slow_window_burn_does_not_page(receiver):
    clock = Clock()
    config = SloConfig(**{**CONFIG.__dict__, "burn_rate": 10.0, "webhook_urls": (receiver.url,)})
    monitor = monitor_with(clock, config)
    feed(monitor, clock, [0.05] * 1000, step_s=0.5)  # 500 s of healthy traffic fills the slow window
    feed(monitor, clock, [0.9] * 15, step_s=0.1)  # fast window burns (15 bad of ~135), slow one not
    fast, slow = monitor.burn(Tier.PREMIUM)
    assert fast.burn_rate >= 10.0 > slow.burn_rate
    await settle(monitor)
    assert monitor.firing() == [] and receiver.payloads == []


async def test_an_unreachable_receiver_never_blocks_and_other_receivers_still_get_it(receiver):
    clock = Clock()
    config = SloConfig(**{**CONFIG.__dict__, "webhook_urls": ("http://127.0.0.1:9/down", receiver.url)})
    monitor = SloMonitor(config, clock=clock, wall_clock=clock.wall,
                         notifier=WebhookNotifier(config.webhook_urls, timeout_s=2.0, backoff_s=0.01))
    feed(monitor, clock, [0.9] * 10)
    assert len(monitor.firing()) == 1  # observe() returned at once, delivery runs in the background
    await asyncio.wait_for(asyncio.to_thread(receiver.arrived.wait, 10), 15)
    assert receiver.payloads[0]["status"] == "firing"
    await monitor.stop()
    assert monitor.notifier.failed == 1


def test_webhook_payload_shape():
    from gateway.slo import Alert

    start = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
    alert = Alert({"alertname": ALERT_NAME, "tier": "premium"}, {"summary": "s"}, start,
                  ends_at=start + dt.timedelta(minutes=5))
    payload = webhook_payload(alert, "http://gw:8000")
    assert payload["status"] == "resolved" and payload["externalURL"] == "http://gw:8000"
    assert payload["alerts"][0]["startsAt"] == "2026-01-02T03:04:05Z"
    assert payload["alerts"][0]["endsAt"] == "2026-01-02T03:09:05Z"
    assert set(payload) == {"version", "groupKey", "truncatedAlerts", "status", "receiver", "groupLabels",
                            "commonLabels", "commonAnnotations", "externalURL", "alerts"}
