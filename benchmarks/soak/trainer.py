"""A soak trainer: reads each of its records once it is durable, with
``RoutingReader.get`` or ``get_slice``, and checks every id against the generator.

``python -m benchmarks.soak.trainer CONFIG.json``.  It learns which records exist from the
producers' ``put`` events (an RL driver knows which rollouts it asked for) and reads the
ones it owns (:func:`~benchmarks.soak.workload.owner_of`) as they appear in the store:
each poll lists the steps it waits on (``list_rollouts``, the prefix index), or, for
stores written by FastDeploy's own path (no index), tries ``get`` on each.  Events:

* ``reading`` (``id``): a read is about to start (a fault may kill the process here);
* ``read`` (``id``, ``mode``, ``ok``, ``why``, ``lat``, ``t``, ``bytes``): a read finished;
  ``ok`` false means it returned bytes that are not the record's (corrupt);
* ``read_error`` (``id``, ``why``): the read raised (store unavailable, record error); the
  record stays pending and is tried again.

A trainer that is killed and started again with the same index skips what its file says
it has already verified.  It stops when ``stop-trainers`` exists in the run directory
and nothing it owns is pending (or the file says ``now``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.soak.events import EventLog, Tail, read_all
from benchmarks.soak.verify import problem_with
from benchmarks.soak.workload import owner_of, parse_rollout, slice_plan, spec_for, step_prefix
from fd_routing_replay import RoutingReader
from fd_routing_replay.errors import RecordError, StoreError

__all__ = ["main"]

_IDLE_S = 0.02


class Pending:
    """The records this trainer owns and has not verified yet, by step."""

    def __init__(self) -> None:
        self.by_step: dict[int, dict[str, float]] = {}
        self.latest_turn: dict[str, int] = {}

    def accepted(self, rid: str, t: float, done: bool) -> None:
        """A put of a record this trainer owns was accepted (``done``: already verified,
        by this process before it was restarted)."""
        rollout = parse_rollout(rid)
        self.latest_turn[rollout.base] = max(self.latest_turn.get(rollout.base, -1), rollout.turn)
        if not done:
            self.by_step.setdefault(rollout.step, {})[rid] = t

    def discard(self, rid: str) -> None:
        step = parse_rollout(rid).step
        waiting = self.by_step.get(step)
        if waiting is not None:
            waiting.pop(rid, None)
            if not waiting:
                del self.by_step[step]

    def superseded(self, rid: str) -> bool:
        """A later turn of the rollout was accepted: this one is retired (only_last_turn)."""
        rollout = parse_rollout(rid)
        return self.latest_turn.get(rollout.base, -1) > rollout.turn

    def __len__(self) -> int:
        return sum(len(v) for v in self.by_step.values())


def _read(reader: RoutingReader, rid: str, raw: bool) -> tuple[Any, str, Any]:
    if raw:  # FastDeploy's P2PStore values: bare padded ids, geometry from the rollout id
        from fd_routing_replay.reader import RawGeometry

        spec = spec_for(rid)
        reader = RoutingReader(reader.store, raw_geometry=RawGeometry(
            top_k=spec.top_k, dtype="uint8", num_layers=spec.layers,
            num_experts=spec.num_experts))
    plan = slice_plan(rid)
    if plan is None:
        return reader.get(rid), "get", None
    return reader.get_slice(rid, layers=plan.layers, tokens=plan.tokens), "slice", plan


def run(config: dict[str, Any]) -> int:
    index, count = int(config["trainer"]), int(config["trainers"])
    out = Path(config["dir"])
    events_path = out / f"trainer{index}.jsonl"
    done = {e["id"] for e in read_all(events_path) if e["e"] == "read"}
    log = EventLog(events_path)
    log.emit("start", pid=os.getpid(), t=time.monotonic(), resumed=len(done))
    reader = RoutingReader(config["store"], verify=True)
    tails = [Tail(out / name) for name in config["producer_files"]]
    pending = Pending()
    run_tag, by_list = config["run"], config.get("poll", "list") == "list"
    raw = bool(config.get("raw_geometry"))
    fastdeploy = bool(config.get("fastdeploy"))
    stop_file = out / "stop-trainers"
    while True:
        for tail in tails:
            for event in tail.read():
                if event["e"] == "put" and event["ok"] and owner_of(event["id"], count) == index:
                    pending.accepted(event["id"], event["t"], event["id"] in done)
        found_any = False
        for step in sorted(pending.by_step):
            waiting = pending.by_step.get(step, {})
            if by_list:
                try:
                    present = set(reader.list_rollouts(step_prefix(run_tag, step)))
                except StoreError as exc:
                    log.emit("read_error", id=step_prefix(run_tag, step), why=repr(exc)[:300],
                             t=time.monotonic())
                    continue
            for rid in sorted(waiting, key=waiting.get):
                if by_list and rid not in present:
                    if pending.superseded(rid):
                        pending.discard(rid)
                    continue
                log.emit("reading", id=rid, t=time.monotonic())
                began = time.monotonic()
                try:
                    record, mode, plan = _read(reader, rid, raw)
                except (StoreError, RecordError, OSError) as exc:
                    log.emit("read_error", id=rid, why=f"{type(exc).__name__}: {exc}"[:300],
                             t=time.monotonic())
                    continue
                took = time.monotonic() - began
                if record is None:
                    if pending.superseded(rid):
                        pending.discard(rid)
                    continue
                found_any = True
                problem = problem_with(record, rid, plan, experts_stored=not fastdeploy)
                log.emit("read", id=rid, mode=mode, ok=problem is None, why=problem, lat=took,
                         t=time.monotonic(), bytes=int(record.ids.nbytes))
                done.add(rid)
                pending.discard(rid)
        if stop_file.exists():
            if not len(pending) or stop_file.read_text().strip() == "now":
                break
        if not found_any:
            time.sleep(_IDLE_S)
    log.emit("end", t=time.monotonic(), pending=len(pending))
    reader.close()
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
