"""Credentials refused while they are being rotated: retried for retry_deadline_s, then
dead-lettered — never lost, and never one retry window per record (issue 10, item 6)."""

from __future__ import annotations

import threading

from tests.writer.conftest import make_record, wait_until


def test_auth_failure_healing_within_the_deadline_is_retried(rig, np_rng, tmp_path):
    auth = tmp_path / "auth.flag"
    auth.touch()
    writer = rig.writer(store_options={"auth_flag": str(auth)}, retry_deadline_s=30.0,
                        retry_max_backoff_s=0.05)
    record = make_record(np_rng, "rot:0:0")
    writer.submit_put("rot:0:0", record)
    wait_until(lambda: writer.stats()["store_errors"] >= 3, "refused attempts")
    auth.unlink()  # the new password is live
    assert writer.flush(timeout=60)
    stats = writer.stats()
    assert stats["dead_lettered"] == 0 and stats["written"] == 1 and stats["retries"] >= 1
    assert rig.read("rot:0:0").ids.tobytes() == record.ids.tobytes()
    assert list(rig.dead_dir.glob("*.json")) == []


def test_auth_failure_outliving_the_deadline_is_dead_lettered_then_fast(rig, np_rng, tmp_path):
    auth = tmp_path / "auth.flag"
    auth.touch()
    writer = rig.writer(store_options={"auth_flag": str(auth)}, retry_deadline_s=0.5)
    for index in range(5):
        writer.submit_put(f"bad_auth:0:{index}", make_record(np_rng, f"bad_auth:0:{index}"))
    done = threading.Event()
    threading.Thread(target=lambda: (writer.flush(timeout=60), done.set()), daemon=True).start()
    assert done.wait(30), "each record waited a whole retry window"
    stats = writer.stats()
    assert stats["dead_lettered"] == 5 and stats["written"] == 0
    reasons = [p.read_text() for p in rig.dead_dir.glob("*.reason")]
    assert len(reasons) == 5 and all("WRONGPASS" in text for text in reasons)
    assert len(list(rig.dead_dir.glob("*.rr"))) == 5
