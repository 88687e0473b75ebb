"""Partial records of running requests: the routing so far, every N forwarded positions.

A request that runs for hours holds all its rows in the host slot cache until it
finishes, and an engine crash or an abort would lose them.  With
``capture.partial_every_tokens: N`` each running request's routing so far is stored as a
*partial record* whenever its forwarded positions have grown by ``N`` since its last one:
one fused rr-v1 record of positions ``0 .. n-1`` (metadata ``partial: true``,
``num_tokens: n``) under ``{rollout_id}_partial``
(:func:`~fd_routing_replay.keys.partial_key`), each replacing the previous one.  The final
record supersedes it: the writer deletes the partial once the final is durable
(:mod:`fd_routing_replay.writer.turns`).  A crash or an abort leaves the last partial, so
at most ``N`` positions of routing are lost.

Both capture generations use :class:`PartialRecords`: the rows are gathered on the
engine's thread (a preempted request's blocks may be reused by the very next step) and
the record is built and handed to the sink on the outlet's finishing thread, in order
with the finals (so a request's last partial always reaches the writer before its final
record).  The table-API manager checks its slots once per step with
:class:`SlotPartials` (one vectorised comparison; the manager holds none when the feature
is off); FastDeploy 2.6's engine side checks a request when its output reaches the token
processor (:meth:`~fd_routing_replay.capture.finisher.SlotRecordFinisher.progress`).

A request's progress survives preemption (it is kept by request id, not by slot): a
recomputed request writes its next partial only once it has forwarded ``N`` positions
more than the stored one, so the stored partial never shrinks.
"""

from __future__ import annotations

import functools
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from fd_routing_replay.capture.outlet import RecordOutlet
from fd_routing_replay.codec import RoutingRecord
from fd_routing_replay.codec.provenance import tokens_digest
from fd_routing_replay.keys import partial_key

__all__ = ["NO_PARTIALS", "PARTIAL_COUNTERS", "TRACKED_REQUESTS", "PartialRecords", "SlotPartials"]

logger = logging.getLogger(__name__)

PARTIAL_COUNTERS = ("partials_submitted", "partials_failed")
"""Counters the outlet's owner reports once partial records are on."""

TRACKED_REQUESTS = 65536
"""Requests whose last partial the engine side remembers; an aborted request's entry is
only forgotten when this many newer requests have written partials."""


class PartialRecords:
    """Which running request is due a partial record, and handing it to the sink.

    ``every_tokens``: forwarded positions between two partials of one request.  ``outlet``:
    the finals' outlet (its assembler, provenance, sink, counters and finishing thread).
    Not thread-safe: the engine thread calls it (the finishing thread only builds).
    """

    def __init__(self, every_tokens: int, outlet: RecordOutlet, *,
                 max_tracked: int = TRACKED_REQUESTS) -> None:
        if isinstance(every_tokens, bool) or not isinstance(every_tokens, int) or every_tokens < 1:
            raise ValueError(f"capture.partial_every_tokens must be a positive int to write "
                             f"partial records, got {every_tokens!r}")
        self.every = every_tokens
        self.outlet = outlet
        self.max_tracked = max_tracked
        self.progress: OrderedDict[str, int] = OrderedDict()   # request id -> tokens in its last partial
        for name in PARTIAL_COUNTERS:
            outlet.counters.setdefault(name, 0)

    def last(self, request_id: str | None) -> int:
        """Positions in ``request_id``'s last partial record (0: none yet)."""
        return self.progress.get(request_id, 0) if request_id is not None else 0

    def due(self, request_id: str, num_tokens: int) -> bool:
        """Whether a request that forwarded ``num_tokens`` positions is due a partial."""
        return num_tokens - self.progress.get(request_id, 0) >= self.every

    def submit(self, rollout_id: str, request_id: str | None, ids: np.ndarray, *,
               tokens: np.ndarray | None = None) -> None:
        """Hand gathered ``ids [L, n, K]`` (owned from now on) on as ``rollout_id``'s
        partial record; ``tokens``: its ``n`` forwarded token ids, hashed into the provenance."""
        if request_id is not None:
            self.skip(request_id, int(ids.shape[1]))
        self.outlet.finishing.submit(functools.partial(self._deliver, rollout_id, request_id, ids, tokens),
                                     ids.nbytes)

    def skip(self, request_id: str, num_tokens: int) -> None:
        """Count ``num_tokens`` as covered without a record (one that cannot be written),
        so the request is not tried again before ``every`` more positions."""
        self.progress[request_id] = num_tokens
        self.progress.move_to_end(request_id)
        while len(self.progress) > self.max_tracked:
            self.progress.popitem(last=False)

    def forget(self, request_id: str | None) -> None:
        """The request finished: its final record supersedes the partials."""
        self.progress.pop(request_id, None)

    def clear(self) -> None:
        """RL weight update: every running request is dropped."""
        self.progress.clear()

    def failed(self, rollout_id: str, request_id: str | None, exc: BaseException) -> None:
        """Count and log a partial record that could not be gathered or handed on."""
        self.outlet.count("partials_failed")
        logger.error("routing replay: could not write the partial record of rollout %s (request "
                     "%s): %r", rollout_id, request_id, exc)

    # ------------------------------------------------------------------ the finishing thread
    def build(self, rollout_id: str, request_id: str | None, ids: np.ndarray,
              tokens: np.ndarray | None = None) -> RoutingRecord:
        """The partial record of ``ids``: fused, unpadded, marked ``partial: true``."""
        assembler = self.outlet.assembler
        fill = assembler.host_cache.fill_value
        num_tokens = int(ids.shape[1])
        metadata = dict(assembler.metadata, num_tokens=num_tokens, partial=True)
        if request_id is not None:
            metadata["request_id"] = request_id
        missing = int(np.count_nonzero((ids == fill).any(axis=(0, 2)))) if num_tokens else 0
        if missing:
            metadata["missing_tokens"] = missing
        provenance = self.outlet.provenance or assembler.provenance
        if tokens is not None:
            provenance = replace(provenance, tokens_hash=tokens_digest(tokens))
        return RoutingRecord(rollout_id, ids, assembler.num_experts, fill, metadata,
                             layers=assembler.layer_map, provenance=provenance)

    def _deliver(self, rollout_id: str, request_id: str | None, ids: np.ndarray,
                 tokens: np.ndarray | None) -> None:
        try:
            record = self.build(rollout_id, request_id, ids, tokens)
            if self.outlet.sink.put(partial_key(rollout_id), record) is False:
                self.outlet.count("partials_failed")          # dropped by the writer (logged there)
                return
            self.outlet.count("partials_submitted")
        except Exception as exc:
            self.failed(rollout_id, request_id, exc)


