"""The finishing thread: order, flush, bounded memory, errors, close, inline; and the
capture paths that use it build and put records off the engine's thread."""

from __future__ import annotations

import threading

import numpy as np

from fd_routing_replay.capture.handoff import FinishingThread
from tests.capture.steps import Driver, ListSink, rid
from tests.capture.test_manager import GEOMETRY


def test_jobs_run_in_submission_order_off_the_callers_thread():
    thread = FinishingThread()
    seen: list[tuple[int, str]] = []
    for i in range(200):
        thread.submit(lambda i=i: seen.append((i, threading.current_thread().name)), nbytes=i)
    assert thread.flush(30)
    assert [i for i, _ in seen] == list(range(200))
    assert {name for _, name in seen} == {"fdrr-finish"}
    assert thread.stats()["pending_jobs"] == 0 and thread.stats()["pending_bytes"] == 0
    thread.close(30)


def test_flush_waits_for_the_running_job_and_reports_a_timeout():
    thread = FinishingThread()
    release, done = threading.Event(), []
    thread.submit(lambda: (release.wait(30), done.append(1)))
    assert not thread.flush(0.05)              # the job is still waiting for its release
    assert thread.pending == 1
    release.set()
    assert thread.flush(30) and done == [1] and thread.pending == 0
    thread.close(30)


def test_submit_waits_while_the_bound_is_exceeded_and_nothing_is_dropped():
    thread = FinishingThread(max_pending_bytes=10)
    release = threading.Event()
    ran: list[int] = []
    thread.submit(lambda: (release.wait(30), ran.append(0)), nbytes=8)
    returned = threading.Event()

    def second() -> None:
        thread.submit(lambda: ran.append(1), nbytes=8)     # 16 bytes > 10: must wait
        returned.set()

    submitter = threading.Thread(target=second)
    submitter.start()
    assert not returned.wait(0.05)             # still waiting for room (never early)
    release.set()
    submitter.join(30)
    assert returned.is_set() and thread.flush(30) and ran == [0, 1]
    assert thread.stats()["submit_waits"] == 1
    thread.close(30)


def test_a_job_that_raises_is_counted_and_the_next_ones_run(caplog):
    thread = FinishingThread()
    ran: list[int] = []
    thread.submit(lambda: 1 / 0)
    thread.submit(lambda: ran.append(1))
    assert thread.flush(30) and ran == [1]
    assert thread.stats()["job_errors"] == 1 and "ZeroDivisionError" in caplog.text
    thread.close(30)


def test_after_close_and_inline_jobs_run_on_the_callers_thread():
    for thread in (FinishingThread(inline=True), FinishingThread()):
        thread.close(30)
        names: list[str] = []
        thread.submit(lambda names=names: names.append(threading.current_thread().name))
        assert names == [threading.current_thread().name]


class ThreadNoting(ListSink):
    """A sink that notes which thread put each record."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: set[str] = set()

    def put(self, key, record):
        self.threads.add(threading.current_thread().name)
        super().put(key, record)


def test_the_manager_builds_and_puts_records_on_the_finishing_thread(seed):
    sink = ThreadNoting()
    d = Driver(GEOMETRY, seed, sink=sink)
    for slot in range(3):
        d.set_blocks(slot, [slot * 2, slot * 2 + 1])
        d.manager.register_request(batch_id=slot, request_id=rid(f"exp_h:0:{slot}:0"))
    d.step({0: (0, 5), 1: (0, 3), 2: (0, 6)}, encoder={0, 1, 2}, finished={0, 1, 2})
    assert sorted(sink.items) == [f"exp_h:0:{slot}:0" for slot in range(3)]
    assert sink.threads == {"fdrr-finish-tp0"}
    assert [sink.items[f"exp_h:0:{s}:0"].num_tokens for s in range(3)] == [5, 3, 6]
    assert d.manager.stats()["finishing"]["jobs"] == 3
    np.testing.assert_array_equal(d.manager.counters["records_submitted"], 3)


def test_an_idle_thread_ends_and_the_next_job_starts_another(monkeypatch):
    from fd_routing_replay.capture import handoff

    monkeypatch.setattr(handoff, "IDLE_EXIT_S", 0.01)
    thread = FinishingThread()
    ran: list[str] = []
    thread.submit(lambda: ran.append(threading.current_thread().name))
    first = thread._thread
    assert thread.flush(30)
    first.join(30)                       # ends once idle: an owner that is gone leaves no thread
    assert not first.is_alive() and thread._thread is None
    thread.submit(lambda: ran.append(threading.current_thread().name))
    assert thread.flush(30) and ran == ["fdrr-finish", "fdrr-finish"]
    assert thread._thread is not first
    thread.close(30)
