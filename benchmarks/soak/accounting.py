"""What happened to every record of a scenario, from the processes' event files.

Every accepted put ends in exactly one of:

* **read intact**: a trainer read it (``get`` or ``get_slice``) and every id matched;
* **corrupt**: a read returned ids that are not the record's (never acceptable);
* **retired**: an earlier turn of a multi-turn rollout that ``only_last_turn`` deleted
  once a later turn was durable, before a trainer got to it (by policy);
* **dead-lettered**: the store refused it permanently; kept in the dead letters (named);
* **journaled**: still in the writer's journal when the writer closed (the store did not
  take it in time): named in the close WARNING, replayed by the next writer on that
  journal directory;
* **lost with the store**: durable, then gone because the store itself lost its data in a
  fault the scenario declares (a Mooncake master restarted without persistence, a
  P2PStore provider process killed) — the store's property, reported apart;
* **lost**: none of the above (never acceptable).

A put that was not accepted is **dropped**; each must be named in the producer's log (the
writer logs one line per dropped record), else it counts as an unaccounted drop.
The last accepted turn of every rollout must be read; earlier turns may be retired.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.soak.events import read_all
from benchmarks.soak.workload import parse_rollout

__all__ = ["Accounting", "dropped_names", "load_dir", "percentiles"]

_DROPPED = re.compile(r"dropped record (\S+)")


def percentiles(values: Iterable[float], qs: Sequence[float] = (0.5, 0.99)) -> list[float]:
    """The ``qs`` quantiles of ``values`` (NaN each when there are none)."""
    data = np.fromiter(values, dtype=np.float64)
    if data.size == 0:
        return [float("nan")] * len(qs)
    return [float(v) for v in np.quantile(data, qs)]


def dropped_names(log_text: str) -> set[str]:
    """Keys the writer named in its "dropped record KEY" log lines."""
    return set(_DROPPED.findall(log_text))


@dataclass
class Accounting:
    """Feed it events (:meth:`producer`, :meth:`trainer`), then read :meth:`summary`."""

    store_losses: list[tuple[float, int | None]] = field(default_factory=list)
    """Faults in which the store itself loses data (see the module docstring): when, and
    whose records (a producer's, for a P2PStore provider; None: everyone's)."""
    puts: dict[str, dict[str, Any]] = field(default_factory=dict)
    durable_at: dict[str, float] = field(default_factory=dict)
    reads: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))
    read_errors: int = 0
    named_drops: set[str] = field(default_factory=set)
    dead_letter_keys: set[str] = field(default_factory=set)
    journal_keys: set[str] = field(default_factory=set)
    ends: list[dict[str, Any]] = field(default_factory=list)

    def producer(self, events: Iterable[dict[str, Any]], log_text: str = "") -> None:
        for event in events:
            kind = event["e"]
            if kind == "put":
                if event["id"] in self.puts:
                    raise ValueError(f"rollout {event['id']} was submitted twice")
                self.puts[event["id"]] = event
            elif kind == "durable":
                for rid in event["ids"]:
                    self.durable_at.setdefault(rid, event["t"])
            elif kind == "end":
                self.ends.append(event)
                self.dead_letter_keys.update(event.get("dead_letter_keys", ()))
                self.journal_keys.update(event.get("journal_keys", ()))
        self.named_drops |= dropped_names(log_text)

    def trainer(self, events: Iterable[dict[str, Any]]) -> None:
        for event in events:
            if event["e"] == "read":
                self.reads[event["id"]].append(event)
            elif event["e"] == "read_error":
                self.read_errors += 1

    # -- verdicts --------------------------------------------------------------------
    def required(self) -> set[str]:
        """The last accepted turn of every rollout: what trainers must read."""
        last: dict[str, tuple[int, str]] = {}
        for rid, put in self.puts.items():
            if not put["ok"]:
                continue
            rollout = parse_rollout(rid)
            if rollout.base not in last or rollout.turn > last[rollout.base][0]:
                last[rollout.base] = (rollout.turn, rid)
        return {rid for _, rid in last.values()}

    def outcome(self, rid: str, required: set[str]) -> str:
        put = self.puts[rid]
        if not put["ok"]:
            return "dropped" if rid in self.named_drops else "dropped_unnamed"
        reads = self.reads.get(rid, [])
        if any(not r["ok"] for r in reads):
            return "corrupt"
        if reads:
            return "read_intact"
        if rid not in required:
            return "retired"
        if rid in self.dead_letter_keys:
            return "dead_lettered"
        if rid in self.journal_keys:
            return "journaled"
        durable = self.durable_at.get(rid)
        producer = parse_rollout(rid).producer
        if durable is not None and any(durable <= at and owner in (None, producer)
                                       for at, owner in self.store_losses):
            return "lost_with_store"
        return "lost"

    def outcomes(self) -> dict[str, str]:
        required = self.required()
        return {rid: self.outcome(rid, required) for rid in self.puts}

    def summary(self) -> dict[str, Any]:
        outcomes = self.outcomes()
        counts = {name: 0 for name in ("read_intact", "corrupt", "retired", "dead_lettered",
                                       "journaled", "lost_with_store", "lost", "dropped",
                                       "dropped_unnamed")}
        for outcome in outcomes.values():
            counts[outcome] += 1
        accepted = [rid for rid, put in self.puts.items() if put["ok"]]
        submit = [self.puts[rid]["dt"] for rid in accepted]
        durable = [self.durable_at[rid] - self.puts[rid]["t"] for rid in accepted
                   if rid in self.durable_at]
        first_reads = {rid: reads[0] for rid, reads in self.reads.items() if rid in self.puts}
        by_mode: dict[str, list[float]] = defaultdict(list)
        for read in first_reads.values():
            by_mode[read["mode"]].append(read["lat"])
        to_read = [read["t"] - self.puts[rid]["t"] for rid, read in first_reads.items()]
        # Throughput: records durable (the writer's acknowledgement) per second from the
        # first submit to the last; a path that reports nothing (FastDeploy's) is timed by
        # the first successful read of each record instead.
        stored_at = self.durable_at or {rid: min(r["t"] for r in reads)
                                        for rid, reads in self.reads.items()
                                        if rid in self.puts and any(r["ok"] for r in reads)}
        bytes_durable = sum(self.puts[rid]["bytes"] for rid in accepted if rid in stored_at)
        times = [self.puts[rid]["t"] for rid in self.puts]
        last_durable = max(stored_at.values(), default=None)
        window = (last_durable - min(times)) if times and last_durable is not None else 0.0
        written = sum(int(end["stats"].get("written", 0)) for end in self.ends)
        out: dict[str, Any] = {
            "submitted": len(self.puts), "accepted": len(accepted), **counts,
            "durable": len(self.durable_at), "writer_written": written,
            "required": len(self.required()), "read_errors": self.read_errors,
            "bytes_submitted": sum(p["bytes"] for p in self.puts.values()),
            "bytes_durable": bytes_durable, "window_s": window,
            "throughput_by": "durable" if self.durable_at else "first read",
            "records_per_s": len(stored_at) / window if window > 0 else float("nan"),
            "mb_per_s": bytes_durable / window / 1e6 if window > 0 else float("nan"),
            "submit_ms": [v * 1e3 for v in percentiles(submit, (0.5, 0.99, 1.0))],
            "durable_ms": [v * 1e3 for v in percentiles(durable)],
            "to_read_ms": [v * 1e3 for v in percentiles(to_read)],
            "read_ms": {mode: [v * 1e3 for v in percentiles(values)]
                        for mode, values in sorted(by_mode.items())},
            "writer": _writer_totals(self.ends),
        }
        out["ok"] = counts["corrupt"] == 0 and counts["lost"] == 0 and \
            counts["dropped_unnamed"] == 0
        return out


def _writer_totals(ends: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("spilled", "dropped", "dropped_journal_full", "dead_lettered", "restarts",
            "retries", "store_errors", "submit_waits", "superseded", "written")
    totals = {key: sum(int(end["stats"].get(key, 0)) for end in ends) for key in keys}
    totals["journal_left"] = sum(int(end.get("journal_left", 0)) for end in ends)
    totals["producers_ended"] = len(ends)
    return totals


def load_dir(directory: str | Path,
             store_losses: Sequence[tuple[float, int | None]] = ()) -> Accounting:
    """An :class:`Accounting` fed with every event file of a scenario's directory."""
    directory = Path(directory)
    accounting = Accounting(store_losses=list(store_losses))
    for path in sorted(directory.glob("producer*.jsonl")):
        log_path = path.with_suffix(".log")
        text = log_path.read_text(errors="replace") if log_path.exists() else ""
        accounting.producer(read_all(path), text)
    for path in sorted(directory.glob("trainer*.jsonl")):
        accounting.trainer(read_all(path))
    return accounting
