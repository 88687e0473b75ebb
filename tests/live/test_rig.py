"""The rig itself: a hang fails with every process's log tail, and stopping leaves nothing."""

from __future__ import annotations

import threading
import time

from .rig import LiveServer, RigError, ServerOptions

OPTIONS = ServerOptions()
PLANTED = "the worker hangs in load_model (planted)"    # tests/live/plants.py install_hang


def test_a_worker_that_hangs_fails_the_start_with_every_process_log_tail(tmp_path):
    options = ServerOptions(start_timeout_s=600, extra_env={"FDRR_LIVE_HANG": "worker"})
    server = LiveServer(tmp_path, options)
    outcome: dict[str, BaseException] = {}

    def start() -> None:
        try:
            server.start()
        except BaseException as exc:                 # noqa: BLE001 -- handed to the test thread
            outcome["error"] = exc

    starting = threading.Thread(target=start)
    starting.start()
    worker_log = tmp_path / "log" / "workerlog.0"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and PLANTED not in (worker_log.read_text() if worker_log.exists() else ""):
        time.sleep(0.5)
    time.sleep(3)
    options.start_timeout_s = 0                      # the start-up times out now, the worker still hung
    starting.join(timeout=120)
    assert not starting.is_alive()
    assert isinstance(outcome.get("error"), RigError), outcome
    failed = outcome["error"]
    message = str(failed)
    assert "did not come up" in message
    assert "----- server.log" in message and "----- log/workerlog.0" in message
    assert PLANTED in message                                             # the hung process's own tail
    # FastDeploy's own shutdown (the engine kills its worker's group) ends the hung worker
    assert server.processes() == []
    assert server.shm_entries() == []


def test_stopping_leaves_no_process_shared_memory_or_message_queue(server):
    import ctypes
    import ctypes.util

    from tests.fdcpu.output_ops import queue_key

    assert server.processes() and server.shm_entries()                    # what there is to clean up
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    assert libc.msgget(queue_key(server.engine_port), 0o666) >= 0         # FastDeploy's output queue
    server.stop()
    assert server.processes() == []
    assert server.shm_entries() == []
    assert libc.msgget(queue_key(server.engine_port), 0o666) == -1


def test_an_orphan_that_hides_its_marker_is_still_one_of_the_rigs_processes(tmp_path):
    """A process of the server's session whose environment lacks the marker (setproctitle
    moves it out of /proc's view) and whose parent is gone: FastDeploy's API server leaves
    such a process behind when it exits before its child."""
    import os
    import signal
    import subprocess
    import sys

    from .rig import MARKER, rig_processes

    pid_file = tmp_path / "orphan.pid"
    code = ("import subprocess, sys; "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], env={}); "
            f"open({str(pid_file)!r}, 'w').write(str(p.pid))")
    parent = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, MARKER: "orphan-test"},
                              start_new_session=True)
    parent.wait(timeout=60)
    orphan = int(pid_file.read_text())
    try:
        assert orphan not in rig_processes("orphan-test")                 # no marker, no parent
        assert orphan in rig_processes("orphan-test", session=parent.pid)
    finally:
        os.kill(orphan, signal.SIGKILL)