class SlotPartials:
    """The table-API manager's partial records: one vectorised check of its slots per step.

    ``forwarded``, ``registered`` and ``damaged`` are the manager's per-slot arrays (read,
    never written), ``rollout_ids`` its per-slot rollout ids; ``slots_of(slot, n)`` maps a
    slot's positions ``0 .. n-1`` to KV slots through its block table, whose rows the
    outlet's assembler gathers.  ``partials`` None: the feature is off (:data:`NO_PARTIALS`,
    every method does nothing).
    """

    def __init__(self, partials: PartialRecords | None, forwarded: np.ndarray, registered: np.ndarray,
                 damaged: np.ndarray, rollout_ids: Sequence[str | None],
                 slots_of: Callable[[int, int], np.ndarray]) -> None:
        self.partials = partials
        self.forwarded, self.registered, self.damaged = forwarded, registered, damaged
        self.rollout_ids = rollout_ids
        self.slots_of = slots_of
        self.last = np.zeros(forwarded.shape[0], dtype=np.int64)   # tokens of each slot's last partial
        self.request_ids: list[str | None] = [None] * forwarded.shape[0]

    def registered_request(self, slot: int, request_id: str) -> None:
        """Slot ``slot`` now holds ``request_id`` (new, or back after a preemption)."""
        if self.partials is None:
            return
        self.request_ids[slot] = request_id
        self.last[slot] = self.partials.last(request_id)

    def after_step(self, active: np.ndarray, finished: np.ndarray, suspended: bool = False) -> None:
        """After a step's finish handling: forget the finished requests, write a partial
        record of each active slot that forwarded ``every`` positions since its last one
        (none while ``suspended``: ``FD_SUSPEND_ROUTING_REPLAY=1`` writes nothing)."""
        if self.partials is None:
            return
        for slot in finished.tolist():
            self.partials.forget(self.request_ids[slot])
            self.request_ids[slot] = None
        forwarded = self.forwarded[active]
        due = forwarded - self.last[active] >= self.partials.every
        if suspended or not due.any():        # the common step
            return
        due &= self.registered[active] & ~self.damaged[active]
        for slot, num_tokens in zip(active[due].tolist(), forwarded[due].tolist(), strict=True):
            self.last[slot] = num_tokens
            rollout_id, request_id = self.rollout_ids[slot], self.request_ids[slot]
            if rollout_id is None:            # no valid rollout id: nothing is stored for it
                continue
            try:
                ids = self.partials.outlet.assembler.gather(self.slots_of(slot, num_tokens))
            except Exception as exc:
                self.partials.failed(rollout_id, request_id, exc)
                continue
            self.partials.submit(rollout_id, request_id, ids)

    def clear(self) -> None:
        """RL weight update: every slot is free, every request dropped."""
        if self.partials is None:
            return
        self.last[:] = 0
        self.request_ids = [None] * len(self.request_ids)
        self.partials.clear()


_NONE = np.zeros(0, dtype=np.int64)
NO_PARTIALS = SlotPartials(None, _NONE, np.zeros(0, dtype=bool), np.zeros(0, dtype=bool), (),
                           lambda slot, n: _NONE)
"""The table-API manager's partial records while ``capture.partial_every_tokens`` is 0."""
