"""The queue-depth scaler alone: pure decisions on hand-made queues and times."""

import pytest

from gateway.workers.scaling import QueueDepthScaler, ScalingPolicy


def scaler(**kw) -> QueueDepthScaler:
    defaults = dict(min_workers=1, max_workers=4, target_waiting_per_worker=4, scale_down_after_s=60, cooldown_s=30)
    return QueueDepthScaler(ScalingPolicy(**{**defaults, **kw}))


def test_starts_the_minimum_and_never_exceeds_the_maximum():
    s = scaler(min_workers=2)
    assert s.desired(0, [], now=0) == 2
    s = scaler(max_workers=3, cooldown_s=0)
    assert s.desired(2, [100, 100], now=0) == 3
    assert s.desired(3, [100, 100, 100], now=1) == 3
    assert s.desired(5, [0] * 5, now=2) == 3  # more than allowed (a replica's leftovers): trimmed


def test_scales_up_to_cover_the_queue_at_the_target_depth():
    s = scaler(cooldown_s=0)
    assert s.desired(1, [4], now=0) == 1  # at the target, not over it
    assert s.desired(1, [5], now=1) == 2
    assert s.desired(2, [10, 7], now=2) == 4  # 17 waiting / 4 per worker, capped at max


def test_cooldown_holds_decisions_after_a_change():
    s = scaler(cooldown_s=30)
    assert s.desired(1, [9], now=0) == 3
    assert s.desired(3, [30, 30, 30], now=10) == 3  # still cooling down
    assert s.desired(3, [30, 30, 30], now=31) == 4


def test_scales_down_one_at_a_time_after_a_quiet_period():
    s = scaler(cooldown_s=0, scale_down_after_s=60)
    assert s.desired(3, [0, 0, 0], now=0) == 3
    assert s.desired(3, [0, 0, 0], now=59) == 3
    assert s.desired(3, [0, 0, 0], now=60) == 2
    assert s.desired(2, [0, 0], now=61) == 2  # the quiet clock restarted
    assert s.desired(2, [1, 0], now=100) == 2  # a waiting request resets it
    assert s.desired(2, [0, 0], now=101) == 2
    assert s.desired(2, [0, 0], now=161) == 1
    assert s.desired(1, [0], now=500) == 1  # never below the minimum


def test_running_requests_alone_do_not_scale_up():
    # Queue depth is the signal: busy workers with nothing waiting are enough.
    s = scaler(cooldown_s=0)
    assert s.desired(2, [0, 0], now=0) == 2


@pytest.mark.parametrize("kw", [dict(min_workers=3, max_workers=2), dict(max_workers=0),
                                dict(target_waiting_per_worker=0)])
def test_bad_policies_are_refused(kw):
    with pytest.raises(ValueError):
        ScalingPolicy(**{**dict(min_workers=1, max_workers=2), **kw})


def test_ray_without_the_extra_is_a_config_error_not_a_traceback(monkeypatch):
    import importlib.util

    from gateway.config import ConfigError, GatewayConfig, WorkerPoolConfig
    from gateway.workers.fleet import ray_workers

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    config = GatewayConfig(worker_pool=WorkerPoolConfig(ray_address="auto", worker_secret="s" * 32))
    with pytest.raises(ConfigError, match="loragw\\[ray\\]"):
        ray_workers(config)
