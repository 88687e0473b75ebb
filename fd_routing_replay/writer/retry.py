"""Retry and backoff as small objects the writer is handed, not logic wired into each call.

Modelled on redis-py's ``Retry`` / ``backoff`` split: a :class:`Backoff` says how long to
wait before the n-th retry; a :class:`RetryPolicy` says which errors are worth retrying
and for how long, and runs a call under those rules.  Clock and sleep are injectable so
the rules are tested without real time passing.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

from fd_routing_replay.errors import PermanentStoreError, RoutingReplayError, TransientStoreError

T = TypeVar("T")

__all__ = [
    "Backoff",
    "ConstantBackoff",
    "ExponentialBackoff",
    "RetryExhausted",
    "RetryInterrupted",
    "RetryPolicy",
    "is_auth_failure",
    "is_transient",
]


class Backoff(Protocol):
    """How long to wait before retry number ``failures`` (1 = after the first failure)."""

    def compute(self, failures: int) -> float: ...


class ConstantBackoff:
    """The same delay every time (tests, or stores that want a fixed pace)."""

    def __init__(self, delay_s: float) -> None:
        if delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {delay_s}")
        self.delay_s = delay_s

    def compute(self, failures: int) -> float:
        return self.delay_s


class ExponentialBackoff:
    """``initial_s * 2**(failures-1)``, capped at ``max_s``, with "equal jitter".

    The delay is drawn uniformly from ``[d * (1 - jitter), d]``, so many writers that lost
    the same store at the same moment do not hammer it back in lock-step, while the delay
    never exceeds the cap.
    """

    def __init__(self, initial_s: float, max_s: float, *, jitter: float = 0.5,
                 rng: random.Random | None = None) -> None:
        if initial_s <= 0 or max_s < initial_s:
            raise ValueError(f"need 0 < initial_s <= max_s, got initial_s={initial_s}, max_s={max_s}")
        if not 0 <= jitter <= 1:
            raise ValueError(f"jitter must be in [0, 1], got {jitter}")
        self.initial_s = initial_s
        self.max_s = max_s
        self.jitter = jitter
        self._rng = rng or random.Random()

    def compute(self, failures: int) -> float:
        exponent = min(max(failures, 1) - 1, 62)
        delay = min(self.max_s, self.initial_s * (2 ** exponent))
        return delay * (1.0 - self.jitter * self._rng.random())


def is_transient(exc: BaseException) -> bool:
    """True for failures a retry may fix.

    Stores raise :class:`TransientStoreError` for those; raw ``ConnectionError``,
    ``TimeoutError`` and other ``OSError`` leaking from a third-party backend count too.
    ``PermanentStoreError``, bad keys/records (``ValueError`` subclasses) and anything else
    unexpected (a backend bug) are permanent: retrying them forever would only hide them.
    """
    if isinstance(exc, TransientStoreError):
        return True
    if isinstance(exc, (PermanentStoreError, RoutingReplayError, ValueError, TypeError)):
        return False
    return isinstance(exc, OSError)  # ConnectionError and TimeoutError are OSErrors


_AUTH_ERROR_TYPES = frozenset({"AuthenticationError", "AuthenticationWrongNumberOfArgsError"})
_AUTH_MARKERS = ("NOAUTH", "WRONGPASS", "invalid username-password pair",
                 "Authentication required")


def is_auth_failure(exc: BaseException) -> bool:
    """True when ``exc`` (or an exception it was raised from) says the store refused our
    credentials: a redis-py ``AuthenticationError`` or a reply ``NOAUTH`` / ``WRONGPASS``.

    Stores report these as permanent (wrong credentials stay wrong), but during a
    credential rotation they heal by themselves within seconds, so the writer retries them
    for ``writer.retry_deadline_s`` before filing the record as a dead letter.  Matched by
    class name and reply text so no client library has to be imported.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if any(cls.__name__ in _AUTH_ERROR_TYPES for cls in type(current).__mro__):
            return True
        text = str(current)
        if any(marker in text for marker in _AUTH_MARKERS):
            return True
        current = current.__cause__ or current.__context__
    return False


class RetryExhausted(Exception):
    """A transient failure outlived the policy's deadline; ``last_error`` is the final one."""

    def __init__(self, failures: int, last_error: BaseException) -> None:
        super().__init__(f"gave up after {failures} failed attempt(s): {last_error}")
        self.failures = failures
        self.last_error = last_error


class RetryInterrupted(Exception):
    """The sleep between attempts was cut short (the writer is shutting down)."""

    def __init__(self, failures: int, last_error: BaseException) -> None:
        super().__init__(f"interrupted after {failures} failed attempt(s): {last_error}")
        self.failures = failures
        self.last_error = last_error


class RetryPolicy:
    """Retry transient failures with ``backoff`` until ``deadline_s`` has passed.

    ``deadline_s = 0`` means one attempt.  The last sleep is clipped so the final attempt
    happens at the deadline, not after it.  ``sleep`` returns False to interrupt (then
    :class:`RetryInterrupted` is raised); permanent errors propagate unchanged.
    """

    def __init__(self, backoff: Backoff, deadline_s: float, *,
                 classify: Callable[[BaseException], bool] = is_transient,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if deadline_s < 0:
            raise ValueError(f"deadline_s must be >= 0, got {deadline_s}")
        self.backoff = backoff
        self.deadline_s = deadline_s
        self.classify = classify
        self.clock = clock

    def call(self, fn: Callable[[], T], *,
             sleep: Callable[[float], bool | None] = time.sleep,
             on_failure: Callable[[int, BaseException], None] | None = None) -> T:
        """Run ``fn`` until it succeeds, fails permanently, or the deadline passes.

        ``on_failure(failures, exc)`` is called after every transient failure (metrics).
        """
        start = self.clock()
        failures = 0
        while True:
            try:
                return fn()
            except BaseException as exc:
                if not isinstance(exc, Exception) or not self.classify(exc):
                    raise
                failures += 1
                if on_failure is not None:
                    on_failure(failures, exc)
                remaining = self.deadline_s - (self.clock() - start)
                if remaining <= 0:
                    raise RetryExhausted(failures, exc) from exc
                delay = min(self.backoff.compute(failures), remaining)
                if sleep(delay) is False:
                    raise RetryInterrupted(failures, exc) from exc
