"""Check a verification record end to end: every stored row against the known function.

A record written in verification mode (``capture.verify``) holds, at position ``p`` of MoE
row ``l``, the expert set ``f(p, l, s)`` of :mod:`fd_routing_replay.codec.verification`.
:func:`check_record` decodes every row of a record read back from the store and names each
one that is not where it claims to be, by rollout, position and layer:

* ``missing`` -- the fill value: the position has no routing (a lost step, a slot never
  written, a prefix that did not come back);
* ``foreign`` -- ids that are no verification value (real routing, a hook that did not
  run in verification mode, torn or stale rows);
* ``gather`` -- the TP x EP all-gather put another rank's row in this token's rank share;
* ``position`` -- the row of another position (told apart modulo the period ``P``);
* ``layer`` -- the row of another MoE layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fd_routing_replay.codec.verification import VerificationCode, verification_of
from fd_routing_replay.errors import ConfigError

__all__ = ["FAULT_KINDS", "RecordVerdict", "RowFault", "check_record"]

FAULT_KINDS = ("missing", "foreign", "gather", "position", "layer")
"""Fault kinds, most basic first (a row is reported under the first that applies)."""


@dataclass(frozen=True)
class RowFault:
    """One stored row that is not where it claims to be."""

    rollout_id: str
    position: int
    layer_row: int
    decoder_layer: int
    kind: str
    detail: str

    def describe(self) -> str:
        return (f"rollout {self.rollout_id}, position {self.position}, MoE layer row {self.layer_row} "
                f"(decoder layer {self.decoder_layer}): {self.detail}")


@dataclass
class RecordVerdict:
    """What :func:`check_record` found in one record."""

    rollout_id: str
    num_tokens: int = 0
    expected_tokens: int | None = None
    period: int = 0
    rows_checked: int = 0
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAULT_KINDS, 0))
    faults: list[RowFault] = field(default_factory=list)     # the first ones, in position order
    ranks: dict[int, int] = field(default_factory=dict)      # rows by the TP rank that routed them
    error: str | None = None                                  # not checkable at all

    @property
    def token_count_ok(self) -> bool:
        return self.expected_tokens is None or self.expected_tokens == self.num_tokens

    @property
    def ok(self) -> bool:
        return self.error is None and self.token_count_ok and not any(self.counts.values())

    @property
    def first_fault(self) -> RowFault | None:
        return self.faults[0] if self.faults else None

    def faults_before(self, position: int) -> int:
        """Faults listed at positions below ``position`` (e.g. a prefix-cache hit)."""
        return sum(1 for fault in self.faults if fault.position < position)

    def as_dict(self) -> dict[str, Any]:
        return {"rollout_id": self.rollout_id, "ok": self.ok, "num_tokens": self.num_tokens,
                "expected_tokens": self.expected_tokens, "period": self.period,
                "rows_checked": self.rows_checked, "faults": dict(self.counts),
                "ranks": {str(rank): count for rank, count in sorted(self.ranks.items())},
                "first_fault": None if self.first_fault is None else self.first_fault.describe(),
                "error": self.error}


def _tokens(record: Any) -> int:
    """Positions the record covers (``metadata["num_tokens"]`` for a padded record)."""
    stated = record.metadata.get("num_tokens") if isinstance(record.metadata, dict) else None
    total = int(record.ids.shape[1])
    if isinstance(stated, int) and not isinstance(stated, bool) and 0 <= stated <= total:
        return stated
    return total


def _shift(found: np.ndarray, position: np.ndarray, period: int) -> np.ndarray:
    """The smallest signed shift d with position + d = found (mod P)."""
    delta = np.mod(found - position, period)
    return np.where(delta > period // 2, delta - period, delta)


def check_record(record: Any, *, expected_tokens: int | None = None,
                 max_faults: int = 20) -> RecordVerdict:
    """Decode every row of a verification record and name the misplaced ones.

    ``expected_tokens``: the forwarded positions the request had (prompt + completion - 1
    from the response's usage); a record of another length fails the token count.
    """
    verdict = RecordVerdict(getattr(record, "rollout_id", "?"), expected_tokens=expected_tokens)
    verdict.num_tokens = _tokens(record)
    mark = verification_of(record)
    if mark is None:
        verdict.error = ("not a verification record (no metadata['verification']): was capture.verify "
                         "on in the server when this request ran?")
        return verdict
    ids = np.asarray(record.ids)[:, : verdict.num_tokens]
    num_layers = int(ids.shape[0])
    try:
        code = VerificationCode(int(record.num_experts), int(ids.shape[2]), num_layers,
                                int(mark.get("ranks", 1)))
    except (ConfigError, TypeError, ValueError) as exc:
        verdict.error = f"the record's verification marker {mark!r} does not fit its shape: {exc}"
        return verdict
    verdict.period = code.period
    if mark.get("period") not in (None, code.period):
        verdict.error = (f"the record's verification period {mark.get('period')!r} is not this "
                         f"checker's {code.period} (a different scheme or geometry)")
        return verdict
    verdict.rows_checked = int(ids.shape[0] * ids.shape[1])
    positions = np.arange(ids.shape[1], dtype=np.int64)[None, :]
    rows = np.arange(num_layers, dtype=np.int64)[:, None]
    decoded = code.decode(ids)
    kinds = np.zeros(ids.shape[:2], dtype=np.int8)       # 0 = fine; i + 1 = FAULT_KINDS[i]
    missing = (ids == record.fill_value).any(axis=2)
    foreign = ~missing & ~decoded.valid
    valid = decoded.valid & ~missing
    gather = valid & (decoded.symbol >= code.ranks)
    position = valid & ~gather & (decoded.position != positions % code.period)
    layer = valid & ~gather & ~position & (decoded.layer != rows)
    for index, mask in reversed(list(enumerate((missing, foreign, gather, position, layer)))):
        kinds[mask] = index + 1
    for index, kind in enumerate(FAULT_KINDS):
        verdict.counts[kind] = int(np.count_nonzero(kinds == index + 1))
    routed = valid & ~gather
    symbols, counts = np.unique(decoded.symbol[routed], return_counts=True)
    verdict.ranks = {int(s): int(c) for s, c in zip(symbols, counts, strict=True)}
    layer_map = list(record.layer_map)
    bad_positions, bad_rows = np.nonzero(kinds.T)        # position order, then layer row
    for pos, row in zip(bad_positions[:max_faults].tolist(), bad_rows[:max_faults].tolist(), strict=True):
        kind = FAULT_KINDS[kinds[row, pos] - 1]
        verdict.faults.append(RowFault(verdict.rollout_id, pos, row, int(layer_map[row]), kind,
                                       _detail(kind, code, decoded, ids, row, pos, layer_map)))
    return verdict


def _detail(kind: str, code: VerificationCode, decoded: Any, ids: np.ndarray, row: int, pos: int,
            layer_map: list[int]) -> str:
    """One phrase saying what the row holds instead."""
    found = sorted(int(x) for x in ids[row, pos])
    if kind == "missing":
        return f"no routing (fill value): {found}"
    if kind == "foreign":
        return f"ids {found} are no verification value (real routing, or a row the verification hook did not write)"
    owner = int(decoded.symbol[row, pos]) - code.ranks
    if kind == "gather":
        return f"the TP x EP all-gather put another rank's row in TP rank {owner}'s share"
    held_row = int(decoded.layer[row, pos])
    held_layer = layer_map[held_row] if 0 <= held_row < len(layer_map) else held_row
    if kind == "position":
        shift = int(_shift(np.asarray(decoded.position[row, pos]), np.asarray(pos), code.period))
        where = f"position {pos + shift}" + (f" (mod {code.period})" if pos + shift < 0 else "")
        also = "" if held_row == row else f", of MoE layer row {held_row} (decoder layer {held_layer})"
        return f"holds the row of {where}, {shift:+d}{also}"
    return f"holds MoE layer row {held_row}'s row (decoder layer {held_layer})"
