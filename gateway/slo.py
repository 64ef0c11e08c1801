"""The in-process TTFT SLO monitor: page when a tier's TTFT p99 slips.

The SLO: `objective` (99%) of a tier's requests see their first token within
`ttft_slo_s` (500 ms). The monitor pages earlier, at `ttft_alert_s` (400 ms):
a request slower than that is "bad", and the error budget is the 1% of
requests that may be bad. The burn rate over a window is the bad share
divided by that budget, so a burn rate above 1 means the window's TTFT p99
is above the alert threshold.

Multi-window, in the style of the SRE workbook: the alert fires only when
the fast window (5 min) and the slow window (1 h) both burn at `burn_rate`
or more (the slow one proves the budget is really going, the fast one that
it is still going), and the fast window holds at least `min_samples`
requests. It resolves when the fast window stops burning. Either change
waits `min_hold_s` after the previous one, so the alert never flaps.

Time comes from the injected `clock` (windows) and `wall_clock` (the
payload's timestamps): tests feed samples and move time by hand. Firing and
resolving POST an Alertmanager webhook (version 4) to every configured URL
from a background task, so no request ever waits on a receiver.
"""

from __future__ import annotations

import asyncio
import collections
import datetime as dt
import hashlib
import logging
import math
from dataclasses import dataclass, field
from typing import Callable

import httpx

from engine.config_flags import setting
from gateway.lifecycle import RequestObserver, RequestRecord
from gateway.tenancy import Tier

log = logging.getLogger(__name__)

ALERT_NAME = "LoragwTTFTP99High"
RECEIVER = "loragw"
# Alertmanager's "no end time yet".
ZERO_TIME = "0001-01-01T00:00:00Z"
_BUCKETS_PER_WINDOW = 60  # the fast window's resolution
_MAX_RAW_SAMPLES = 10_000  # per tier, for the reported p99
_DELIVERY_ATTEMPTS = 3


@dataclass(frozen=True)
class SloConfig:
    ttft_slo_s: float = setting(0.5, flag="--slo-ttft", help="TTFT SLO in seconds (p99 of premium)")
    ttft_alert_s: float = setting(0.4, help="page when premium's TTFT p99 passes this (seconds)")
    objective: float = setting(0.99, help="share of requests that must see their first token within the SLO")
    fast_window_s: float = setting(300.0, help="SLO burn-rate fast window, seconds")
    slow_window_s: float = setting(3600.0, help="SLO burn-rate slow window, seconds")
    burn_rate: float = setting(1.0, help="page when both windows burn the budget this fast")
    min_samples: int = setting(20, help="requests in the fast window before it can page")
    min_hold_s: float = setting(60.0, help="seconds an alert stays firing/resolved at least")
    eval_interval_s: float = setting(5.0, help="seconds between evaluations of the windows")
    paged_tiers: tuple[Tier, ...] = setting((Tier.PREMIUM,), flag=None, help="the tiers whose TTFT can page")
    webhook_urls: tuple[str, ...] = setting((), flag="--alert-webhook-url",
                                            help="Alertmanager-style webhook receivers, comma-separated")
    # This gateway's address, for the payload's generatorURL; the CLI derives it from --host and --port.
    external_url: str = setting("", flag=None, help="this gateway's address")

    def __post_init__(self):
        if not 0 < self.objective < 1:
            raise ValueError(f"objective must be in (0, 1), got {self.objective}")
        if not 0 < self.fast_window_s <= self.slow_window_s:
            raise ValueError("need 0 < fast_window_s <= slow_window_s")


@dataclass(frozen=True)
class WindowBurn:
    window_s: float
    samples: int
    bad: int
    burn_rate: float  # bad share / (1 - objective)


@dataclass
class _Window:
    """Sample and bad counts over the last `length_s`, in time buckets."""

    length_s: float
    bucket_s: float
    buckets: collections.deque = field(default_factory=collections.deque)  # [start, samples, bad]
    samples: int = 0
    bad: int = 0

    def add(self, now: float, bad: bool) -> None:
        start = math.floor(now / self.bucket_s) * self.bucket_s
        if not self.buckets or self.buckets[-1][0] != start:
            self.buckets.append([start, 0, 0])
        self.buckets[-1][1] += 1
        self.buckets[-1][2] += int(bad)
        self.samples += 1
        self.bad += int(bad)

    def expire(self, now: float) -> None:
        while self.buckets and self.buckets[0][0] + self.bucket_s <= now - self.length_s:
            _, samples, bad = self.buckets.popleft()
            self.samples -= samples
            self.bad -= bad

    def burn(self, budget: float) -> WindowBurn:
        rate = (self.bad / self.samples) / budget if self.samples else 0.0
        return WindowBurn(self.length_s, self.samples, self.bad, rate)


