"""Retry and backoff policies, on a fake clock (no real time passes)."""

from __future__ import annotations

import random

import pytest

from fd_routing_replay.errors import (
    InvalidRolloutId,
    PermanentStoreError,
    RecordError,
    TransientStoreError,
)
from fd_routing_replay.writer.retry import (
    ConstantBackoff,
    ExponentialBackoff,
    RetryExhausted,
    RetryInterrupted,
    RetryPolicy,
    is_auth_failure,
    is_transient,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> bool:
        self.sleeps.append(seconds)
        self.now += seconds
        return True


def test_exponential_backoff_doubles_caps_and_jitters(seed):
    backoff = ExponentialBackoff(0.05, 1.0, jitter=0.5, rng=random.Random(seed))
    for failures in range(1, 12):
        nominal = min(1.0, 0.05 * 2 ** (failures - 1))
        for _ in range(50):
            delay = backoff.compute(failures)
            assert nominal * 0.5 <= delay <= nominal
    assert ExponentialBackoff(0.1, 0.4, jitter=0).compute(3) == pytest.approx(0.4)
    assert ExponentialBackoff(0.1, 10, jitter=0).compute(10_000) == 10


@pytest.mark.parametrize("bad", [dict(initial_s=0, max_s=1), dict(initial_s=2, max_s=1),
                                 dict(initial_s=1, max_s=2, jitter=1.5)])
def test_backoff_rejects_bad_settings(bad):
    with pytest.raises(ValueError):
        ExponentialBackoff(**bad)


def test_transient_failures_are_retried_until_success():
    clock = FakeClock()
    calls = []

    def flaky():
        calls.append(clock.now)
        if len(calls) < 4:
            raise TransientStoreError("connection refused")
        return "ok"

    failures = []
    policy = RetryPolicy(ConstantBackoff(0.5), 10.0, clock=clock)
    assert policy.call(flaky, sleep=clock.sleep,
                       on_failure=lambda n, exc: failures.append(n)) == "ok"
    assert failures == [1, 2, 3] and clock.sleeps == [0.5, 0.5, 0.5]


def test_deadline_bounds_the_total_wait():
    clock = FakeClock()
    calls = []

    def down():
        calls.append(clock.now)
        raise ConnectionRefusedError("down")

    policy = RetryPolicy(ExponentialBackoff(0.1, 0.8, jitter=0), 2.0, clock=clock)
    with pytest.raises(RetryExhausted) as info:
        policy.call(down, sleep=clock.sleep)
    assert calls[-1] == pytest.approx(2.0)  # the last attempt happens at the deadline
    assert sum(clock.sleeps) == pytest.approx(2.0)
    assert info.value.failures == len(calls)
    assert isinstance(info.value.last_error, ConnectionRefusedError)


def test_zero_deadline_means_one_attempt():
    clock = FakeClock()
    policy = RetryPolicy(ConstantBackoff(1), 0, clock=clock)
    with pytest.raises(RetryExhausted):
        policy.call(lambda: (_ for _ in ()).throw(TransientStoreError("x")), sleep=clock.sleep)
    assert clock.sleeps == []


@pytest.mark.parametrize("error", [PermanentStoreError("too big"), InvalidRolloutId("bad"),
                                   RecordError("corrupt"), KeyError("bug")])
def test_permanent_errors_propagate_at_once(error):
    clock = FakeClock()
    calls = []

    def fail():
        calls.append(1)
        raise error

    with pytest.raises(type(error)):
        RetryPolicy(ConstantBackoff(1), 100, clock=clock).call(fail, sleep=clock.sleep)
    assert calls == [1]


def test_interrupted_sleep_stops_retrying():
    def fail():
        raise TransientStoreError("down")

    with pytest.raises(RetryInterrupted):
        RetryPolicy(ConstantBackoff(1), 100).call(fail, sleep=lambda s: False)


def test_classification():
    assert is_transient(TransientStoreError("x"))
    assert is_transient(ConnectionResetError())
    assert is_transient(TimeoutError())
    assert not is_transient(PermanentStoreError("x"))
    assert not is_transient(ValueError("x"))
    assert not is_transient(RuntimeError("x"))


def test_auth_failures_are_recognised_through_the_cause_chain():
    from redis.exceptions import AuthenticationError, AuthorizationError

    try:
        try:
            raise AuthenticationError("invalid username-password pair")
        except AuthenticationError as exc:
            raise PermanentStoreError("redis: cannot put: check the ACL user name") from exc
    except PermanentStoreError as wrapped:
        assert is_auth_failure(wrapped)
    assert is_auth_failure(PermanentStoreError("cannot put: ResponseError: NOAUTH "
                                               "Authentication required."))
    assert is_auth_failure(PermanentStoreError("WRONGPASS invalid username-password pair"))
    assert not is_auth_failure(AuthorizationError("NOPERM this user has no permissions"))
    assert not is_auth_failure(PermanentStoreError("value too large"))
    assert not is_transient(PermanentStoreError("WRONGPASS"))  # still permanent by default
