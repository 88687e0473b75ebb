"""The faults a soak scenario injects, each while producers, trainers and the driver run.

Each fault is a function of the running scenario (:class:`~.scenario.ScenarioRun`) that
does its harm, waits, undoes it where that is the point, and logs what it did as
``fault`` events (the driver's file) with the times, so the report can say when.  Every
process is touched by its pid only.

* ``worker-kill``: SIGKILL producer 0's writer process (the writer restarts it and sends
  again what the store had not acknowledged);
* ``reader-kill``: SIGKILL trainer 0 while it is inside a read, then start it again (it
  resumes from its own event file);
* ``redis-pause``: SIGSTOP a Redis node for longer than ``socket_timeout_s``, SIGCONT, then
  SIGKILL another (the only one on a single node) and start it again on its port with its
  append-only file;
* ``disk-full``: fill the local store's tmpfs to ENOSPC, hold it, free it;
* ``master-restart``: SIGKILL the Mooncake master, start it again on its ports (it keeps
  no data: records stored before are gone with it, declared as the store's loss);
* ``provider-kill``: SIGKILL a P2PStore writer process: the records it provided die with it
  (P2PStore's design; declared as the store's loss).

Two negative controls, for the rig's own tests (a soak that cannot fail proves nothing):
``lose-one`` deletes one durable record before any trainer read it, ``corrupt-one``
replaces one with a well-formed record of the same rollout id holding other ids (its
checksum is right, its content is not).  Both stop the trainers (SIGSTOP) meanwhile, so
the record is surely unread, and let them go on after.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from collections.abc import Callable
from typing import Any

from benchmarks.soak.events import Tail

__all__ = ["FAULTS", "STORE_LOSS"]


def _worker_kill(run: Any, args: dict[str, Any]) -> None:
    producer = int(args.get("producer", 0))
    pid = run.worker_pid(producer)
    if pid is None:
        run.fault_event("skipped", why=f"producer {producer} has no writer process yet")
        return
    os.kill(pid, signal.SIGKILL)
    run.fault_event("worker_killed", producer=producer, pid=pid)


def _reader_kill(run: Any, args: dict[str, Any]) -> None:
    trainer = int(args.get("trainer", 0))
    tail = Tail(run.dir / f"trainer{trainer}.jsonl")
    deadline = time.monotonic() + float(args.get("wait_s", 30))
    last = None
    while time.monotonic() < deadline:
        events = tail.read()
        if events:
            last = events[-1]
        if last is not None and last["e"] == "reading":
            break
        time.sleep(0.0005)
    pid = run.kill_trainer(trainer)
    # mid-read when the file still ends with that "reading": the read never finished
    after = tail.read()
    mid_read = last is not None and last["e"] == "reading" and not after
    run.fault_event("reader_killed", trainer=trainer, pid=pid, mid_read=mid_read,
                    reading=last["id"] if mid_read else None)
    time.sleep(float(args.get("restart_after_s", 1.0)))
    run.start_trainer(trainer)
    run.fault_event("reader_restarted", trainer=trainer)


def _redis_pause(run: Any, args: dict[str, Any]) -> None:
    nodes = run.store.redis_nodes()
    paused, killed = nodes[0], nodes[1 % len(nodes)]
    pause_s = float(args.get("pause_s", 8.0))
    os.kill(paused.process.pid, signal.SIGSTOP)
    run.fault_event("redis_paused", node=paused.address, seconds=pause_s)
    try:
        time.sleep(pause_s)
    finally:
        os.kill(paused.process.pid, signal.SIGCONT)
    run.fault_event("redis_resumed", node=paused.address)
    time.sleep(float(args.get("gap_s", 4.0)))
    killed.process.kill()
    killed.process.wait(10)
    run.fault_event("redis_killed", node=killed.address)
    time.sleep(float(args.get("down_s", 2.0)))
    killed.start()
    run.fault_event("redis_restarted", node=killed.address)


def _disk_full(run: Any, args: dict[str, Any]) -> None:
    filler = run.store.root / "filler"
    block = b"\0" * (4 << 20)
    written = 0
    with open(filler, "wb", buffering=0) as stream:
        while True:
            try:
                written += stream.write(block)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                # the last bytes, in small pieces, until not even a page is left
                for piece in (b"\0" * 65536, b"\0" * 4096):
                    try:
                        while True:
                            written += stream.write(piece)
                    except OSError:
                        pass
                break
    run.fault_event("disk_full", filled_bytes=written)
    time.sleep(float(args.get("hold_s", 6.0)))
    filler.unlink()
    run.fault_event("disk_freed")


def _master_restart(run: Any, args: dict[str, Any]) -> None:
    master = run.store.master
    master.kill()
    run.declare_store_loss(None)
    run.fault_event("master_killed", address=master.address)
    time.sleep(float(args.get("down_s", 2.0)))
    master.start()
    run.fault_event("master_restarted", address=master.address)


def _provider_kill(run: Any, args: dict[str, Any]) -> None:
    run.declare_store_loss(int(args.get("producer", 0)))
    _worker_kill(run, args)


def _sabotage(run: Any, args: dict[str, Any], corrupt: bool) -> None:
    from benchmarks.soak.workload import make_ids, parse_rollout, spec_for
    from fd_routing_replay import RoutingRecord, encode_record
    from fd_routing_replay.store import open_store

    trainers = [run.processes[f"trainer{i}"] for i in range(run.scenario.trainers)]
    for process in trainers:
        os.killpg(process.pid, signal.SIGSTOP)
    try:
        tail = Tail(run.dir / "producer0.jsonl")
        tail.read()  # records durable before the trainers stopped may have been read
        victim = None
        while victim is None:
            for event in tail.read():
                if event["e"] == "durable":  # a single-turn record: never retired
                    victim = next((rid for rid in event["ids"]
                                   if not parse_rollout(rid).multi_turn), victim)
            time.sleep(0.01)
        store = open_store(run.store_config, instrument=False)
        try:
            if corrupt:
                spec = spec_for(victim)
                other = make_ids(spec)[:, ::-1].copy()  # same shape, the tokens reversed
                store.put(victim, encode_record(RoutingRecord(victim, other, spec.num_experts)))
            else:
                store.delete([victim])
        finally:
            store.close()
        run.fault_event("corrupted" if corrupt else "lost", victim=victim)
    finally:
        for process in trainers:
            os.killpg(process.pid, signal.SIGCONT)


FAULTS: dict[str, Callable[[Any, dict[str, Any]], None]] = {
    "worker-kill": _worker_kill,
    "reader-kill": _reader_kill,
    "redis-pause": _redis_pause,
    "disk-full": _disk_full,
    "master-restart": _master_restart,
    "provider-kill": _provider_kill,
    "lose-one": lambda run, args: _sabotage(run, args, corrupt=False),
    "corrupt-one": lambda run, args: _sabotage(run, args, corrupt=True),
}

STORE_LOSS = frozenset({"master-restart", "provider-kill"})
"""Faults in which the store itself loses records it had acknowledged."""