@dataclass
class _TierState:
    fast: _Window
    slow: _Window
    recent: collections.deque  # (time, ttft) within the fast window, for the p99
    firing: Alert | None = None
    changed_at: float | None = None  # clock time of the last fire or resolve


@dataclass(frozen=True)
class Alert:
    labels: dict[str, str]
    annotations: dict[str, str]
    starts_at: dt.datetime
    ends_at: dt.datetime | None = None
    generator_url: str = ""

    @property
    def fingerprint(self) -> str:
        text = ",".join(f"{k}={v}" for k, v in sorted(self.labels.items()))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def to_json(self) -> dict:
        return {"status": "resolved" if self.ends_at else "firing", "labels": self.labels,
                "annotations": self.annotations, "startsAt": _rfc3339(self.starts_at),
                "endsAt": _rfc3339(self.ends_at) if self.ends_at else ZERO_TIME,
                "generatorURL": self.generator_url, "fingerprint": self.fingerprint}


def webhook_payload(alert: Alert, external_url: str = "") -> dict:
    """Alertmanager's webhook body (version 4) for one alert group."""
    group = {"alertname": alert.labels["alertname"], "tier": alert.labels["tier"]}
    group_key = "{}:{" + ",".join(f'{k}="{v}"' for k, v in group.items()) + "}"
    return {"version": "4", "groupKey": group_key, "truncatedAlerts": 0,
            "status": "resolved" if alert.ends_at else "firing", "receiver": RECEIVER,
            "groupLabels": group, "commonLabels": alert.labels, "commonAnnotations": alert.annotations,
            "externalURL": external_url, "alerts": [alert.to_json()]}


def _rfc3339(t: dt.datetime) -> str:
    return t.astimezone(dt.UTC).isoformat().replace("+00:00", "Z")


