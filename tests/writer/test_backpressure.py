"""Store down and journal unwritable at once: submit_put waits at most block_timeout_s,
drops are counted and logged by rollout id, repeated errors are rate-limited, and nothing
accepted is lost once both come back (issue 10, item 4)."""

from __future__ import annotations

import logging
import shutil
import threading
import time

from fd_routing_replay.core.logs import RateLimitedLog
from tests.writer.conftest import make_record, wait_until

PAYLOAD = 16 * 1024
CAPACITY = 4 * PAYLOAD
BLOCK_TIMEOUT_S = 1.0
_SPILL_ERRORS = ("cannot spill", "cannot write")


def test_store_down_and_journal_full_never_stalls_the_engine(rig, np_rng, caplog):
    writer = rig.writer(capacity_bytes=CAPACITY, full_policy="spill",
                        block_timeout_s=BLOCK_TIMEOUT_S)
    assert writer.ready(60)
    rig.down()
    shutil.rmtree(rig.journal_dir)
    rig.journal_dir.write_text("a file where the journal directory was: every write fails")
    records = {f"bp:0:{i}": make_record(np_rng, f"bp:0:{i}", shape=(1, PAYLOAD // 4, 4))
               for i in range(20)}
    results: dict[str, bool] = {}
    durations: list[float] = []

    def submit_all() -> None:
        for key, record in records.items():
            started = time.monotonic()
            results[key] = writer.submit_put(key, record)
            durations.append(time.monotonic() - started)

    with caplog.at_level(logging.INFO, logger="fd_routing_replay"):
        engine = threading.Thread(target=submit_all, daemon=True)
        engine.start()
        wait_until(lambda: writer.stats()["blocked_submits"] >= 1 or not engine.is_alive(),
                   "a submit to wait for room")
        engine.join(BLOCK_TIMEOUT_S * len(records) + 30)
        assert not engine.is_alive(), "submit_put blocked the engine without bound"
        time.sleep(1.5)  # the writer keeps failing to journal meanwhile
        error_lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert max(durations) < BLOCK_TIMEOUT_S + 2.0
    dropped = sorted(key for key, accepted in results.items() if not accepted)
    stats = writer.stats()
    assert dropped and stats["dropped"] == len(dropped)
    assert stats["dropped_journal_full"] == len(dropped)
    assert stats["submit_waits"] >= 1 and stats["blocked_submits"] == 0
    for key in dropped:
        lines = [line for line in error_lines if f"dropped record {key} " in line]
        assert len(lines) == 1 and f"rollout {key}" in lines[0], key
    spill_errors = [line for line in error_lines if any(s in line for s in _SPILL_ERRORS)]
    assert 1 <= len(spill_errors) <= 2, spill_errors  # one per side, not one per attempt

    rig.journal_dir.unlink()
    rig.journal_dir.mkdir()
    rig.up()
    assert writer.flush(timeout=60)
    accepted = sorted(key for key, ok in results.items() if ok)
    assert rig.reader.list() == accepted
    for key in accepted:
        assert rig.read(key).ids.tobytes() == records[key].ids.tobytes()


def test_full_policy_block_waits_at_most_block_timeout_in_total(rig, np_rng):
    """Under full_policy=block the wait for ring room and the wait for the journal share
    one block_timeout_s budget."""
    writer = rig.writer(capacity_bytes=CAPACITY, full_policy="block", block_timeout_s=0.3)
    rig.close_gate()
    shutil.rmtree(rig.journal_dir)
    rig.journal_dir.write_text("not a directory")
    for index in range(4):
        assert writer.submit_put(f"blk:0:{index}", make_record(
            np_rng, f"blk:0:{index}", shape=(1, PAYLOAD // 4, 4)))
    durations = []
    for index in range(4, 12):
        started = time.monotonic()
        writer.submit_put(f"blk:0:{index}", make_record(np_rng, f"blk:0:{index}",
                                                        shape=(1, PAYLOAD // 4, 4)))
        durations.append(time.monotonic() - started)
    assert max(durations) < 0.3 + 1.5
    assert writer.stats()["dropped_journal_full"] >= 1
    rig.journal_dir.unlink()
    rig.journal_dir.mkdir()
    rig.open_gate()
    assert writer.flush(timeout=60)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_rate_limited_log_lets_one_line_per_interval_through(caplog):
    clock = FakeClock()
    limiter = RateLimitedLog(logging.getLogger("fd_routing_replay.test"), 10.0, clock=clock)
    with caplog.at_level(logging.ERROR, logger="fd_routing_replay.test"):
        assert limiter.log(logging.ERROR, "disk", "cannot write %s", "a")
        for second in range(1, 10):
            clock.now = second
            assert not limiter.log(logging.ERROR, "disk", "cannot write %s", "b")
        assert limiter.log(logging.ERROR, "other", "another kind")
        clock.now = 10.0
        assert limiter.log(logging.ERROR, "disk", "cannot write %s", "c")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["cannot write a", "another kind",
                     "cannot write c (9 similar line(s) suppressed in the last 10s)"]
    assert limiter.reset("disk") == 0
    assert limiter.log(logging.ERROR, "disk", "at once after a reset")
