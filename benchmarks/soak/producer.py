"""A soak producer: one engine's ``RoutingWriter`` in its production mode (a writer process
fed through shared memory), submitting generated records at an offered rate.

``python -m benchmarks.soak.producer CONFIG.json``; the config (written by
:mod:`.scenario`) names the producer's index and kind, the rollout-id run tag, the full
fd-routing-replay configuration, the offered rate and how long to submit.  Events (one JSON
line each, :mod:`.events`):

* ``worker`` (``pid``): the writer process, at start and whenever it changes;
* ``put`` (``id``, ``t``, ``dt``, ``ok``, ``late``, ``bytes``): one submit: when it began,
  how long it took on this thread, whether it was accepted, how late it was against the
  offered schedule;
* ``durable`` (``ids``, ``t``): puts the writer reported acknowledged by the store since the
  last poll (the writer applies puts one at a time in submission order, so the count of
  acknowledged puts names them);
* ``step_done`` (``step``): no more records of that step will come from here (a step is a
  time slot of ``step_s``; a producer starts step s only when the orchestrator's
  ``step-gate`` allows it);
* ``end`` (``stats``, ``dead_letters``, ``maxrss_kb``, ``children_maxrss_kb``): after
  ``close()``.

The writer's WARNING and ERROR lines (a dropped record is named in one) go to the
producer's log file, which the accounting reads.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.soak.events import EventLog, StepGate
from benchmarks.soak.workload import KINDS, make_ids, schedule, spec_for
from fd_routing_replay import RoutingRecord, RoutingWriter, load_config
from fd_routing_replay.core.paths import RankIdentity

__all__ = ["main"]

_DURABLE_POLL_S = 0.02


class _DurableWatcher(threading.Thread):
    """Polls ``writer.stats()`` and turns the acknowledged-put count into events."""

    def __init__(self, writer: RoutingWriter, log: EventLog) -> None:
        super().__init__(name="soak-durable", daemon=True)
        self.writer = writer
        self.log = log
        self.accepted: deque[str] = deque()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.written = 0
        self.worker_pid: int | None = None

    def poll(self) -> None:
        stats = self.writer.stats()
        now = time.monotonic()
        pid = stats.get("worker_pid")
        if pid != self.worker_pid:
            self.worker_pid = pid
            self.log.emit("worker", pid=pid, t=now)
        written = int(stats["written"])
        if written > self.written:
            with self.lock:
                ids = [self.accepted.popleft() for _ in range(min(written - self.written,
                                                                    len(self.accepted)))]
            self.written = written
            if ids:
                self.log.emit("durable", ids=ids, t=now)

    def run(self) -> None:
        while not self.stop.wait(_DURABLE_POLL_S):
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - the writer is closing
                if self.stop.is_set():
                    return


def hold_open(out: Path, config: dict[str, Any]) -> None:
    """P2PStore keeps a record in the memory of the process that put it, until that process
    closes its store: a producer whose records may still be unread waits for the
    orchestrator's ``release-producers`` before it closes (``hold_open``)."""
    if not config.get("hold_open"):
        return
    deadline = time.monotonic() + float(config.get("hold_open_s", 600))
    while not (out / "release-producers").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def _log_to(path: Path) -> None:
    handler = logging.FileHandler(path)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("%(created).3f %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger("fd_routing_replay")
    root.addHandler(handler)
    root.setLevel(logging.INFO)


def run(config: dict[str, Any]) -> int:
    index, kind = int(config["producer"]), config["kind"]
    out = Path(config["dir"])
    _log_to(out / f"producer{index}.log")
    log = EventLog(out / f"producer{index}.jsonl")
    multi, encoding = KINDS[kind]
    settings = json.loads(json.dumps(config["fd_rr"]))  # a copy
    settings.setdefault("retention", {})["only_last_turn"] = multi
    settings.setdefault("capture", {})["encoding"] = encoding
    rr_config = load_config(overrides=settings, env={})
    writer = RoutingWriter.from_config(rr_config,
                                       identity=RankIdentity(dp_rank=index, tp_rank=0, device_id=0))
    writer.ready(timeout=120)
    watcher = _DurableWatcher(writer, log)
    watcher.poll()
    watcher.start()
    rate = float(config["rate"])
    rng = np.random.default_rng(int(config.get("seed", 0)) * 1000 + index)
    start = time.monotonic()
    stop_at = start + float(config["duration_s"])
    next_at = start
    current_step = 0
    step_s = float(config.get("step_s", 2.0))

    def step_now() -> int:
        return int((time.monotonic() - start) / step_s)

    stop_file = out / "stop-producers"
    gate = StepGate(out)
    for step, rid in schedule(config["run"], index, kind,
                              int(config.get("turns", 3)), step_now):
        if step != current_step:
            log.emit("step_done", step=current_step, t=time.monotonic())
            current_step = step
            if not gate.wait(step, stop_at):
                break
        spec = spec_for(rid)  # generated before its arrival time: the engine had it ready
        record = RoutingRecord(rid, make_ids(spec), spec.num_experts)
        if rate > 0:
            next_at += rng.exponential(1.0 / rate)
            delay = next_at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        if time.monotonic() >= stop_at or stop_file.exists():
            break
        began = time.monotonic()
        with watcher.lock:  # a put acknowledged before we queue its id would be misnamed
            ok = writer.submit_put(rid, record)
            if ok:
                watcher.accepted.append(rid)
        took = time.monotonic() - began
        log.emit("put", id=rid, t=began, dt=took, ok=bool(ok), bytes=spec.nbytes,
                 late=max(0.0, began - next_at) if rate > 0 else 0.0)
        del record
    log.emit("step_done", step=current_step, t=time.monotonic())
    log.emit("submitted_all", t=time.monotonic())
    hold_open(out, config)
    writer.close(timeout=float(config.get("close_timeout_s", 120)))
    watcher.stop.set()
    watcher.join(5)
    try:
        watcher.poll()
    except Exception:  # noqa: BLE001 - closed: stats() still works, this is a last look
        pass
    stats = writer.stats()
    stats.pop("store_calls", None)
    dead = writer.dead_letters
    journal = [json.loads(path.read_text()) for path in Path(stats["journal_dir"]).glob("*.json")]
    log.emit("end", t=time.monotonic(), stats=stats, dead_letters=dead.names(),
             dead_letter_keys=[dead.load(name).get("key") for name in dead.names()],
             journal_left=len(journal),
             journal_keys=[op.get("key") for op in journal if op.get("op") == "put"],
             maxrss_kb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
             children_maxrss_kb=resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    log.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    with open(args[0]) as stream:
        config = json.load(stream)
    os.nice(int(config.get("nice", 0)))
    return run(config)


if __name__ == "__main__":
    sys.exit(main())