def p99(values: list[float], q: float = 0.99) -> float | None:
    """The nearest-rank quantile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


class WebhookNotifier:
    """POSTs payloads to every URL from background tasks, with a few retries;
    `aclose()` waits for the ones in flight (bounded) at shutdown."""

    def __init__(self, urls: tuple[str, ...], *, timeout_s: float = 5.0, backoff_s: float = 0.5):
        self.urls = urls
        self.timeout_s = timeout_s
        self.backoff_s = backoff_s
        self._client: httpx.AsyncClient | None = None
        self._tasks: set[asyncio.Task] = set()
        self._last: dict[str, asyncio.Task] = {}  # the latest delivery per URL
        self.delivered = 0
        self.failed = 0

    def notify(self, payload: dict) -> None:
        if not self.urls:
            return
        loop = asyncio.get_running_loop()
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.timeout_s)
        for url in self.urls:
            # Each receiver gets its payloads in order: a resolve never
            # overtakes the firing it resolves.
            task = loop.create_task(self._post(url, payload, after=self._last.get(url)))
            self._last[url] = task
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _post(self, url: str, payload: dict, after: asyncio.Task | None) -> None:
        if after is not None:
            await asyncio.wait([after])
        for attempt in range(_DELIVERY_ATTEMPTS):
            try:
                response = await self._client.post(url, json=payload)
                response.raise_for_status()
                self.delivered += 1
                return
            except httpx.HTTPError as exc:
                log.warning("alert webhook %s failed (attempt %d): %s", url, attempt + 1, exc)
                await asyncio.sleep(self.backoff_s * 2**attempt)
        self.failed += 1

    async def aclose(self, timeout_s: float = 5.0) -> None:
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)
        if self._client is not None:
            await self._client.aclose()
            self._client = None


class SloMonitor(RequestObserver):
    def __init__(self, config: SloConfig, *, clock: Callable[[], float],
                 wall_clock: Callable[[], dt.datetime], notifier: WebhookNotifier | None = None):
        self.config = config
        self.clock = clock
        self.wall_clock = wall_clock
        self.notifier = notifier if notifier is not None else WebhookNotifier(config.webhook_urls)
        bucket_s = config.fast_window_s / _BUCKETS_PER_WINDOW
        self._tiers = {tier: _TierState(_Window(config.fast_window_s, bucket_s),
                                        _Window(config.slow_window_s, bucket_s),
                                        collections.deque(maxlen=_MAX_RAW_SAMPLES)) for tier in Tier}
        self._task: asyncio.Task | None = None

    # ---- samples in ---------------------------------------------------------------

    def on_request_end(self, record: RequestRecord) -> None:
        ttft = record.ttft_s
        if ttft is None and record.finish_reason in ("abort", "client_disconnect"):
            ttft = record.e2e_s  # gave up before a first token: TTFT was at least this
        if ttft is not None:
            self.observe(record.tier, ttft)

    def observe(self, tier: Tier, ttft_s: float, now: float | None = None) -> None:
        now = self.clock() if now is None else now
        state = self._tiers[tier]
        bad = ttft_s > self.config.ttft_alert_s
        state.fast.add(now, bad)
        state.slow.add(now, bad)
        state.recent.append((now, ttft_s))
        self.evaluate(now)

    # ---- decisions ----------------------------------------------------------------

    def burn(self, tier: Tier, now: float | None = None) -> tuple[WindowBurn, WindowBurn]:
        now = self.clock() if now is None else now
        state, budget = self._tiers[tier], 1.0 - self.config.objective
        state.fast.expire(now)
        state.slow.expire(now)
        return state.fast.burn(budget), state.slow.burn(budget)

    def ttft_p99(self, tier: Tier, now: float | None = None) -> float | None:
        """TTFT p99 over the fast window."""
        now = self.clock() if now is None else now
        recent = self._tiers[tier].recent
        cutoff = now - self.config.fast_window_s
        while recent and recent[0][0] < cutoff:
            recent.popleft()
        return p99([t for _, t in recent], self.config.objective)

    def evaluate(self, now: float | None = None) -> None:
        """Fire or resolve each paged tier's alert; the periodic task calls
        this too, so an alert resolves when traffic stops."""
        now = self.clock() if now is None else now
        cfg = self.config
        for tier in cfg.paged_tiers:
            state = self._tiers[tier]
            fast, slow = self.burn(tier, now)
            held = state.changed_at is None or now - state.changed_at >= cfg.min_hold_s
            if not held:
                continue
            if state.firing is None:
                if fast.samples >= cfg.min_samples and min(fast.burn_rate, slow.burn_rate) >= cfg.burn_rate:
                    state.firing = self._alert(tier, fast, slow, now)
                    state.changed_at = now
                    log.warning("SLO alert firing: %s", state.firing.annotations["summary"])
                    self.notifier.notify(webhook_payload(state.firing, cfg.external_url))
            elif fast.burn_rate < cfg.burn_rate:
                resolved = Alert(state.firing.labels, state.firing.annotations, state.firing.starts_at,
                                 ends_at=self.wall_clock(), generator_url=state.firing.generator_url)
                state.firing, state.changed_at = None, now
                log.warning("SLO alert resolved: %s", resolved.annotations["summary"])
                self.notifier.notify(webhook_payload(resolved, cfg.external_url))

    def firing(self) -> list[Alert]:
        return [s.firing for s in self._tiers.values() if s.firing is not None]

    def _alert(self, tier: Tier, fast: WindowBurn, slow: WindowBurn, now: float) -> Alert:
        cfg = self.config
        observed = self.ttft_p99(tier, now)
        labels = {"alertname": ALERT_NAME, "tier": tier.value, "severity": "page", "service": "loragw",
                  "slo": "ttft_p99"}
        annotations = {
            "summary": f"{tier.value} TTFT p99 is {_ms(observed)} ms, above the {_ms(cfg.ttft_alert_s)} ms "
                       f"alert threshold (SLO {_ms(cfg.ttft_slo_s)} ms)",
            "description": (f"Burn rate {fast.burn_rate:.1f} over {fast.window_s:g}s ({fast.bad}/{fast.samples} "
                            f"requests slower than {_ms(cfg.ttft_alert_s)} ms) and {slow.burn_rate:.1f} over "
                            f"{slow.window_s:g}s; paging at {cfg.burn_rate:g}."),
            "ttft_p99_seconds": f"{observed:.4f}" if observed is not None else "",
            "runbook_url": "docs/observability.md#answering-the-ttft-page",
        }
        return Alert(labels, annotations, self.wall_clock(), generator_url=cfg.external_url)

    # ---- the periodic evaluation ----------------------------------------------------

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.config.eval_interval_s)
            try:
                self.evaluate()
            except Exception:  # noqa: BLE001 - the monitor must outlive a bug in one evaluation
                log.exception("SLO evaluation failed")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        await self.notifier.aclose()


def _ms(seconds: float | None) -> str:
    return "?" if seconds is None else f"{seconds * 1000:.0f}"
