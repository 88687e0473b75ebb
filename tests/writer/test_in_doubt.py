"""The put a writer process was applying when it was SIGKILLed (issue #33).

The store may have applied it before the process died, and the writer cannot tell: the
restarted process applies it again (at least once: nothing is lost).  If another process
deleted that record in the meantime — a driver deleting a finished training step within the
second a restart takes — the record is stored again.  The restart's ERROR line names the
operation, so an operator or a driver reading the log can delete it again
(docs/operations.md, Crash safety)."""

from __future__ import annotations

import logging
import os
import signal

import pytest

from tests.writer.conftest import make_record, wait_until


@pytest.mark.parametrize("mode", ["process"])
def test_a_put_in_flight_at_a_sigkill_is_applied_again_and_named(rig, np_rng, tmp_path, caplog):
    applied_gate = tmp_path / "applied.flag"
    writer = rig.writer(store_options={"applied_gate": str(applied_gate)})
    assert writer.ready(30)
    first, second = "doubt_1:0:0", "doubt_2:0:0"
    records = {key: make_record(np_rng, key) for key in (first, second)}
    applied_gate.touch()  # the store applies the put, its reply does not come back
    writer.submit_put(first, records[first])
    wait_until(lambda: any(e.get("key") == first for e in rig.events()), "the first put applied")
    writer.submit_put(second, records[second])  # queued behind it, never started
    assert rig.reader.delete([first]) == 1      # a driver deletes the record it read
    with caplog.at_level(logging.ERROR, logger="fd_routing_replay.writer"):
        os.kill(writer.worker_pid, signal.SIGKILL)
        applied_gate.unlink()
        assert writer.flush(60)
    puts = [e["key"] for e in rig.events() if e["op"] == "put"]
    assert puts == [first, first, second]         # applied again, the next one once
    for key, record in records.items():           # nothing lost; the deleted one is back
        assert (rig.read(key).ids == record.ids).all()
    died = [r.getMessage() for r in caplog.records if "died" in r.getMessage()]
    assert len(died) == 1 and "re-sending 2 unacknowledged operations" in died[0]
    assert first in died[0] and second not in died[0], died[0]
    assert writer.stats()["restarts"] == 1
