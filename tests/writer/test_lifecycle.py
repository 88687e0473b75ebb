"""Writer lifecycle: crash restarts, start-up journal checks, metrics, exit hook, config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from fd_routing_replay.codec import encode_record
from fd_routing_replay.config import load_config
from fd_routing_replay.errors import UnknownStoreType
from fd_routing_replay.writer import RoutingWriter
from fd_routing_replay.writer.metrics import COUNTERS, GAUGES
from fdrr_dev.testing.process import free_port
from tests.writer.conftest import NAMESPACE, make_record, wait_until

REPO = Path(__file__).resolve().parents[2]


def test_writer_that_dies_inside_a_put_is_restarted_and_resends(rig, np_rng, tmp_path):
    crash = tmp_path / "crash.flag"
    crash.touch()
    writer = rig.writer(store_options={"crash_flag": str(crash)})
    expected = {}
    for index in range(50):
        key = f"crash:0:{index}"
        record = make_record(np_rng, key)
        expected[key] = record.ids.tobytes()
        writer.submit_put(key, record)
    assert writer.flush(timeout=60)
    assert not crash.exists()
    assert writer.stats()["restarts"] == 1
    assert rig.reader.list() == sorted(expected)
    for key, payload in expected.items():
        assert rig.read(key).ids.tobytes() == payload


def test_startup_cleans_debris_and_dead_letters_corrupt_journal_entries(rig, np_rng):
    rig.journal_dir.mkdir()
    good = make_record(np_rng, "good:0:0")
    (rig.journal_dir / "00000000000000000001.0.rr").write_bytes(encode_record(good))
    (rig.journal_dir / "00000000000000000001.0.json").write_text(json.dumps(
        {"v": 1, "op": "put", "seq": 1, "sub": 0, "key": "good:0:0", "rollout_id": "good:0:0",
         "final": True, "format": "rr-v1"}))
    (rig.journal_dir / "00000000000000000002.0.json").write_text("{not json")
    (rig.journal_dir / "00000000000000000003.0.json").write_text(json.dumps(
        {"v": 1, "op": "put", "seq": 3, "sub": 0, "key": "lost:0:0", "rollout_id": "lost:0:0"}))
    (rig.journal_dir / "00000000000000000004.0.rr").write_bytes(b"orphan without sidecar")
    (rig.journal_dir / ".tmp-abc").write_bytes(b"half written")
    writer = rig.writer()
    assert writer.flush(timeout=60)
    assert rig.read("good:0:0").ids.tobytes() == good.ids.tobytes()
    assert rig.reader.list() == ["good:0:0"]
    assert sorted(p.name for p in rig.journal_dir.iterdir()) == [".lock"]
    reasons = sorted(p.read_text() for p in rig.dead_dir.glob("*.reason"))
    assert len(reasons) == 2
    assert any("unreadable" in r for r in reasons) and any("missing" in r for r in reasons)
    assert writer.stats()["dead_lettered"] == 2


def test_stats_and_prometheus_report_the_same_numbers(rig, np_rng):
    writer = rig.writer(store_options={"poison": "poison"})
    for index in range(20):
        writer.submit_put(f"m:0:{index}", make_record(np_rng, f"m:0:{index}"))
    writer.submit_put("poison:0:0", make_record(np_rng, "poison:0:0"))
    writer.submit_delete(["m:0:0"])
    writer.submit_delete_prefix(["m:0:1"])
    with pytest.raises(ValueError):
        writer.submit_put("x", make_record(np_rng, "x"))
    assert writer.flush(timeout=60)
    stats = writer.stats()
    registry = writer.metrics_registry
    labels = {"namespace": writer.store_config.namespace, "store": "faulty", "rank": "dp0-tp0"}
    for name in COUNTERS:
        assert registry.get_sample_value(f"fd_rr_writer_{name}_total", labels) == stats[name], name
    for name in GAUGES:
        assert registry.get_sample_value(f"fd_rr_writer_{name}", labels) == stats[name], name
    assert stats["submitted"] == 23 and stats["written"] == 20 and stats["rejected"] == 1
    assert stats["dead_lettered"] == 1 and stats["deleted"] == 2
    record_bytes = len(rig.reader.get("m:0:2"))  # every record here has the same size
    assert stats["written_bytes"] == 20 * record_bytes
    assert registry.get_sample_value("fd_rr_writer_put_latency_seconds_count", labels) == 20
    assert stats["queue_bytes"] == 0 and stats["pending_ops"] == 0
    # The worker's store calls, shipped from the writer process (the last report is sent
    # when it stops), exported with the writer's labels: 21 puts, the poisoned one failed.
    writer.close()
    assert registry.get_sample_value("fd_rr_store_operation_seconds_count",
                                     {**labels, "op": "put_parts"}) == 21
    assert registry.get_sample_value("fd_rr_store_errors_total", {**labels, "op": "put_parts"}) == 1
    assert registry.get_sample_value("fd_rr_store_written_bytes_total", labels) == \
        stats["written_bytes"]
    assert stats["put_latency_p50_ms"] > 0 and stats["put_latency_p99_ms"] >= \
        stats["put_latency_p50_ms"]
    assert stats["queue_bytes"] == 0 and stats["pending_ops"] == 0


def test_metrics_are_served_on_the_configured_address_and_port(rig, np_rng):
    port = free_port()
    writer = rig.writer(metrics_port=port, metrics_addr="127.0.0.1")
    assert writer.metrics_address[0] == "127.0.0.1"
    writer.submit_put("http:0:0", make_record(np_rng, "http:0:0"))
    assert writer.flush(timeout=60)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    assert 'fd_rr_writer_written_total{namespace="wt",rank="dp0-tp0",store="faulty"} 1.0' in text
    assert "fd_rr_writer_put_latency_seconds_bucket" in text
    writer.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


@pytest.mark.parametrize("mode", ["process"])
def test_exit_hook_flushes_records_of_a_writer_never_closed(rig, tmp_path):
    script = tmp_path / "engine.py"
    script.write_text(textwrap.dedent(f"""
        import numpy as np
        from fd_routing_replay.codec import RoutingRecord
        from fd_routing_replay.store import register_store
        from fd_routing_replay.writer import RoutingWriter
        register_store("faulty", "tests.writer.faulty_store:open_faulty_store")
        writer = RoutingWriter({rig.store_config()!r}, {rig.writer_config()!r})
        for i in range(50):
            ids = np.full((2, 4, 2), i % 8, dtype=np.uint8)
            writer.submit_put(f"exit:0:{{i}}", RoutingRecord(f"exit:0:{{i}}", ids, 8))
        # no close(): the interpreter's exit hook must flush
    """))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    subprocess.run([sys.executable, str(script)], check=True, env=env, timeout=120,
                   cwd=str(tmp_path))
    assert rig.reader.list() == sorted(f"exit:0:{i}" for i in range(50))
    for i in range(50):
        assert rig.read(f"exit:0:{i}").ids.tolist() == np.full((2, 4, 2), i % 8).tolist()


def test_from_config_and_context_manager(tmp_path, np_rng, mode):
    config = load_config(overrides={
        "store": {"type": "local", "namespace": NAMESPACE, "local": {"root": str(tmp_path / "s")}},
        "writer": {"mode": mode, "journal_dir": str(tmp_path / "j"), "capacity_bytes": "64MiB",
                   "dead_letter_dir": str(tmp_path / "d")},
        "retention": {"only_last_turn": True}}, env={})
    with RoutingWriter.from_config(config) as writer:
        assert writer.only_last_turn and writer.mode == mode
        writer.submit_put("cfg:0:0:0", make_record(np_rng, "cfg:0:0:0"))
        writer.submit_put("cfg:0:1:0", make_record(np_rng, "cfg:0:1:0"))
    from fd_routing_replay.store.local import LocalStore

    assert LocalStore(tmp_path / "s", NAMESPACE).list() == ["cfg:0:1:0"]


def test_unknown_store_type_fails_at_construction(tmp_path):
    with pytest.raises(UnknownStoreType, match="nosuchstore"):
        RoutingWriter({"type": "nosuchstore"}, {"journal_dir": str(tmp_path / "j"),
                                                "dead_letter_dir": str(tmp_path / "d")})


@pytest.mark.parametrize("mode", ["process"])
def test_engine_killed_records_reach_the_journal_and_the_next_writer(rig, tmp_path):
    """SIGKILL of the engine side: its writer process journals what it holds, then exits."""
    import signal

    script = tmp_path / "engine.py"
    pid_file = tmp_path / "pids"
    script.write_text(textwrap.dedent(f"""
        import os, signal, time
        import numpy as np
        from fd_routing_replay.codec import RoutingRecord
        from fd_routing_replay.store import register_store
        from fd_routing_replay.writer import RoutingWriter
        register_store("faulty", "tests.writer.faulty_store:open_faulty_store")
        writer = RoutingWriter({rig.store_config()!r}, {rig.writer_config()!r})
        for i in range(40):
            ids = np.full((2, 4, 2), i % 8, dtype=np.uint8)
            writer.submit_put(f"crash:0:{{i}}", RoutingRecord(f"crash:0:{{i}}", ids, 8))
        with open({str(pid_file)!r}, "w") as handle:
            handle.write(f"{{os.getpid()}} {{writer.worker_pid}}")
        signal.pause()
    """))
    rig.close_gate()  # the writer process hangs inside its first put
    env = dict(os.environ, PYTHONPATH=str(REPO))
    engine = subprocess.Popen([sys.executable, str(script)], env=env, cwd=str(tmp_path))
    try:
        wait_until(lambda: pid_file.exists() and pid_file.read_text().count(" ") == 1,
                   "the engine to submit")
        _engine_pid, worker_pid = (int(p) for p in pid_file.read_text().split())
        engine.send_signal(signal.SIGKILL)
        engine.wait(30)
    finally:
        if engine.poll() is None:
            engine.kill()
    rig.open_gate()
    writer = rig.writer()  # waits for the orphaned writer process to let go of the journal
    assert writer.flush(timeout=60)
    stat = Path(f"/proc/{worker_pid}/stat")
    assert not stat.exists() or stat.read_text().split(") ")[1][0] == "Z"  # gone or a zombie
    assert rig.reader.list() == sorted(f"crash:0:{i}" for i in range(40))
    for i in range(40):
        assert rig.read(f"crash:0:{i}").ids.tolist() == np.full((2, 4, 2), i % 8).tolist()
