"""Run store operations against real Redis one round trip at a time, in every order.

Each actor (a callable) runs in its own thread on its own client, wrapped so that it stops
before every round trip to Redis (a pipeline ``execute`` or a direct command) until the
driver lets it go.  Only one actor runs at a time, so a schedule — which actor sends its
next round trip — fully determines the interleaving: no sleeps, no timing.
:func:`every_schedule` enumerates all schedules depth-first (stateless model checking).

Round-trip granularity is the right one here: what a concurrent client can slip in
between are whole round trips (a ``MULTI``/``EXEC`` is one, and atomic on the server).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

_WAIT_S = 60.0  # only a guard against a hang in a broken test, never a timing assumption


class _Gate:
    """Where one actor waits for its turn."""

    def __init__(self, condition: threading.Condition) -> None:
        self.condition = condition
        self.state = "running"  # running | waiting | done
        self.turn = False
        self.steps = 0

    def pass_(self) -> None:
        with self.condition:
            self.state = "waiting"
            self.condition.notify_all()
            if not self.condition.wait_for(lambda: self.turn, _WAIT_S):
                raise TimeoutError("interleaving driver never gave this actor its turn")
            self.turn = False
            self.state = "running"
            self.steps += 1


class StepClient:
    """A redis-py client (or cluster client) that waits at ``gate`` before each round trip."""

    def __init__(self, client: Any, gate: _Gate) -> None:
        self._client = client
        self._gate = gate

    def pipeline(self, *args: Any, **kwargs: Any) -> _StepPipeline:
        return _StepPipeline(self._client.pipeline(*args, **kwargs), self._gate)

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._client, name)
        if not callable(attribute) or name in ("close",):
            return attribute

        def command(*args: Any, **kwargs: Any) -> Any:
            self._gate.pass_()
            return attribute(*args, **kwargs)

        return command


class _StepPipeline:
    def __init__(self, pipeline: Any, gate: _Gate) -> None:
        self._pipeline = pipeline
        self._gate = gate

    def execute(self, *args: Any, **kwargs: Any) -> Any:
        self._gate.pass_()
        return self._pipeline.execute(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipeline, name)


def step_store(store: Any, gate: _Gate) -> None:
    """Make ``store`` (and its index) talk to Redis through ``gate``."""
    stepped = StepClient(store.client, gate)
    store.client = stepped
    store.index.client = stepped


Chooser = Callable[[int, list[int]], int]
"""``chooser(step, waiting actors' numbers)`` -> the number of the actor that goes next."""


def following(choices: list[int]) -> Chooser:
    """At step i the ``choices[i]``-th waiting actor goes (the first once they run out)."""
    def choose(step: int, waiting: list[int]) -> int:
        return waiting[choices[step] if step < len(choices) else 0]

    return choose


def run_schedule(actors: list[tuple[Any, Callable[[], Any]]], choose: list[int] | Chooser
                 ) -> tuple[list[int], list[int], list[Any]]:
    """Run ``actors`` (``(store, operation)`` pairs; each store is stepped) interleaved.

    ``choose`` picks who sends the next round trip: a chooser, or a list for
    :func:`following`.  Returns ``(at each step the index of the chosen actor among those
    waiting, how many were waiting, per actor its result or the exception it raised)``.
    """
    if not callable(choose):
        choose = following(choose)
    condition = threading.Condition()
    gates = [_Gate(condition) for _ in actors]
    results: list[Any] = [None] * len(actors)

    def body(number: int, operation: Callable[[], Any]) -> None:
        try:
            results[number] = operation()
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            results[number] = exc
        finally:
            with condition:
                gates[number].state = "done"
                condition.notify_all()

    for (store, _), gate in zip(actors, gates, strict=True):
        step_store(store, gate)
    threads = [threading.Thread(target=body, args=(number, operation), daemon=True)
               for number, (_, operation) in enumerate(actors)]
    for thread in threads:
        thread.start()
    made: list[int] = []
    options: list[int] = []
    while True:
        with condition:
            if not condition.wait_for(lambda: all(g.state != "running" for g in gates),
                                      _WAIT_S):
                raise TimeoutError("an actor neither reached Redis nor finished")
            waiting = [number for number, gate in enumerate(gates) if gate.state == "waiting"]
            if not waiting:
                break
            chosen = choose(len(made), waiting)
            made.append(waiting.index(chosen))
            options.append(len(waiting))
            gates[chosen].turn = True
            gates[chosen].state = "running"  # until it reaches its next gate or ends
            condition.notify_all()
    for thread in threads:
        thread.join(_WAIT_S)
    return made, options, results


def every_schedule(run: Callable[[list[int]], tuple[list[int], list[int]]],
                   limit: int = 5000) -> Iterator[list[int]]:
    """Depth-first over every schedule: ``run(prefix)`` runs one and returns
    ``(choices made, options at each step)``; yields each schedule run."""
    stack: list[list[int]] = [[]]
    count = 0
    while stack:
        prefix = stack.pop()
        made, options = run(prefix)
        count += 1
        if count > limit:
            raise AssertionError(f"more than {limit} schedules: shrink the scenario")
        yield made
        for step in range(len(prefix), len(made)):
            for other in range(made[step] + 1, options[step]):
                stack.append(made[:step] + [other])
